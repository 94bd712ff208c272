"""Prompt token ids exactly as the engines compute them: the model's own tokenizer and chat
template when the gateway has the model directory, else the engines' `/tokenize`.

Long prompts are tokenized on worker threads, each with its own copy of the tokenizer (a fast
tokenizer is not safe to share between threads): about 1.5–2 µs per token here, which on the event
loop would hold up every other request and stream of the gateway (22k tokens: 35–50 ms). Building
the id list still holds the GIL, so a huge prompt still costs the loop a little."""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import queue
import threading
from collections.abc import Mapping
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
        # One copy per worker, made here: a copy holds the GIL (hundreds of ms for a big vocabulary).
        self._copies: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(threads if self._tok is not None else 0):
            self._copies.put(copy.deepcopy(self._tok))
        self._per_thread = threading.local()
        self._pool_size = threads if self._tok is not None else 0  # 0: every prompt on the event loop
        self._pool: ThreadPoolExecutor | None = None

    @property
    def local(self) -> bool:
        return self._tok is not None

    def close(self) -> None:
        """Stop the worker threads; any later prompt is tokenized on the event loop."""
        self._pool_size = 0
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _local(self, tok: Any, kind: str, body: dict) -> list[int] | None:
        if kind == "completions":
            prompt = body["prompt"]
            return tok(prompt).input_ids if isinstance(prompt, str) else None
        if not getattr(tok, "chat_template", None):
            return None  # the engine has its own (--chat-template): ask it
        ids = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)  # transformers 5: a BatchEncoding

    def _on_worker(self, kind: str, body: dict) -> list[int] | None:
        tok = getattr(self._per_thread, "tok", None)
        if tok is None:  # the pool starts at most `threads` threads: one copy each
            tok = self._per_thread.tok = self._copies.get_nowait()
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
        if kind == "completions" and isinstance(prompt, list) and prompt and type(prompt[0]) is int:
            return prompt  # token ids (validate.check_prompt: one kind throughout; never changed in place)
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
    """About how much text a request asks to tokenize (characters): a message's text parts and
    tool-call arguments, and the tool schemas a chat template renders into the prompt."""
    if kind == "completions":
        prompt = body.get("prompt")
        return len(prompt) if isinstance(prompt, str) else 0
    size = sum(_message_size(m) for m in body.get("messages") or [] if isinstance(m, dict))
    tools = body.get("tools")
    return size + (sum(len(str(tool)) for tool in tools) if isinstance(tools, list) else 0)


def _message_size(message: dict) -> int:
    content = message.get("content")
    size = len(content) if isinstance(content, str) else 0
    if isinstance(content, list):
        size += sum(len(str(part.get("text", ""))) for part in content if isinstance(part, dict))
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            size += len(str(function.get("arguments", "")))
    return size
