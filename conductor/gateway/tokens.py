"""Prompt token ids exactly as the engines compute them: the model's own tokenizer and chat
template when the gateway has the model directory, else the engines' `/tokenize`.

Long prompts are tokenized on worker threads, each with its own copy of the tokenizer (a fast
tokenizer is not safe to share between threads): about 1 ms per 1k tokens would otherwise stall
every other request and stream of the gateway's event loop (18k tokens: 50 ms)."""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp

log = logging.getLogger("conductor.gateway")
LONG_PROMPT_CHARS = 4096  # longer prompts (about 1k tokens and up) are tokenized off the event loop


class Tokens:
    def __init__(self, model_dir: str | None = None, threads: int = 2) -> None:
        self._tok = None  # the event loop's own copy
        if model_dir and os.path.exists(os.path.join(model_dir, "tokenizer_config.json")):
            from transformers import AutoTokenizer  # only with a model dir; vLLM installs it

            self._tok = AutoTokenizer.from_pretrained(model_dir)
        self._threads = threading.local()
        self._pool_size = threads  # 0: every prompt on the event loop
        self._pool: ThreadPoolExecutor | None = None

    @property
    def local(self) -> bool:
        return self._tok is not None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _local(self, tok: Any, kind: str, body: dict) -> list[int] | None:
        if kind == "completions":
            prompt = body["prompt"]
            return tok(prompt).input_ids if isinstance(prompt, str) else None
        if not getattr(tok, "chat_template", None):
            return None  # the engine has its own (--chat-template): ask it
        ids = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def _on_worker(self, kind: str, body: dict) -> list[int] | None:
        tok = getattr(self._threads, "tok", None)
        if tok is None:
            tok = self._threads.tok = copy.deepcopy(self._tok)
        return self._local(tok, kind, body)

    async def _local_ids(self, kind: str, body: dict) -> list[int] | None:
        if self._pool_size == 0 or _text_size(kind, body) <= LONG_PROMPT_CHARS:
            return self._local(self._tok, kind, body)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._pool_size, thread_name_prefix="gw-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._on_worker, kind, body)

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
                ids = await self._local_ids(kind, body)
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


def _text_size(kind: str, body: dict) -> int:
    """About how much text a request asks to tokenize (characters)."""
    if kind == "completions":
        prompt = body.get("prompt")
        return len(prompt) if isinstance(prompt, str) else 0
    return sum(len(str(m.get("content", ""))) if isinstance(m, dict) else 0 for m in body.get("messages") or [])
