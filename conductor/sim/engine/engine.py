"""One stand-in engine: a scheduler stepping on a simulated clock, its prefix cache and KV events,
its link to the store, and its fault knobs.

The clock: simulated seconds run `time_scale` times slower than the wall (2: one simulated second
takes two real ones), so the process's own CPU time (HTTP, JSON, hashing, store calls) shrinks by
that factor next to the simulated GPU time. A step sleeps its cost-model time; steps that are all
decodes and change nothing (no request finishes, needs a block, or has tokens to deliver) are
slept through together, and cut short, at a step boundary, when a request arrives or a load ends.
Tokens reach the HTTP front every `stream_interval` tokens (vLLM's `--stream-interval`), the
first at once."""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any

from .events import Publisher, to_events
from .hashing import none_hash
from .metrics import EngineMetrics
from .prefix_cache import BlockPool
from .profile import Profile
from .scheduler import FINISHED, Request, Scheduler, Step
from .store_link import PARAMS_KEY, StoreLink

log = logging.getLogger("conductor.sim.engine")
ROLES = ("kv_both", "kv_producer", "kv_consumer")


class Clock:
    """Simulated seconds on the event loop's clock, `scale` wall seconds each."""

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError(f"time scale must be above 0, not {scale}")
        self.scale = scale
        self.loop = asyncio.get_running_loop()
        self.origin = self.loop.time()

    def now(self) -> float:
        return (self.loop.time() - self.origin) / self.scale

    async def sleep(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds * self.scale)


@dataclass
class Faults:
    """Per-engine fault knobs."""

    slow: float = 1.0  # step time multiplier
    error_rate: float = 0.0  # generation requests answered 500
    die_mid_stream: float = 0.0  # streams cut (connection dropped) after their first token
    down_at: float | None = None  # simulated second the engine dies (then restarts after `down_for`)
    down_for: float | None = None  # None: stays down
    drop_at: float | None = None  # from this simulated second, KV-event batches are lost on the wire ...
    drop_for: float = 0.0  # ... for this long (sequence numbers still advance; the replay socket has them)


def parse_fault(spec: str, faults: dict[int, Faults]) -> None:
    """One --fault value into `faults` (raises ValueError naming what is wrong)."""
    parts = spec.split(":")
    kind = parts[0]
    shapes = {"slow": ((3,), "slow:ENGINE:FACTOR"), "error": ((3,), "error:ENGINE:RATE"),
              "cut": ((3,), "cut:ENGINE:RATE"), "down": ((3, 4), "down:ENGINE:AT[:FOR]"),
              "drop": ((4,), "drop:ENGINE:AT:FOR")}
    if kind not in shapes:
        raise ValueError(f"--fault {spec!r}: the kind must be one of slow, error, cut, down, drop")
    lengths, usage = shapes[kind]
    if len(parts) not in lengths:
        raise ValueError(f"--fault {spec!r}: expected {usage}")
    try:
        engine = int(parts[1])
        values = [float(v) for v in parts[2:]]
    except ValueError:
        raise ValueError(f"--fault {spec!r}: ENGINE must be an integer and the values numbers") from None
    f = faults.setdefault(engine, Faults())
    if kind == "slow":
        if values[0] <= 0:
            raise ValueError(f"--fault {spec!r}: FACTOR must be above 0")
        f.slow = values[0]
    elif kind in ("error", "cut"):
        if not 0 <= values[0] <= 1:
            raise ValueError(f"--fault {spec!r}: RATE must be between 0 and 1")
        setattr(f, "error_rate" if kind == "error" else "die_mid_stream", values[0])
    elif kind == "drop":
        if values[0] < 0 or values[1] <= 0:
            raise ValueError(f"--fault {spec!r}: AT must not be negative and FOR must be above 0")
        f.drop_at, f.drop_for = values[0], values[1]
    else:
        if values[0] < 0 or (len(values) > 1 and values[1] < 0):
            raise ValueError(f"--fault {spec!r}: AT and FOR must not be negative")
        f.down_at, f.down_for = values[0], values[1] if len(values) > 1 else None


@dataclass(eq=False)
class Delivery:
    """What the HTTP front reads for one request: ("tokens", n), then ("done", reason, kv_transfer_params,
    last n) or ("error", why)."""

    request: Request
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    delivered: int = 0  # output tokens handed to the front so far
    stream: bool = True
    last: float = 0.0


class _Connector:
    """The scheduler's connector: the engine's store link, as its role allows."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine

    def matched_tokens(self, request: Request, local_tokens: int) -> int:
        return self.engine.link.matched_tokens(request, local_tokens)

    def start_load(self, request: Request, local_tokens: int, tokens: int) -> None:
        e = self.engine
        task = e.link.start_load(request, local_tokens, tokens, e.clock, e._loaded, e.name)
        e.tasks.add(task)
        task.add_done_callback(e.tasks.discard)

    def save(self, request: Request, start: int, end: int, tail: bool) -> None:
        if self.engine.role != "kv_consumer":
            self.engine.link.save(request, start, end, tail, self.engine.name)


class Engine:
    def __init__(self, index: int, profile: Profile, clock: Clock, *, role: str = "kv_both",
                 link: StoreLink | None = None, events_endpoint: str | None = None,
                 replay_endpoint: str | None = None, stream_interval: int = 1, faults: Faults | None = None,
                 seed: int = 0) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        self.index, self.profile, self.clock, self.role, self.link = index, profile, clock, role, link
        self.name = f"engine-{index}"
        self.events_endpoint, self.replay_endpoint = events_endpoint, replay_endpoint
        self.stream_interval = max(1, stream_interval)
        self.faults = faults or Faults()
        self.random = random.Random(seed * 1000 + index)
        self.root = none_hash()
        self.tasks: set[asyncio.Task] = set()
        self.ids = itertools.count()
        self.alive = False
        self.restarts = 0
        self.step_count = 0
        self.busy_s = 0.0  # simulated seconds spent stepping
        self.lag_s = 0.0  # wall seconds steps started late (the event loop was busy)
        self._fresh()

    def _fresh(self) -> None:
        """Empty state, as a just-started engine has."""
        self.pool = BlockPool(self.profile.num_gpu_blocks)
        self.scheduler = Scheduler(self.profile, self.pool, self.root,
                                   _Connector(self) if self.link is not None else None,
                                   events=self.events_endpoint is not None)
        cache_config = {"block_size": self.profile.block_size, "num_gpu_blocks": self.profile.num_gpu_blocks,
                        "enable_prefix_caching": True, "cache_dtype": "auto", "gpu_memory_utilization": 0.9}
        self.metrics = EngineMetrics(self.profile.model, 0, lambda: float(len(self.scheduler.running)),
                                     lambda: float(self.scheduler.num_waiting()), self.pool.usage, cache_config)
        self.deliveries: dict[Request, Delivery] = {}
        self.wake = asyncio.Event()
        self.publisher = Publisher(self.events_endpoint, self.replay_endpoint) if self.events_endpoint else None
        if self.publisher is not None:  # ports picked at the first bind are kept across restarts
            self.events_endpoint, self.replay_endpoint = self.publisher.endpoint, self.publisher.replay_endpoint

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.alive = True
        self._spawn(self.run())
        if self.publisher is not None:
            self._spawn(self.publisher.serve_replay())
        if self.faults.down_at is not None:
            self._spawn(self._die_at(self.faults.down_at))

    def inject(self, faults: Faults) -> None:
        """Replace the engine's faults while it runs; a down fault's `down_at` counts from now."""
        if faults.down_at is not None:
            faults.down_at += self.clock.now()
        if faults.drop_at is not None:
            faults.drop_at += self.clock.now()
        self.faults = faults
        if faults.down_at is not None and self.alive:
            self._spawn(self._die_at(faults.down_at))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def stop(self) -> None:
        """Die: every request in flight fails, the state and the event stream are gone."""
        self.alive = False
        for delivery in list(self.deliveries.values()):
            delivery.queue.put_nowait(("error", "engine stopped"))
        self.deliveries.clear()
        tasks = [t for t in self.tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.publisher is not None:
            self.publisher.close()

    async def restart(self) -> None:
        """Start again empty (cache, queues, counters; KV event sequence numbers from 0)."""
        self.restarts += 1
        self._fresh()
        self.start()

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: list[int], max_tokens: int, *, stream: bool, cache_salt: str | None = None,
               kv_params: dict | None = None) -> Delivery:
        request = Request(f"{self.name}-{next(self.ids)}", prompt, max(1, max_tokens), self.clock.now(), cache_salt,
                          kv_params)
        delivery = Delivery(request, stream=stream, last=request.arrival)
        request.on_tokens = self._produced
        self.deliveries[request] = delivery
        self.scheduler.add(request)
        self.wake.set()
        return delivery

    def abort(self, delivery: Delivery) -> None:
        request = delivery.request
        if request.status != FINISHED:
            self.scheduler.abort(request)
            self.metrics.success["abort"] += 1
        self.deliveries.pop(request, None)

    def transfer_params(self, request: Request) -> dict | None:
        """A P/D prefill's `kv_transfer_params` (the connector's), when it was asked for one."""
        if self.link is None or self.role == "kv_consumer":
            return None
        if not (request.kv_params or {}).get("do_remote_decode"):
            return None
        return self.link.transfer_params(request)

    def _produced(self, request: Request, count: int) -> None:
        """`count` new tokens of `request` at the end of this step: the first goes out at once, then
        every `stream_interval`; the last ones with the finish (`_finish`)."""
        delivery = self.deliveries.get(request)
        if delivery is None:
            return
        now = self.clock.now()
        if request.first_token is None:
            request.first_token = now
            self.metrics.ttft.observe(now - request.arrival)
        if request.num_output >= request.max_tokens or not delivery.stream:
            return
        if delivery.delivered == 0 or request.num_output % self.stream_interval == 0:
            self._deliver(delivery, request.num_output)

    def _deliver(self, delivery: Delivery, upto: int) -> None:
        """Hand output tokens up to number `upto` to the front."""
        if upto > delivery.delivered:
            now = self.clock.now()
            count = upto - delivery.delivered
            if delivery.delivered:
                self.metrics.itl.observe((now - delivery.last) / count)
            delivery.queue.put_nowait(("tokens", count))
            delivery.delivered, delivery.last = upto, now

    def _plan_deliveries(self, step: Step, duration: float, steps: int) -> list[asyncio.TimerHandle]:
        """Over `steps` decode steps slept through together, each stream's tokens still go out every
        `stream_interval` tokens, at the end of the step that made them (timers)."""
        loop = asyncio.get_running_loop()
        start, every = loop.time(), self.stream_interval
        groups: dict[int, list[tuple[Delivery, int]]] = {}
        for request, _ in step.scheduled:
            delivery = self.deliveries.get(request)
            if delivery is None or not delivery.stream:
                continue
            base = request.num_output
            for j in range((-base) % every or every, steps, every):
                groups.setdefault(j, []).append((delivery, base + j))
        return [loop.call_at(start + j * duration * self.clock.scale, self._deliver_group, items)
                for j, items in groups.items()]

    def _deliver_group(self, items: list[tuple[Delivery, int]]) -> None:
        for delivery, upto in items:
            if delivery.request in self.deliveries:
                self._deliver(delivery, upto)

    def _loaded(self, request: Request, tokens: int) -> None:
        self.scheduler.loaded(request, tokens)
        self.metrics.connector["hit_tokens"] += tokens
        self.metrics.connector["loaded_blocks"] += -(-tokens // self.profile.block_size)
        self.wake.set()

    def _finish(self, request: Request) -> None:
        delivery = self.deliveries.pop(request, None)
        now = self.clock.now()
        self.metrics.success["length"] += 1
        self.metrics.e2e.observe(now - request.arrival)
        if delivery is not None:
            last = request.num_output - delivery.delivered
            delivery.delivered = request.num_output
            delivery.queue.put_nowait(("done", "length", self.transfer_params(request), last))

    # ------------------------------------------------------------------ the step loop
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_start = loop.time()
        while True:
            step = self.scheduler.schedule()
            if not step.scheduled:
                self._publish()
                self.wake.clear()
                await self.wake.wait()
                next_start = loop.time()
                continue
            now_wall = loop.time()
            self.lag_s += max(0.0, now_wall - next_start)
            for request in step.admitted:
                if request.first_scheduled is None:
                    request.first_scheduled = self.clock.now()
                    self.metrics.queue.observe(request.first_scheduled - request.arrival)
            duration = self.profile.step_ms(step.prefill, step.decodes, step.decode_context) / 1e3 * self.faults.slow
            steps = self.scheduler.decode_steps_ahead(step) if step.pure_decode else 1
            timers = self._plan_deliveries(step, duration, steps) if steps > 1 else []
            done = await self._sleep_steps(duration, steps)
            for timer in timers:  # the steps that did not run deliver nothing
                timer.cancel()
            self.step_count += done
            self.busy_s += duration * done
            next_start = loop.time()
            for request in self.scheduler.complete(step, done):
                self._finish(request)
            self._publish()

    async def _sleep_steps(self, duration: float, steps: int) -> int:
        """Sleep `steps` steps of `duration`; a wake-up ends it at the next step boundary."""
        if steps == 1:
            await self.clock.sleep(duration)
            return 1
        self.wake.clear()
        start = self.clock.now()
        try:
            await asyncio.wait_for(self.wake.wait(), duration * steps * self.clock.scale)
        except asyncio.TimeoutError:
            return steps
        done = min(steps, math.floor((self.clock.now() - start) / duration) + 1)
        await self.clock.sleep(start + done * duration - self.clock.now())
        return done

    def _publish(self) -> None:
        items = self.pool.events.take()
        if items and self.publisher is not None:
            f = self.faults
            lost = f.drop_at is not None and f.drop_at <= self.clock.now() < f.drop_at + f.drop_for
            self.publisher.publish(to_events(items, self.profile.block_size), send=not lost)

    async def _die_at(self, at: float) -> None:
        await self.clock.sleep(at - self.clock.now())
        await self._go_down()

    async def _go_down(self) -> None:
        faults = self.faults
        log.warning("%s: going down at %.1f s (simulated)%s", self.name, self.clock.now(),
                    "" if faults.down_for is None else f" for {faults.down_for:g} s")
        self.on_down()
        await self.stop()
        if faults.down_for is None:
            return
        faults.down_at = None
        await self.clock.sleep(faults.down_for)
        await self.restart()
        self.on_up()

    # set by the HTTP front: close and reopen the engine's port
    def on_down(self) -> None: ...

    def on_up(self) -> None: ...

    def snapshot(self) -> dict[str, Any]:
        """Counters for the fleet's own report."""
        s = self.scheduler.stats
        return {"engine": self.index, "role": self.role, "steps": self.step_count, "busy_s": self.busy_s,
                "lag_s": self.lag_s, "restarts": self.restarts, "running": len(self.scheduler.running),
                "waiting": self.scheduler.num_waiting(), "kv_usage": self.pool.usage(), "sim_s": self.clock.now(),
                "evicted_blocks": self.pool.evicted, **s,
                "events": self.publisher.sent if self.publisher is not None else 0}


def kv_params_of(body: dict) -> dict | None:
    params = body.get("kv_transfer_params")
    return params if isinstance(params, dict) else None


def wants_store(params: dict | None) -> bool:
    return bool(params) and PARAMS_KEY in params
