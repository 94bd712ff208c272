"""The gateway's HTTP app: OpenAI endpoints in front, engines behind."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web

from kvstore.keys import ModelFingerprint, chain_hashes, encode_extra_keys

from ..cost import CostModel
from ..policies import Slo
from .config import GatewayConfig
from .errors import ApiError, UpstreamFailed
from .fingerprint import EnginesFingerprint, engines_fingerprint, gateway_fingerprint
from .flow import PassThrough, Timing, open_decode, run_prefill, sse_error
from .guard import CLOSE, ConnectionGuard, GuardedHandler, descriptor_room
from .kv_events import KVEventFollower
from .load import Load
from .metrics import GatewayMetrics
from .pool import Engine, Pool
from .prefix import PrefixTracker
from .route import Route, Router
from .tenancy import TENANT, bind_salt, match_key
from .tokens import Tokens
from .usage import Usage, UsageMetrics
from .validate import check_fields, choices, parse

log = logging.getLogger("conductor.gateway")
KINDS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
STRIPPED: Any = web.RequestKey("conductor_gateway_stripped", bool) if hasattr(web, "RequestKey") \
    else "conductor_gateway_stripped"  # the body lost fields: the client's raw bytes are not forwarded
CREDIT_HEADER = "X-Conductor-Credited-Tokens"  # prompt tokens routing believed the engine held in its own cache


def salt_extras(body: dict) -> list[bytes | None] | None:
    """A request's `cache_salt` starts its own chain, as vLLM and the connector key it (first block)."""
    salt = body.get("cache_salt")
    return [encode_extra_keys((("cache_salt", salt),))] if isinstance(salt, str) and salt else None


class Gateway:
    """`await Gateway(config).start(host, port)`; `await stop()`."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config.validate()
        self.pool = Pool(config.prefill, config.decode, interval=config.health_interval_s,
                         timeout=config.connect_timeout_s)
        self.tracker = PrefixTracker()
        self.followers: list[KVEventFollower] = []
        self.metrics = GatewayMetrics(self.pool, lambda: float(sum(f.events for f in self.followers)))
        self.tokens = Tokens(config.model_dir, config.tokenize_threads)
        self.fingerprint: ModelFingerprint | EnginesFingerprint = gateway_fingerprint(config)
        self._adopted = False  # the engines' fingerprint taken in place of the model dir's
        self.mirror = None
        self.router: Router | None = None
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self.guard = ConnectionGuard(config.max_connections, config.max_connections_per_source,
                                     config.header_timeout_s, self.metrics, config.shed_after_s)
        self.metrics.open_connections.set_function(lambda: float(self.guard.open))
        self.usage = Usage(UsageMetrics(self.metrics.registry, CostModel.from_dict(config.cost) if config.cost
                                        else CostModel(), config.gpu_hour_price, config.gpus_per_engine))
        self.port = 0

    # ------------------------------------------------------------ lifecycle
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        if self.config.metadata:
            from kvstore.index import open_mirror

            self.mirror = await asyncio.to_thread(lambda: open_mirror(self.config.metadata, self.config.cluster).start())
        self.router = Router(self.pool, self.tracker, self.fingerprint, mirror=self.mirror, policy=self.config.policy,
                             cost=CostModel.from_dict(self.config.cost) if self.config.cost else None,
                             slo=Slo(self.config.slo_ttft_ms, self.config.slo_tbt_ms),
                             block_tokens=self.config.block_tokens,
                             local_prefill_tokens=self.config.local_prefill_tokens,
                             overflow_kv_share=self.config.overflow_kv_share)
        # Connection reuse matters: a fresh TCP connection per call would cost more than routing.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                                             timeout=aiohttp.ClientTimeout(sock_connect=self.config.connect_timeout_s))
        # An engine out of the rotation comes back empty if it restarted: its view goes now, so no
        # route is ever credited with blocks it lost (its events rebuild the view once it is back).
        self.pool.on_down = lambda engine: self.tracker.clear(engine.url)
        await self.pool.check_all(self.session)
        self._tasks.append(asyncio.create_task(self.pool.run(self.session)))
        for url, endpoint in self.config.kv_events.items():
            follower = KVEventFollower(url.rstrip("/"), endpoint, self.tracker, self.fingerprint,
                                       self.config.kv_events_replay.get(url))
            self.followers.append(follower)
            self._tasks.append(asyncio.create_task(follower.run()))
        self._fit_descriptors()
        # aiohttp's keep-alive (an hour by default) bounds idle connections; the guard, the rest.
        handler_args = {"keepalive_timeout": self.config.keepalive_timeout_s, "access_log": None}
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, **handler_args)
        await self._runner.setup()
        server, guard, loop = self._runner.server, self.guard, asyncio.get_running_loop()
        self._listener = await loop.create_server(lambda: GuardedHandler(server, guard, loop=loop, **handler_args),
                                                  host, port, backlog=1024)
        self.port = self._listener.sockets[0].getsockname()[1]
        return self.port

    def _fit_descriptors(self) -> None:
        """Client connections must never take the descriptors engine calls need (EMFILE stops accept()
        for everyone): the caps come down to what `ulimit -n` leaves room for."""
        room = descriptor_room()
        if room is None or room >= self.guard.max_connections:
            return
        wanted, per_source = self.guard.max_connections, self.guard.per_source
        self.guard.resize(room, max(1, per_source * room // wanted) if per_source else 0)
        log.warning("max_connections %d lowered to %d (per source: %d) to fit the descriptor limit (ulimit -n); "
                    "raise the limit to admit more", wanted, room, self.guard.per_source)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()  # no new connections; the runner closes the open ones
        if self._runner is not None:
            await self._runner.cleanup()
        if self.session is not None:
            await self.session.close()
        if self.mirror is not None:
            await asyncio.to_thread(self.mirror.stop)
        self.tokens.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[self._errors, self._auth])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        return app

    # ------------------------------------------------------------ middleware
    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        endpoint = request.path if request.path in KINDS or request.path in ("/health", "/metrics", "/v1/models") \
            else "other"
        try:
            resp = await handler(request)
        except ApiError as exc:
            resp = exc.response()
        except PassThrough as exc:
            resp = exc.response()
        except web.HTTPRequestEntityTooLarge:
            resp = ApiError(413, f"request body over {self.config.max_body_bytes} bytes",
                            code="body_too_large").response()
        except web.HTTPException as exc:
            resp = ApiError(exc.status, exc.reason or "error").response()
        except asyncio.CancelledError:
            self.metrics.cancelled.inc()
            raise
        except Exception:  # a bug must cost one request, not the gateway
            log.exception("unhandled error on %s", request.path)
            resp = ApiError(500, "internal gateway error").response()
        if request.get(CLOSE) and not resp.prepared:
            resp.force_close()  # tell the client: the connection closes after this answer
        self.metrics.requests.labels(endpoint, str(resp.status)).inc()
        return resp

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        if self.config.api_keys:
            given = request.headers.get("Authorization", "")
            token = given[7:].encode() if given.startswith("Bearer ") else b""
            key = match_key(token, self.config.api_keys)  # every key compared, in constant time
            request[TENANT] = key
            if key is None:
                # No keep-alive and no body read without a key: a stranger holds a connection no
                # longer than the header timeout (health probes, which need none, included).
                request[CLOSE] = True
                if request.path != "/health":
                    raise ApiError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                   code="invalid_api_key")
        return await handler(request)

    # ------------------------------------------------------------ plain endpoints
    async def health(self, request: web.Request) -> web.Response:
        engines = [{"url": e.url, "role": e.role, "healthy": e.healthy, "inflight": e.inflight,
                    "running": e.running, "waiting": e.waiting} for e in self.pool.engines]
        ok = bool(self.pool.role("decode"))
        return web.json_response({"status": "ok" if ok else "unavailable", "engines": engines,
                                  "index_stale": None if self.mirror is None else self.mirror.stale},
                                 status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "created": now, "owned_by": "vllm"} for m in self.pool.models()]})

    # ------------------------------------------------------------ generation
    async def _body(self, request: web.Request, kind: str) -> dict:
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")  # not read at all
        try:
            raw = await asyncio.wait_for(request.read(), self.config.body_timeout_s)  # 413 past max_body_bytes
        except asyncio.TimeoutError:
            self.metrics.body_timeouts.inc()
            request[CLOSE] = True  # the rest of the body is not waited for
            raise ApiError(408, f"request body not received within {self.config.body_timeout_s:g} s",
                           code="body_timeout") from None
        body = parse(raw, self.config.max_json_depth)
        need = "prompt" if kind == "completions" else "messages"
        if need not in body:
            raise ApiError(400, f"missing required field {need!r}", param=need)
        if not isinstance(body.get("model"), str):
            raise ApiError(400, "missing required field 'model' (a string)", param="model")
        models = self.pool.models()
        if models and body["model"] not in models:
            raise ApiError(404, f"the model {body['model']!r} does not exist; served: {models}", param="model",
                           code="model_not_found")
        check_fields(kind, body, self.config.max_n)
        if bind_salt(body, request.get(TENANT), self.config.salt_secret) | self.usage.prepare(request, body):
            request[STRIPPED] = True  # the caller's salt must never reach an engine as sent
        if body.pop("kv_transfer_params", None) is not None:
            # Hand-off parameters are the gateway's to give: a client's own could point a decode engine
            # at blocks it did not ask for (the engines verify them, but they are never forwarded).
            request[STRIPPED] = True
            self.metrics.client_kv_params_dropped.inc()
        return body

    async def generate(self, request: web.Request) -> web.StreamResponse:
        kind = KINDS[request.path]
        timing = Timing()
        body = await self._body(request, kind)
        any_engine = next(iter(self.pool.role("decode") + self.pool.role("prefill")), None)
        t = time.perf_counter()
        ids = await self.tokens.ids(kind, body, self.session, None if any_engine is None else any_engine.url,
                                    self.config.connect_timeout_s)
        if not self.tokens.local:
            timing.upstream += time.perf_counter() - t  # the engine's /tokenize, not gateway work
        hashes = chain_hashes(self.fingerprint, ids, extras=salt_extras(body)) if ids else []
        prompt_tokens = len(ids) if ids else 0
        session = request.headers.get(self.config.session_header) or body.get("user")
        # Every choice decodes its own tokens on the engine: n of them load it n times over.
        output_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16) * choices(body)
        route = self.router.route(hashes, prompt_tokens, output_tokens, session)
        single = kind == "chat" or not isinstance(body.get("prompt"), list) or ids is not None
        kv_params, route = await self._prefill(kind, body, route, hashes, prompt_tokens, output_tokens, session,
                                               single and choices(body) == 1, timing)
        self.usage.begin(request, body, prompt_tokens, route.credited_tokens, kv_params)
        self.metrics.routes.labels("pd" if route.prefill else "colocated").inc()
        self.metrics.route_reasons.labels(route.reason).inc()
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.cached_tokens.inc(route.cached_tokens)
        # A colocated request prefills at its decode engine: that engine's queue until the first token.
        local = 0 if route.prefill else max(0, prompt_tokens - route.cached_tokens)
        return await self._decode(request, kind, body, route, kv_params, hashes, timing, local,
                                  prompt_tokens + output_tokens)

    async def _prefill(self, kind: str, body: dict, route: Route, hashes: list[bytes], prompt_tokens: int,
                       output_tokens: int, session: str | None, disaggregate: bool,
                       timing: Timing) -> tuple[dict | None, Route]:
        """Run the prefill (moving to other prefill engines on failure); None params: colocated."""
        tried: set[str] = set()
        while route.prefill is not None and disaggregate:
            engine = route.prefill
            try:
                params = await run_prefill(self.session, engine, kind, body, prompt_tokens - route.cached_tokens,
                                           self.config.prefill_timeout_s, timing, prompt_tokens)
            except UpstreamFailed as exc:
                log.warning("prefill failed, trying elsewhere: %s", exc)
                self.metrics.upstream_failures.labels("prefill").inc()
                self.metrics.retries.labels("prefill").inc()
                engine.fail(str(exc))
                tried.add(engine.url)
                route = self.router.route(hashes, prompt_tokens, output_tokens, session, exclude=frozenset(tried))
                continue
            self.tracker.add(engine.url, hashes)
            self._check_fingerprint(params)
            return params, route
        return None, replace(route, prefill=None)

    def _check_fingerprint(self, params: dict | None) -> None:
        theirs = ((params or {}).get("kvstore") or {}).get("fingerprint")
        if theirs and theirs != self.fingerprint.digest and self.router.store_enabled and not self.config.fingerprint \
                and not self._adopted and (adopted := engines_fingerprint(str(theirs), self.fingerprint.block_size)):
            # Derived from the model dir, ours missed what the engines also key on: take theirs
            # (once: engines that then disagree among themselves fall to the warning below).
            log.info("engines key the store under fingerprint %s (the model dir gave %s): routing by theirs",
                     theirs, self.fingerprint.digest)
            self._adopted = True
            self.fingerprint = self.router.fingerprint = adopted
            for follower in self.followers:
                follower.fingerprint = adopted
            return
        if theirs and theirs != self.fingerprint.digest and self.router.store_enabled:
            log.warning("engines key the store under fingerprint %s, the gateway under %s: store hits ignored "
                        "(pass the engines' fingerprint in the gateway config)", theirs, self.fingerprint.digest)
            self.router.store_enabled = False

    async def _decode(self, request: web.Request, kind: str, body: dict, route: Route, kv_params: dict | None,
                      hashes: list[bytes], timing: Timing, local_tokens: int = 0,
                      kv_tokens: int = 0) -> web.StreamResponse:
        engine = route.decode
        tried: set[str] = set()
        # read (and kept by aiohttp) in _body: forwarded as is when unchanged
        raw = None if request.get(STRIPPED) else await request.read()
        for attempt in (0, 1):
            current = engine  # (a retry picks another engine; the counts stay with this one)
            with Load(current, queued_tokens=local_tokens, kv_tokens=kv_tokens) as load:
                try:
                    resp, first = await open_decode(self.session, current, kind, body, kv_params,
                                                    self.config.prefill_timeout_s, self.config.decode_timeout_s,
                                                    timing, raw)
                except UpstreamFailed as exc:
                    self.metrics.upstream_failures.labels("decode").inc()
                    current.fail(str(exc))
                    tried.add(current.url)
                    retry = self.router.retry_decode(frozenset(tried), whole_request=route.reason == "overflow")
                    if attempt or retry is None:
                        raise ApiError(502, f"decode failed: {exc}", code="upstream_failed") from exc
                    log.warning("decode failed before its first token, retrying elsewhere: %s", exc)
                    self.metrics.retries.labels("decode").inc()
                    engine = retry
                    continue
                finally:
                    load.started()  # the first token is out (or never will be): its prefill queue is gone
                if route.prefill is None:
                    self.tracker.add(current.url, hashes)
                # What routing credited the engine with (its own cache): checked against what it held.
                credit = {CREDIT_HEADER: str(route.credited_tokens)} if route.prefill is None and not attempt else {}
                return await self._answer(request, body, resp, first, current, timing, credit)
        raise AssertionError("unreachable")

    async def _answer(self, request: web.Request, body: dict, resp: aiohttp.ClientResponse, first: bytes,
                      engine: Engine, timing: Timing, headers: dict | None = None) -> web.StreamResponse:
        try:
            if not body.get("stream"):
                self._observe(timing)
                return web.Response(body=self.usage.answer(request, first, engine.url), status=resp.status,
                                    content_type="application/json",
                                    headers=headers)
            out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                          "Cache-Control": "no-cache", **(headers or {})})
            await out.prepare(request)
            await out.write(self.usage.stream(request, first, engine.url))
            self._observe(timing)
            try:
                async for chunk in resp.content.iter_any():
                    await out.write(self.usage.stream(request, chunk, engine.url))
                await out.write(self.usage.stream(request, b"", engine.url, final=True))
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                # Tokens already went out: the client gets an error event, not a silent cut.
                self.metrics.upstream_failures.labels("decode").inc()
                engine.fail(f"stream broke: {exc}")
                await out.write(sse_error(f"decode engine failed mid-stream: {type(exc).__name__}"))
            await out.write_eof()
            return out
        finally:
            resp.release()  # also on cancellation: closes an unfinished upstream stream

    def _observe(self, timing: Timing) -> None:
        now = time.perf_counter()
        timing.first_byte = now
        self.metrics.ttft.observe(now - timing.start)
        self.metrics.observe_overhead(now - timing.start - timing.upstream)
