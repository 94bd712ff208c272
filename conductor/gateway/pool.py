"""The engines behind the gateway: health, live load scraped from each engine's `/metrics`, and
what the gateway itself has in flight there. Dead engines leave the rotation until healthy again."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp

log = logging.getLogger("conductor.gateway")

# vLLM's gauges (per engine; summed over its data-parallel ranks).
_GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
           "vllm:kv_cache_usage_perc": "kv_usage"}


@dataclass
class Engine:
    url: str
    role: str  # "prefill" | "decode"
    healthy: bool = False
    running: int = 0  # scraped
    waiting: int = 0
    kv_usage: float = 0.0
    models: list[str] = field(default_factory=list)
    inflight: int = 0  # this gateway's requests there now
    inflight_tokens: int = 0  # their uncached prompt tokens (the prefill queue it caused)
    inflight_kv: int = 0  # the KV tokens they hold or will hold there (prompt + output)
    kv_capacity: int | None = None  # tokens of KV cache (vllm:cache_config_info), when it says
    failures: int = 0
    checked_at: float = 0.0
    answered: bool = False  # its last health check passed (a failed request alone does not clear this)

    @property
    def name(self) -> str:
        return self.url

    def fail(self, why: str) -> None:
        """Out of the rotation now; the health loop brings it back."""
        if self.healthy:
            log.warning("engine %s left the rotation: %s", self.url, why)
        self.healthy = False
        self.failures += 1


def parse_load(text: str) -> dict[str, float]:
    """vLLM's load gauges from a `/metrics` page, each summed over its label sets. Read line by line:
    prometheus_client's parser took ~1.5 ms a page, a quarter of the gateway's CPU at 12 engines
    scraped every second."""
    out = {v: 0.0 for v in _GAUGES.values()}
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            capacity = _capacity(line)
            if capacity:
                out["kv_capacity"] = out.get("kv_capacity", 0.0) + capacity
            continue
        if not line.startswith("vllm:num_requests_") and not line.startswith("vllm:kv_cache_usage_perc"):
            continue
        name, _, rest = line.partition("{")
        if rest:
            rest = rest[rest.rindex("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        key = _GAUGES.get(name.strip())
        if key:
            try:
                out[key] += float(rest.split()[0])
            except (IndexError, ValueError):
                raise ValueError(f"unreadable sample: {line[:200]!r}") from None
    return out


def _capacity(line: str) -> float | None:
    """Tokens of KV cache from vLLM's `vllm:cache_config_info` labels: num_gpu_blocks x block_size."""
    labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.rindex("}")].split(",") if "=" in part)
    try:
        return float(labels["num_gpu_blocks"].strip('"')) * float(labels["block_size"].strip('"'))
    except (KeyError, ValueError):
        return None


class Pool:
    """All engines; `run()` polls `/health` and `/metrics` every `interval` seconds."""

    def __init__(self, prefill: list[str], decode: list[str], *, interval: float = 1.0,
                 timeout: float = 2.0) -> None:
        self.engines = [Engine(u.rstrip("/"), "prefill") for u in prefill] + \
                       [Engine(u.rstrip("/"), "decode") for u in decode]
        self.interval, self.timeout = interval, timeout
        self.ready = asyncio.Event()
        self.on_down: Callable[[Engine], None] = lambda engine: None  # a health check took it out of the rotation

    def role(self, role: str, healthy: bool = True) -> list[Engine]:
        return [e for e in self.engines if e.role == role and (e.healthy or not healthy)]

    def get(self, url: str) -> Engine | None:
        return next((e for e in self.engines if e.url == url), None)

    def models(self) -> list[str]:
        seen: list[str] = []
        for e in self.engines:
            seen += [m for m in e.models if m not in seen]
        return seen

    async def check(self, session: aiohttp.ClientSession, engine: Engine) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        try:
            async with session.get(engine.url + "/health", timeout=timeout) as resp:
                ok = resp.status == 200
            if ok and not engine.models:
                async with session.get(engine.url + "/v1/models", timeout=timeout) as resp:
                    engine.models = [m["id"] for m in (await resp.json()).get("data", [])]
            if ok:
                async with session.get(engine.url + "/metrics", timeout=timeout) as resp:
                    load = parse_load(await resp.text())
                engine.running, engine.waiting = int(load["running"]), int(load["waiting"])
                engine.kv_usage = load["kv_usage"]
                engine.kv_capacity = int(load["kv_capacity"]) if load.get("kv_capacity") else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
            ok = False
            why = f"health check failed: {type(exc).__name__}: {exc}"
        else:
            why = "health check answered non-200"
        if ok and not engine.healthy:
            log.info("engine %s (%s) is in the rotation", engine.url, engine.role)
        if not ok:
            if engine.answered:
                self.on_down(engine)
            engine.fail(why)
        engine.answered = ok
        engine.healthy, engine.checked_at = ok, time.monotonic()

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.check(session, e) for e in self.engines))
        self.ready.set()

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self.check_all(session)
            await asyncio.sleep(self.interval)
