"""Prompt token ids exactly as the engines compute them: the model's own tokenizer and chat
template when the gateway has the model directory, else the engines' `/tokenize`."""
from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

import aiohttp

log = logging.getLogger("conductor.gateway")


class Tokens:
    def __init__(self, model_dir: str | None = None) -> None:
        self._tok = None
        if model_dir and os.path.exists(os.path.join(model_dir, "tokenizer_config.json")):
            from transformers import AutoTokenizer  # only with a model dir; vLLM installs it

            self._tok = AutoTokenizer.from_pretrained(model_dir)

    @property
    def local(self) -> bool:
        return self._tok is not None

    def _local(self, kind: str, body: dict) -> list[int] | None:
        if kind == "completions":
            prompt = body["prompt"]
            return self._tok(prompt).input_ids if isinstance(prompt, str) else None
        if not getattr(self._tok, "chat_template", None):
            return None  # the engine has its own (--chat-template): ask it
        ids = self._tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    async def ids(self, kind: str, body: dict, session: aiohttp.ClientSession, engine_url: str | None,
                  timeout: float) -> list[int] | None:
        """The prompt's ids, or None when they cannot be known cheaply (routing then ignores caches)."""
        prompt: Any = body.get("prompt")
        if kind == "completions" and isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)  # already token ids
        if kind == "completions" and not isinstance(prompt, str):
            return None  # a batch of prompts: routed by load only
        if self._tok is not None:
            try:
                ids = self._local(kind, body)
                if ids is not None:
                    return ids
            except Exception as exc:  # a template error is the engine's to report, not ours
                log.debug("local tokenization failed: %s", exc)
        if engine_url is None:
            return None
        query = {"model": body.get("model")}
        if kind == "completions":
            query["prompt"] = prompt
        else:
            query.update(messages=body["messages"], add_generation_prompt=True)
            for key in ("chat_template", "chat_template_kwargs", "add_special_tokens"):
                if key in body:
                    query[key] = body[key]
        try:
            async with session.post(engine_url + "/tokenize", data=json.dumps(query),
                                    headers={"Content-Type": "application/json"},
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    return None
                return list((await resp.json())["tokens"])
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
            return None
