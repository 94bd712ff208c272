"""An engine's HTTP API, shaped like `vllm serve`'s where a router or client can see it.

`POST /v1/completions` (a string, token ids, or a batch of either) and `/v1/chat/completions`,
streamed (SSE, `stream_options.include_usage`) or not, `usage.prompt_tokens_details.cached_tokens`
(vLLM with `--enable-prompt-tokens-details`: the prompt tokens found in the prefix cache or
loaded by the connector), `kv_transfer_params` in and out; `GET /v1/models`, `/health`,
`/version`, `/metrics`; `POST /tokenize`, `/reset_prefix_cache`, and the scale-out `/render`
endpoints (403, as `vllm serve` without `--enable-scale-out`, unless enabled). Errors are vLLM's
error object. Fault knobs: 5xx answers, streams cut after their first token, an engine that
dies (its port closes, its requests' connections drop) and comes back empty."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

from .engine import Delivery, Engine, kv_params_of
from .tokenizer import Tokenizer

try:
    import msgspec

    _decode = msgspec.json.decode
    _encode = msgspec.json.encode
except ImportError:  # pragma: no cover - msgspec comes with the gateway extra
    def _decode(raw: bytes) -> Any:
        return json.loads(raw)

    def _encode(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":")).encode()

VERSION = "0.32.0"


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def error_response(message: str, status: int = 400, kind: str = "BadRequestError") -> web.Response:
    return web.Response(body=_encode({"error": {"message": message, "type": kind, "param": None, "code": status}}),
                        status=status, content_type="application/json")


def _token_ids(value: list) -> bool:
    """Integers (not booleans) from 0 to 2^32 - 1; checked at C speed (prompts of 100k ids)."""
    return bool(value) and set(map(type, value)) == {int} and min(value) >= 0 and max(value) < 1 << 32


def _prompts(body: dict, tokenizer: Tokenizer) -> list[list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if _token_ids(prompt):
            return [prompt]
        if set(map(type, prompt)) == {str}:
            return [tokenizer.encode(p) for p in prompt]
        if all(isinstance(p, list) and _token_ids(p) for p in prompt):
            return list(prompt)
    raise BadRequest("prompt must be a string, a list of token ids, or a list of either")


class Front:
    """The HTTP side of one engine; `start()` listens on `port`."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, host: str, port: int, *,
                 enable_scale_out: bool = False) -> None:
        self.engine, self.tokenizer, self.host, self.port = engine, tokenizer, host, port
        self.enable_scale_out = enable_scale_out
        self.model = engine.profile.model
        self.runner: web.AppRunner | None = None
        self.site: web.TCPSite | None = None
        self.requests = 0
        self.errors_injected = 0
        self.cuts_injected = 0
        engine.on_down = self._down
        engine.on_up = self._up

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/reset_prefix_cache", self.reset)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions/render", self.render_completions)
        app.router.add_post("/v1/chat/completions/render", self.render_chat)
        return app

    async def start(self) -> None:
        self.runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self.runner.setup()
        self.site = web.TCPSite(self.runner, self.host, self.port, backlog=1024, reuse_address=True)
        await self.site.start()
        self.port = self.site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def _down(self) -> None:
        asyncio.get_running_loop().create_task(self.stop())

    def _up(self) -> None:
        asyncio.get_running_loop().create_task(self.start())

    # ------------------------------------------------------------------ plain endpoints
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.alive else 503)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                "root": self.model, "parent": None, "max_model_len": self.engine.profile.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.engine.metrics.render(self.engine.scheduler.stats)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def reset(self, request: web.Request) -> web.Response:
        if self.engine.pool.reset():
            self.engine._publish()
            return web.Response(status=200)
        return error_response("the prefix cache cannot be reset while requests hold blocks", 409, "ConflictError")

    async def _json(self, request: web.Request) -> dict:
        try:
            body = _decode(await request.read())
        except Exception as exc:  # noqa: BLE001 - any parse error is the client's
            raise BadRequest(f"invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            if "messages" in body:
                try:
                    ids = self.tokenizer.chat(body["messages"])
                except (ValueError, TypeError, AttributeError) as exc:
                    raise BadRequest(f"messages: {exc}") from None
            elif isinstance(body.get("prompt"), str):
                ids = self.tokenizer.encode(body["prompt"], bool(body.get("add_special_tokens", True)))
            else:
                raise BadRequest("give 'prompt' (a string) or 'messages'")
        except BadRequest as exc:
            return error_response(str(exc), exc.status, exc.kind)
        return web.json_response({"count": len(ids), "max_model_len": self.engine.profile.max_model_len,
                                  "tokens": ids, "token_strs": None})

    async def _render(self, request: web.Request, chat: bool) -> web.Response:
        if not self.enable_scale_out:
            return error_response("Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out "
                                  "to enable them.", 403, "PermissionDeniedError")
        try:
            body = await self._json(request)
            prompts = [self.tokenizer.chat(body.get("messages") or [])] if chat else _prompts(body, self.tokenizer)
        except ValueError as exc:
            return error_response(f"messages: {exc}")
        except BadRequest as exc:
            return error_response(str(exc), exc.status, exc.kind)
        params = {"max_tokens": body.get("max_tokens")}
        items = [{"request_id": uuid.uuid4().hex, "token_ids": ids, "sampling_params": params, "model": self.model}
                 for ids in prompts]
        return web.json_response(items[0] if chat else items)

    async def render_completions(self, request: web.Request) -> web.Response:
        return await self._render(request, False)

    async def render_chat(self, request: web.Request) -> web.Response:
        return await self._render(request, True)

    # ------------------------------------------------------------------ generation
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _check(self, body: dict, chat: bool) -> tuple[list[list[int]], int]:
        model = body.get("model")
        if model is not None and model != self.model:
            raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list")
            try:
                prompts = [self.tokenizer.chat(messages)]
            except ValueError as exc:
                raise BadRequest(f"messages: {exc}") from None
        else:
            prompts = _prompts(body, self.tokenizer)
        limit = self.engine.profile.max_model_len
        longest = max(len(p) for p in prompts)
        default = 16 if not chat else max(1, limit - longest)
        max_tokens = body.get("max_completion_tokens") if chat else None
        max_tokens = max_tokens if max_tokens is not None else body.get("max_tokens", default)
        if max_tokens is None:
            max_tokens = default
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens!r}")
        if longest + max_tokens > limit:
            raise BadRequest(f"This model's maximum context length is {limit} tokens. However, your request has "
                             f"{longest} input tokens and asks for {max_tokens} output tokens.")
        return prompts, max_tokens

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        self.requests += 1
        engine = self.engine
        try:
            body = await self._json(request)
            prompts, max_tokens = self._check(body, chat)
        except BadRequest as exc:
            return error_response(str(exc), exc.status, exc.kind)
        if not engine.alive:
            return error_response("engine is not running", 503, "ServiceUnavailableError")
        if engine.faults.error_rate and engine.random.random() < engine.faults.error_rate:
            self.errors_injected += 1
            return error_response("EngineCore encountered an issue (injected fault)", 500, "InternalServerError")
        stream = bool(body.get("stream"))
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        params = kv_params_of(body)
        deliveries = [engine.submit(p, max_tokens, stream=stream, cache_salt=salt, kv_params=params) for p in prompts]
        try:
            if stream:
                return await self._stream(request, body, deliveries, chat)
            return await self._whole(request, deliveries, chat)
        finally:
            for delivery in deliveries:
                engine.abort(delivery)

    def _usage(self, deliveries: list[Delivery]) -> dict:
        prompt = sum(d.request.num_prompt for d in deliveries)
        completion = sum(d.delivered for d in deliveries)
        cached = sum(d.request.local_hit_tokens + d.request.external_hit_tokens for d in deliveries)
        # Beyond vLLM's fields (clients ignore unknown ones): which engine answered and what its own
        # prefix cache held of the prompt on arrival, the truth a router's credit is checked against.
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
                "prompt_tokens_details": {"cached_tokens": cached},
                "standin": {"engine": self.engine.index,
                            "local_tokens_on_arrival": sum(d.request.arrival_local_tokens for d in deliveries)}}

    async def _whole(self, request: web.Request, deliveries: list[Delivery], chat: bool) -> web.Response:
        choices, params = [], None
        for index, delivery in enumerate(deliveries):
            reason, kv = await self._drain(delivery)
            if reason is None:  # the engine died: the connection goes with it
                request.transport.close() if request.transport is not None else None
                return web.Response(status=500)
            params = params or kv
            text = self.tokenizer.decode_one(0) * delivery.delivered
            if chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text, "tool_calls": []},
                                "logprobs": None, "finish_reason": reason, "stop_reason": None})
            else:
                choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": reason,
                                "stop_reason": None, "prompt_logprobs": None})
        body = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "object":
                "chat.completion" if chat else "text_completion", "created": int(time.time()), "model": self.model,
                "choices": choices, "usage": self._usage(deliveries), "kv_transfer_params": params}
        return web.Response(body=_encode(body), content_type="application/json")

    @staticmethod
    async def _drain(delivery: Delivery) -> tuple[str | None, dict | None]:
        while True:
            kind, *rest = await delivery.queue.get()
            if kind == "done":
                return rest[0], rest[1]
            if kind == "error":
                return None, None

    async def _stream(self, request: web.Request, body: dict, deliveries: list[Delivery],
                      chat: bool) -> web.StreamResponse:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        head = {"id": rid, "object": obj, "created": created, "model": self.model}
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                      "Cache-Control": "no-cache"})
        await out.prepare(request)

        def event(choices: list, **extra) -> bytes:
            payload = {**head, "choices": choices, **extra}
            if include_usage and "usage" not in extra:
                payload["usage"] = None
            return b"data: " + _encode(payload) + b"\n\n"

        if chat:
            await out.write(b"".join(event([{"index": i, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]) for i in range(len(deliveries))))
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, delivery: Delivery) -> None:
            while True:
                item = await delivery.queue.get()
                await merged.put((index, item))
                if item[0] in ("done", "error"):
                    return

        pumps = [asyncio.create_task(pump(i, d)) for i, d in enumerate(deliveries)]
        open_ = len(deliveries)
        params = None
        first = True
        try:
            while open_:
                index, (kind, *rest) = await merged.get()
                if kind == "error":
                    if request.transport is not None:
                        request.transport.close()  # the engine died mid-stream: no [DONE]
                    return out
                if kind == "tokens":
                    text = self.tokenizer.decode_one(0) * rest[0]
                    choice = ({"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
                              if chat else {"index": index, "text": text, "logprobs": None, "finish_reason": None,
                                            "stop_reason": None})
                    await out.write(event([choice]))
                    if first and self.engine.faults.die_mid_stream and \
                            self.engine.random.random() < self.engine.faults.die_mid_stream:
                        self.cuts_injected += 1
                        if request.transport is not None:
                            request.transport.close()
                        return out
                    first = False
                else:  # done: the last tokens, with the finish reason
                    open_ -= 1
                    params = params or rest[1]
                    text = self.tokenizer.decode_one(0) * rest[2]
                    choice = ({"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": rest[0]}
                              if chat else {"index": index, "text": text, "logprobs": None, "finish_reason": rest[0],
                                            "stop_reason": None})
                    extra = {"kv_transfer_params": params} if params else {}
                    await out.write(event([choice], **extra))
            if include_usage:
                await out.write(event([], usage=self._usage(deliveries)))
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out
        finally:
            for task in pumps:
                task.cancel()
