"""One request's prefill -> decode hand-off over vLLM's HTTP API, with failover.

The prefill goes out with `max_tokens=1` and `kv_transfer_params={"do_remote_decode": true}`
(vLLM's disaggregated-proxy convention); the `kv_transfer_params` it returns ride along in the
decode request. A failed prefill moves to another prefill engine, then to the decode engine
(colocated); a decode that fails before its first token is retried once elsewhere."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from .errors import ApiError, UpstreamFailed
from .load import Load
from .pool import Engine

log = logging.getLogger("conductor.gateway")
JSON = {"Content-Type": "application/json"}

try:  # msgspec (the gateway extra) writes a 100k-token prompt ~10x faster than the json module
    import msgspec

    _encode = msgspec.json.encode
except ImportError:  # pragma: no cover
    def _encode(value: Any) -> bytes:
        return json.dumps(value).encode()


@dataclass
class Timing:
    """Where a request's time went; overhead = total - upstream."""

    start: float = field(default_factory=time.perf_counter)
    upstream: float = 0.0
    first_byte: float | None = None


def prefill_body(kind: str, body: dict) -> dict:
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    out["max_tokens"] = 1
    if kind == "chat" and "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


async def _failed_status(resp: aiohttp.ClientResponse, url: str) -> None:
    """5xx: the engine's fault, try elsewhere; 4xx: the request's fault, pass it to the client."""
    text = await resp.text()
    if resp.status >= 500:
        raise UpstreamFailed(url, f"HTTP {resp.status}: {text[:300]}")
    raise PassThrough(resp.status, text)


class PassThrough(Exception):
    """An engine's own 4xx answer, returned to the client unchanged."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status, self.text = status, text

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=self.text, content_type="application/json")


async def run_prefill(session: aiohttp.ClientSession, engine: Engine, kind: str, body: dict, uncached: int,
                      timeout: float, timing: Timing, prompt_tokens: int = 0) -> dict | None:
    """The engine's `kv_transfer_params` (None when it returned none: decode then recomputes).
    While it runs the engine holds the prompt's KV (`prompt_tokens`), counted as its load between
    two scrapes of its metrics like a decode's."""
    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    t = time.perf_counter()
    try:
        with Load(engine, queued_tokens=uncached, kv_tokens=prompt_tokens):
            async with session.post(engine.url + path, data=_encode(prefill_body(kind, body)), headers=JSON,
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    await _failed_status(resp, engine.url)
                answer = await resp.json()
        return answer.get("kv_transfer_params")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        raise UpstreamFailed(engine.url, f"{type(exc).__name__}: {exc}") from exc
    finally:
        timing.upstream += time.perf_counter() - t


def _has_token(event: bytes) -> bool:
    """Does one SSE event carry a generated token, a finish, or the end? A token's text may be empty
    (a special token, a partial character); chat opens with a role-only delta, which is no token."""
    data = event.strip()
    if not data.startswith(b"data:"):
        return False
    data = data[5:].strip()
    if data == b"[DONE]":
        return True
    try:
        chunk = json.loads(data)
    except ValueError:
        return True  # not ours to judge: pass it on
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if "text" in choice or choice.get("finish_reason") or delta.get("tool_calls") \
                or ("content" in delta and "role" not in delta):
            return True
    return "error" in chunk


async def open_decode(session: aiohttp.ClientSession, engine: Engine, kind: str, body: dict,
                      kv_params: dict | None, first_timeout: float, total_timeout: float,
                      timing: Timing, raw: bytes | None = None) -> tuple[aiohttp.ClientResponse, bytes]:
    """Send the decode; return once its first token (or the whole answer) arrived. `raw`: the
    client's own body, sent as it came when nothing is added to it."""
    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    if kv_params or raw is None:
        payload: dict[str, Any] = dict(body)
        if kv_params:
            payload["kv_transfer_params"] = kv_params
        data = _encode(payload)
    else:
        data = raw
    t = time.perf_counter()
    resp = None
    try:
        resp = await session.post(engine.url + path, data=data, headers=JSON,
                                  timeout=aiohttp.ClientTimeout(total=total_timeout, sock_read=first_timeout))
        if resp.status != 200:
            await _failed_status(resp, engine.url)
        if not body.get("stream"):
            data = await resp.read()
            return resp, data
        buf = b""
        while True:  # buffer until the first real token: a failure before it is retried elsewhere
            chunk = await resp.content.readany()
            if not chunk:
                raise UpstreamFailed(engine.url, "stream ended before the first token")
            buf += chunk
            events = buf.split(b"\n\n")
            if any(_has_token(e) for e in events[:-1]):
                return resp, buf
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        if resp is not None:
            resp.close()
        raise UpstreamFailed(engine.url, f"{type(exc).__name__}: {exc}") from exc
    except BaseException:
        if resp is not None:
            resp.close()
        raise
    finally:
        timing.upstream += time.perf_counter() - t


def sse_error(message: str) -> bytes:
    return b"data: " + json.dumps(ApiError(502, message).body()).encode() + b"\n\n"
