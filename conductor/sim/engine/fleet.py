"""Many stand-in engines in one asyncio process, each on its own port, sharing one store client.

    async with StandinFleet(FleetConfig(engines=4, profile="h100-llama3-8b")) as fleet:
        fleet.urls                      # http://127.0.0.1:PORT per engine
        fleet.stats()                   # per-engine counters, the store link's, the event loop's lag

A control port (`control_port`), apart from the engines' so no router sees it, answers
`GET /fleet/stats` with `stats()` as JSON."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .engine import ROLES, Clock, Engine, Faults, parse_fault
from .http_front import Front
from .profile import Profile, get_profile
from .tokenizer import Tokenizer

log = logging.getLogger("conductor.sim.engine")


@dataclass
class FleetConfig:
    engines: int = 4
    profile: str = "h100-llama3-8b"
    time_scale: float = 1.0
    host: str = "127.0.0.1"
    base_port: int = 0  # engine i listens on base_port + i (0: any free port)
    roles: list[str] = field(default_factory=list)  # per engine (default: kv_both)
    metadata: str | None = None  # etcd://...: the store pool (None: engine-local caches only)
    cluster: str = "default"
    secret: str | None = None
    bytes_scale: int = 16384
    kv_events_base_port: int | None = None  # engine i publishes on tcp://*:(port + i); 0: free ports; None: no events
    kv_events_host: str = "*"
    replay: bool = True  # a replay ROUTER on kv_events_base_port + engines + i
    stream_interval: int = 1
    model_dir: str | None = None
    enable_scale_out: bool = False
    faults: dict[int, Faults] = field(default_factory=dict)
    control_port: int | None = None
    seed: int = 0
    store_threads: int = 2  # loading threads per engine (the connector's)
    overrides: dict[str, Any] = field(default_factory=dict)  # Profile fields

    def profile_obj(self) -> Profile:
        profile = get_profile(self.profile)
        return profile.with_overrides(**self.overrides) if self.overrides else profile

    def validate(self) -> "FleetConfig":
        if self.engines < 1:
            raise ValueError("--engines must be at least 1")
        if not self.time_scale > 0:
            raise ValueError("--time-scale must be above 0")
        if self.bytes_scale < 1:
            raise ValueError("--bytes-scale must be at least 1")
        if self.roles and len(self.roles) != self.engines:
            raise ValueError(f"{len(self.roles)} roles for {self.engines} engines")
        for role in self.roles:
            if role not in ROLES:
                raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        if any(role != "kv_both" for role in self.roles) and not self.metadata:
            raise ValueError("prefill/decode roles hand KV over through the store: give --metadata etcd://...")
        for index in self.faults:
            if not 0 <= index < self.engines:
                raise ValueError(f"a fault names engine {index}, but there are {self.engines} (0-{self.engines - 1})")
        self.profile_obj()
        return self


class StandinFleet:
    def __init__(self, config: FleetConfig) -> None:
        self.config = config.validate()
        self.profile = config.profile_obj()
        self.engines: list[Engine] = []
        self.fronts: list[Front] = []
        self.link = None
        self.client = None
        self._control: web.AppRunner | None = None
        self.control_url: str | None = None
        self.started_at = 0.0
        self._lag_task: asyncio.Task | None = None
        self.loop_lag = {"samples": 0, "max_ms": 0.0, "total_ms": 0.0, "over_10ms": 0}

    @property
    def urls(self) -> list[str]:
        return [f.url for f in self.fronts]

    async def start(self) -> "StandinFleet":
        c = self.config
        if c.metadata:
            from kvstore import Client

            from .store_link import StoreLink, fingerprint_for

            fp = fingerprint_for(self.profile, c.bytes_scale)
            self.client = await asyncio.to_thread(Client, c.metadata, cluster=c.cluster, secret=c.secret,
                                                  fingerprint=fp, timeout=10.0)
            self.link = StoreLink(self.client, self.profile, c.bytes_scale, threads=c.store_threads)
        tokenizer = await asyncio.to_thread(Tokenizer, c.model_dir)
        clock = Clock(c.time_scale)
        for i in range(c.engines):
            events = replay = None
            if c.kv_events_base_port is not None:  # 0: every socket on a free port the system picks
                base = c.kv_events_base_port
                events = f"tcp://{c.kv_events_host}:{base + i if base else 0}"
                if c.replay:
                    replay = f"tcp://{c.kv_events_host}:{base + c.engines + i if base else 0}"
            engine = Engine(i, self.profile, clock, role=c.roles[i] if c.roles else "kv_both", link=self.link,
                            events_endpoint=events, replay_endpoint=replay, stream_interval=c.stream_interval,
                            faults=c.faults.get(i), seed=c.seed)
            front = Front(engine, tokenizer, c.host, c.base_port + i if c.base_port else 0,
                          enable_scale_out=c.enable_scale_out)
            await front.start()
            engine.start()
            self.engines.append(engine)
            self.fronts.append(front)
        if c.control_port is not None:
            app = web.Application()
            app.router.add_get("/fleet/stats", self._stats)
            app.router.add_post("/fleet/fault", self._fault)
            self._control = web.AppRunner(app, access_log=None)
            await self._control.setup()
            site = web.TCPSite(self._control, c.host, c.control_port)
            await site.start()
            self.control_url = f"http://{c.host}:{site._server.sockets[0].getsockname()[1]}"  # type: ignore
        self.started_at = time.monotonic()
        self._lag_task = asyncio.get_running_loop().create_task(self._watch_lag())
        return self

    async def _watch_lag(self) -> None:
        """How late the event loop wakes a 50 ms timer: the process's own CPU load, in wall ms."""
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(0.05)
            late = (loop.time() - before - 0.05) * 1e3
            lag = self.loop_lag
            lag["samples"] += 1
            lag["total_ms"] += late
            lag["max_ms"] = max(lag["max_ms"], late)
            lag["over_10ms"] += late > 10

    async def stop(self) -> None:
        if self._lag_task is not None:
            self._lag_task.cancel()
        for front in self.fronts:
            await front.stop()
        for engine in self.engines:
            await engine.stop()
        if self._control is not None:
            await self._control.cleanup()
        if self.link is not None:
            await self.link.flush(10.0)
            await asyncio.to_thread(self.link.close)
        if self.client is not None:
            await asyncio.to_thread(self.client.close)

    async def __aenter__(self) -> "StandinFleet":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def stats(self) -> dict[str, Any]:
        link = self.link.stats if self.link is not None else None
        lag = dict(self.loop_lag)
        lag["mean_ms"] = lag["total_ms"] / lag["samples"] if lag["samples"] else 0.0
        return {"profile": self.profile.name, "time_scale": self.config.time_scale,
                "wall_s": time.monotonic() - self.started_at,
                "engines": [{**e.snapshot(), "url": f.url, "requests": f.requests,
                             "errors_injected": f.errors_injected, "cuts_injected": f.cuts_injected}
                            for e, f in zip(self.engines, self.fronts)],
                "store": None if link is None else {k: v for k, v in vars(link).items() if k != "by_engine"},
                "loop_lag": lag}

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    async def _fault(self, request: web.Request) -> web.Response:
        """POST {"spec": "down:1:30"} (a --fault SPEC), or {"specs": [...]} (several, one engine's
        together): the engines' faults from now on; a down or drop fault's AT counts from now, so a
        benchmark can time a death from its first arrival."""
        try:
            body = await request.json()
            faults: dict[int, Faults] = {}
            for spec in body["specs"] if "specs" in body else [body["spec"]]:
                parse_fault(spec, faults)
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"expected {{\"spec\": \"KIND:ENGINE:...\"}}: {exc}"}, status=400)
        if any(not 0 <= i < len(self.engines) for i in faults):
            return web.json_response({"error": f"no engine {sorted(faults)} (engines 0-{len(self.engines) - 1})"},
                                     status=400)
        for i, f in faults.items():
            self.engines[i].inject(f)
        return web.json_response({"engines": sorted(faults)})

    def describe(self) -> dict[str, Any]:
        """What a router needs: engine URLs, roles, event endpoints; the store fingerprint."""
        c = self.config
        out = []
        for engine, front in zip(self.engines, self.fronts):
            events = engine.events_endpoint
            out.append({"index": engine.index, "url": front.url, "role": engine.role,
                        "kv_events": events.replace("*", "127.0.0.1") if events else None,
                        "kv_events_bind": events,
                        "replay": engine.replay_endpoint.replace("*", "127.0.0.1") if engine.replay_endpoint else None})
        from dataclasses import asdict

        from .store_link import fingerprint_for

        fp = asdict(fingerprint_for(self.profile, c.bytes_scale))
        return {"engines": out, "model": self.profile.model, "profile": self.profile.name,
                "block_size": self.profile.block_size, "time_scale": c.time_scale, "fingerprint": fp,
                "block_bytes": self.link.nbytes if self.link is not None else None, "control": self.control_url}
