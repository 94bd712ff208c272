"""NVIDIA Dynamo's KV router in front of the stand-in engines: the fleet benchmark's `dynamo` peer.

    python -m benchmarks.fleet_dynamo --fleet FLEET.json --listen 127.0.0.1:PORT --store DIR [--routes PATH]

Dynamo's router picks workers among the instances registered in its discovery and learns what
each one caches from KV events on its event plane. Here every stand-in engine of FLEET.json (the
stand-in fleet's first output line) becomes one Dynamo worker instance: its own DistributedRuntime
(file discovery under DIR, the TCP request plane, the ZMQ event plane: no etcd, no NATS), a model
card with the engine's KV capacity (`register_model`, no model files), and a `KvEventPublisher`
subscribed to the engine's vLLM ZMQ KV events, the relay Dynamo's own vLLM worker runs. Dynamo's
`KvRouter` (ai-dynamo 1.6.1, default `KvRouterConfig`: its overlap-weighted cost of prefill
tokens and active decode blocks) then picks each request's engine (`best_worker`, tracking the
request as active until it ends), and this thin HTTP proxy forwards the request to that engine as
it came and streams the answer back: the same engines, the same events, Dynamo's choice.

P/D (engines with role kv_producer): a second router over the prefill engines; the prefill goes
out with `max_tokens=1` and `kv_transfer_params={"do_remote_decode": true}` as vLLM's
disaggregated proxy sends it, then the decode with the returned parameters to the decode
router's pick. A request the router refuses (no worker, a queue limit) is answered 503, which the
fleet benchmark counts as a miss. `--routes PATH` writes one JSON line per route (wall time,
engine, blocks the router credited it with) for the churn check."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import uuid

PROG = "python -m benchmarks.fleet_dynamo"
JSON_HEADERS = {"Content-Type": "application/json"}


def loopback_only(store: str) -> None:
    """Everything Dynamo binds stays on 127.0.0.1 (its default is the host's first interface),
    and its file discovery lives in this run's folder."""
    for name in ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_SYSTEM_HOST"):
        os.environ[name] = "127.0.0.1"
    os.environ["DYN_FILE_KV"] = store
    os.environ.setdefault("DYN_LOG", "warn")


class DynamoProxy:
    def __init__(self, fleet: dict, routes_path: str | None) -> None:
        self.fleet = fleet
        self.block = int(fleet["block_size"])
        self.urls: dict[int, str] = {}  # Dynamo worker id -> engine URL
        self.index: dict[int, int] = {}  # Dynamo worker id -> engine index
        self.keep: list = []  # runtimes, endpoints, publishers, serving futures: alive as long as we are
        self.routers: dict[str, object] = {}
        self.routes = open(routes_path, "a") if routes_path else None
        self.session = None
        self.rejected = 0

    async def start(self) -> None:
        from dynamo.llm import (KvEventPublisher, KvRouter, KvRouterConfig, ModelInput, ModelRuntimeConfig,
                                ModelType, WorkerType, register_model)
        from dynamo.runtime import DistributedRuntime

        loop = asyncio.get_running_loop()
        profile = self.fleet.get("capacity") or {}
        pd = any(e["role"] == "kv_producer" for e in self.fleet["engines"])
        for e in self.fleet["engines"]:
            prefill = e["role"] == "kv_producer"
            runtime = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
            endpoint = runtime.endpoint(f"fleet.{'prefill' if prefill else 'backend'}.generate")

            async def never(request, context=None):  # requests go over HTTP, never through Dynamo's plane
                yield {"token_ids": [], "finish_reason": "error"}

            serving = asyncio.ensure_future(endpoint.serve_endpoint(never))
            config = ModelRuntimeConfig()
            config.total_kv_blocks = int(profile.get("num_gpu_blocks") or 0) or None
            config.max_num_seqs = profile.get("max_num_seqs")
            config.max_num_batched_tokens = profile.get("max_num_batched_tokens")
            kind = WorkerType.Prefill if prefill else (WorkerType.Decode if pd else WorkerType.Aggregated)
            await register_model(ModelInput.Tokens, ModelType.Empty if prefill else ModelType.Completions, endpoint,
                                 self.fleet["model"], self.fleet["model"], worker_type=kind,
                                 kv_cache_block_size=self.block, runtime_config=config, skip_model_assets=True,
                                 needs=[[WorkerType.Decode]] if prefill else ([[WorkerType.Prefill]] if pd else None))
            publisher = KvEventPublisher(endpoint=endpoint, kv_block_size=self.block, zmq_endpoint=e["kv_events"],
                                         zmq_topic="")
            self.keep += [runtime, endpoint, serving, publisher]
            self.urls[endpoint.connection_id()] = e["url"]
            self.index[endpoint.connection_id()] = e["index"]
        runtime = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
        self.keep.append(runtime)
        self.routers["backend"] = KvRouter(runtime.endpoint("fleet.backend.generate"), self.block, KvRouterConfig())
        if pd:
            self.routers["prefill"] = KvRouter(runtime.endpoint("fleet.prefill.generate"), self.block,
                                               KvRouterConfig())
        # Ready once each router sees its workers (discovery is a file watch: not instant).
        for name, router in self.routers.items():
            want = sum(1 for e in self.fleet["engines"] if (e["role"] == "kv_producer") == (name == "prefill"))
            deadline = time.monotonic() + 60
            while True:
                try:
                    loads = await router.get_potential_loads([1] * self.block)
                except Exception:
                    loads = []
                if len({l["worker_id"] for l in loads}) >= want:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Dynamo's {name} router saw {len(loads)} of {want} workers after 60 s")
                await asyncio.sleep(0.2)

    async def pick(self, router_name: str, prompt: list[int], rid: str) -> tuple[int, int]:
        from aiohttp import web

        try:
            worker, _rank, overlap = await self.routers[router_name].best_worker(prompt, request_id=rid)
        except Exception as exc:  # no worker, a queue cap: Dynamo's frontend answers these 503
            self.rejected += 1
            raise web.HTTPServiceUnavailable(text=json.dumps({"error": {"message": f"dynamo router: {exc}"}}),
                                             content_type="application/json") from None
        if self.routes is not None:
            self.routes.write(json.dumps({"t": time.time(), "router": router_name, "engine": self.index[worker],
                                          "credited_blocks": overlap, "prompt_blocks": len(prompt) // self.block})
                              + "\n")
        return worker, overlap

    async def completions(self, request):
        import aiohttp
        from aiohttp import web

        raw = await request.read()
        try:
            body = json.loads(raw)
            prompt = body["prompt"]
            if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
                raise ValueError("prompt must be a list of token ids")
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": {"message": f"bad request: {exc}"}}, status=400)
        decode_router = self.routers["backend"]
        kv_params = None
        if "prefill" in self.routers:
            rid = uuid.uuid4().hex
            worker, _ = await self.pick("prefill", prompt, rid)
            first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            first.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
            try:
                async with self.session.post(self.urls[worker] + "/v1/completions", data=json.dumps(first),
                                             headers=JSON_HEADERS) as resp:
                    if resp.status != 200:
                        return web.Response(status=resp.status, text=await resp.text(),
                                            content_type="application/json")
                    kv_params = (await resp.json()).get("kv_transfer_params")
            except aiohttp.ClientError as exc:
                return web.json_response({"error": {"message": f"prefill failed: {exc}"}}, status=502)
            finally:
                await self.routers["prefill"].mark_prefill_complete(rid)
                await self.routers["prefill"].free(rid)
        rid = uuid.uuid4().hex
        worker, overlap = await self.pick("backend", prompt, rid)
        # What Dynamo credited the engine with (its own cache): the fleet checks it against what it held.
        credit = {} if kv_params else {"X-Conductor-Credited-Tokens": str(overlap * self.block)}
        if kv_params:
            body["kv_transfer_params"] = kv_params
            raw = json.dumps(body).encode()
        out = None
        try:
            async with self.session.post(self.urls[worker] + "/v1/completions", data=raw, headers=JSON_HEADERS,
                                         timeout=aiohttp.ClientTimeout(total=None, sock_read=3600)) as resp:
                if resp.status != 200:
                    return web.Response(status=resp.status, text=await resp.text(), content_type="application/json")
                out = web.StreamResponse(status=200, headers={"Content-Type": resp.headers.get(
                    "Content-Type", "text/event-stream"), **credit})
                await out.prepare(request)
                marked = False
                async for chunk in resp.content.iter_any():
                    if not marked:
                        await decode_router.mark_prefill_complete(rid)
                        marked = True
                    await out.write(chunk)
                await out.write_eof()
                return out
        except aiohttp.ClientError as exc:
            if out is None:
                return web.json_response({"error": {"message": f"engine failed: {exc}"}}, status=502)
            await out.write(b'data: {"error": {"message": "engine failed mid-stream"}}\n\n')
            return out
        finally:
            await decode_router.free(rid)

    async def health(self, request):
        from aiohttp import web

        return web.json_response({"status": "ok", "workers": len(self.urls), "rejected": self.rejected})

    async def models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.fleet["model"], "object": "model"}]})


async def serve(args) -> None:
    import aiohttp
    from aiohttp import web

    with open(args.fleet) as f:
        fleet = json.load(f)
    proxy = DynamoProxy(fleet, args.routes)
    await proxy.start()
    proxy.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_post("/v1/completions", proxy.completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, _, port = args.listen.rpartition(":")
    site = web.TCPSite(runner, host or "127.0.0.1", int(port))
    await site.start()
    print(json.dumps({"listen": args.listen, "workers": len(proxy.urls)}), flush=True)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    await runner.cleanup()
    await proxy.session.close()
    for item in proxy.keep:
        if hasattr(item, "shutdown"):
            item.shutdown()
    if proxy.routes is not None:
        proxy.routes.close()


def run(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--fleet", required=True, help="the stand-in fleet's description (its first output line)")
    p.add_argument("--listen", required=True, help="HOST:PORT")
    p.add_argument("--store", required=True, help="a folder for Dynamo's file discovery")
    p.add_argument("--routes", default=None, help="append one JSON line per route here")
    args = p.parse_args(argv)
    loopback_only(args.store)
    try:
        import dynamo.llm  # noqa: F401
    except ImportError as exc:
        print(f"{PROG}: error: ai-dynamo is not installed ({exc}); sh scripts/install.sh bench", file=sys.stderr)
        return 2
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(run())
