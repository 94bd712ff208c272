"""Fake vLLM engines (aiohttp, in-process) for the gateway's unit tests: they answer like
`vllm serve` and can be told to fail, hang or die mid-stream."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
from aiohttp import web

from conductor.gateway import Gateway, GatewayConfig

MODEL = "tiny"
BLOCK = 16


@dataclass
class FakeEngine:
    name: str
    fail_status: int | None = None  # answer generation requests with this status
    hang: bool = False  # never answer generation requests
    die_after_chunks: int | None = None  # streaming: drop the connection after this many events
    healthy: bool = True
    stream_delay: float = 0.0
    first_token_delay: float = 0.0  # a prefill's time before any answer
    requests: list[dict] = field(default_factory=list)
    cancelled: int = 0
    url: str = ""
    waiting: int = 0
    kv_usage: float = 0.25  # its /metrics' vllm:kv_cache_usage_perc
    kv_blocks: int | None = None  # with it, /metrics says the KV capacity (vllm:cache_config_info)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        return app

    async def health(self, request):
        return web.Response(status=200 if self.healthy else 503)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def metrics(self, request):
        capacity = "" if self.kv_blocks is None else \
            f'vllm:cache_config_info{{block_size="{BLOCK}",num_gpu_blocks="{self.kv_blocks}",engine="0"}} 1.0\n'
        return web.Response(text=f'vllm:num_requests_running{{engine="0"}} 0.0\n'
                                 f'vllm:num_requests_waiting{{engine="0"}} {self.waiting}.0\n'
                                 f'vllm:kv_cache_usage_perc{{engine="0"}} {self.kv_usage}\n' + capacity)

    async def tokenize(self, request):
        body = await request.json()
        text = body.get("prompt") or json.dumps(body.get("messages"))
        return web.json_response({"tokens": [ord(c) % 500 for c in text], "count": len(text)})

    async def generate(self, request):
        body = await request.json()
        self.requests.append(body)
        try:
            if self.hang:
                await asyncio.sleep(3600)
            if self.fail_status:
                return web.json_response({"error": {"message": "boom", "type": "internal"}}, status=self.fail_status)
            await asyncio.sleep(self.first_token_delay)
            text = f"from-{self.name}"
            params = {"kvstore": {"fingerprint": "f", "num_blocks": 1, "by": self.name}} \
                if (body.get("kv_transfer_params") or {}).get("do_remote_decode") else None
            if not body.get("stream"):
                return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                                          "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                                          "kv_transfer_params": params})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chat = "messages" in body
            events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}] if chat else []
            for i, piece in enumerate(text.split("-")):
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                events.append({"id": "cmpl-1", "choices": [choice]})
            for n, event in enumerate(events):
                if self.die_after_chunks is not None and n >= self.die_after_chunks:
                    request.transport.close()  # a crash: no [DONE], the socket just goes
                    return resp
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                await asyncio.sleep(self.stream_delay)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


async def start_fakes(*engines: FakeEngine) -> list[web.AppRunner]:
    runners = []
    for engine in engines:
        runner = web.AppRunner(engine.app(), handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        engine.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        runners.append(runner)
    return runners


class Rig:
    """Fake engines + a gateway, all in this event loop. `source`: the address the rig's own client
    (`rig.http`, `rig.post`) connects from, e.g. 127.0.1.1: another /24 than a test's 127.0.0.x."""

    def __init__(self, prefill: list[FakeEngine], decode: list[FakeEngine], *, source: str | None = None,
                 **config) -> None:
        self.prefill, self.decode, self.config, self.source = prefill, decode, config, source

    async def __aenter__(self) -> "Rig":
        self.runners = await start_fakes(*self.prefill, *self.decode)
        config = GatewayConfig(prefill=[e.url for e in self.prefill], decode=[e.url for e in self.decode],
                               **{"block_tokens": BLOCK, "health_interval_s": 0.1, "prefill_timeout_s": 2.0,
                                  "local_prefill_tokens": 0, **self.config})
        self.gateway = Gateway(config)
        port = await self.gateway.start()
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        local = {"local_addr": (self.source, 0)} if self.source else {}
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(**local))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.close()
        await self.gateway.stop()
        for runner in self.runners:
            await runner.cleanup()

    async def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict | str]:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        async with self.http.post(self.url + path, data=data, headers=headers or {}) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text


async def raw_request(port: int, data: bytes = b"", source: str | None = None,
                      host: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A bare TCP connection to the gateway (from `source`, when given) that has sent `data`:
    a half-sent request stays half-sent."""
    reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0) if source else None)
    if data:
        writer.write(data)
        await writer.drain()
    return reader, writer


async def read_answer(reader: asyncio.StreamReader, timeout: float = 5.0) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 answer off a bare connection: (status, lower-cased headers, body); status 0 when
    the connection closed (or was reset) before any answer."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    except (asyncio.IncompleteReadError, ConnectionError):
        return 0, {}, b""
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:] if line))
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), timeout)
    return int(lines[0].split()[1]), headers, body


async def closed(reader: asyncio.StreamReader, timeout: float) -> bool:
    """Does the server close this connection within `timeout` (whatever it sends first)?"""
    async def drain() -> None:
        while await reader.read(65536):
            pass

    try:
        await asyncio.wait_for(drain(), timeout)
        return True
    except ConnectionError:
        return True
    except asyncio.TimeoutError:
        return False


def completion(prompt, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, **kw}


async def until(condition: Callable[[], object], timeout: float = 10.0, every: float = 0.02) -> bool:
    """Wait until `condition()` holds, checking every `every` s, for up to `timeout` s; whether it
    held. A loaded machine can take seconds for what takes milliseconds alone, so tests wait for
    the state rather than sleep a fixed time."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(every)
    return True
