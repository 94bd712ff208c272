"""The gateway's per-engine load (inflight, inflight_tokens, inflight_kv) is taken and given back in
one place, the ledger (conductor/gateway/load.py), on every way a prefill or a decode can end."""
from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from conductor.gateway.load import Load
from conductor.gateway.pool import Engine
from kvstore_testing.fake_engines import FakeEngine, Rig, completion, until

LONG = list(range(64))  # long enough to be disaggregated
CONDUCTOR = Path(__file__).resolve().parents[2] / "conductor"
COUNTERS = {"inflight", "inflight_tokens", "inflight_kv"}


def counts(rig: Rig) -> list[tuple[int, int, int]]:
    return [(e.inflight, e.inflight_tokens, e.inflight_kv) for e in rig.gateway.pool.engines]


async def test_a_load_is_given_back_however_the_call_ends():
    """Kills: a ledger that gives the load back only when the call returns (an error or a
    cancellation leaves it counted), and one that gives the queued tokens back twice."""
    engine = Engine("http://e", "decode")
    with Load(engine, queued_tokens=100, kv_tokens=400) as load:
        assert (engine.inflight, engine.inflight_tokens, engine.inflight_kv) == (1, 100, 400)
        load.started()
        load.started()
        assert (engine.inflight, engine.inflight_tokens, engine.inflight_kv) == (1, 0, 400)
    assert (engine.inflight, engine.inflight_tokens, engine.inflight_kv) == (0, 0, 0)
    with pytest.raises(ValueError):
        with Load(engine, queued_tokens=100, kv_tokens=400):
            raise ValueError("the engine answered garbage")
    assert (engine.inflight, engine.inflight_tokens, engine.inflight_kv) == (0, 0, 0)

    async def call() -> None:
        with Load(engine, queued_tokens=100, kv_tokens=400):
            await asyncio.sleep(3600)

    task = asyncio.create_task(call())
    assert await until(lambda: engine.inflight == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (engine.inflight, engine.inflight_tokens, engine.inflight_kv) == (0, 0, 0)


async def test_a_failed_prefill_and_a_failed_decode_leave_no_load_behind():
    """Kills: a prefill or decode path that gives its load back only on success (each failed
    request would then steer routing away from its engine for good)."""
    p0, p1 = FakeEngine("p0", fail_status=500), FakeEngine("p1", fail_status=503)
    d0, d1 = FakeEngine("d0", fail_status=500), FakeEngine("d1", fail_status=500)
    async with Rig([p0, p1], [d0, d1], health_interval_s=60) as rig:
        status, _ = await rig.post("/v1/completions", completion(LONG))
        assert status == 502 and len(p0.requests) + len(p1.requests) == 2
        assert len(d0.requests) + len(d1.requests) == 2  # tried once, then elsewhere
        assert counts(rig) == [(0, 0, 0)] * 4


async def test_a_cancelled_prefill_or_decode_leaves_no_load_behind():
    """Kills: a path whose load survives a client that walks away (the task is cancelled while it
    waits on the engine): before the first token, and mid-stream."""
    p, d = FakeEngine("p0", hang=True), FakeEngine("d0", stream_delay=5.0)
    async with Rig([p], [d], prefill_timeout_s=30) as rig:
        task = asyncio.create_task(rig.post("/v1/completions", completion(LONG)))
        assert await until(lambda: len(p.requests) == 1)
        assert await until(lambda: counts(rig)[0][0] == 1)  # the prefill holds its engine's load
        task.cancel()
        assert await until(lambda: p.cancelled)
        assert await until(lambda: counts(rig) == [(0, 0, 0)] * 2)
        p.hang = False
        async with rig.http.post(rig.url + "/v1/completions", json=completion(LONG, stream=True)) as resp:
            await resp.content.readany()  # the first token arrived; now the client walks away
            assert counts(rig)[1][0] == 1 and counts(rig)[1][2] > 0  # the decode holds its engine's load
        assert await until(lambda: d.cancelled)
        assert await until(lambda: counts(rig) == [(0, 0, 0)] * 2)


def test_only_the_ledger_moves_the_counts():
    """Kills: a second place that moves an engine's in-flight counts (the prefill and decode paths
    each kept their own, and each had to give back on every exit by hand)."""
    movers = []
    for path in CONDUCTOR.rglob("*.py"):
        if path.name == "load.py" and path.parent.name == "gateway":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in COUNTERS:
                    movers.append(f"{path.relative_to(CONDUCTOR.parent)}:{node.lineno}")
    assert movers == [], movers
