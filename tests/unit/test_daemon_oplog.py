"""What a daemon logs for its operator: summed, rate-limited lines, never one per block or per retry."""
from __future__ import annotations

import logging

from kvstore.aio import shared_loop
from kvstore.daemon import publisher as publisher_module
from kvstore.daemon.oplog import EvictionLog, NeighbourWatch, Throttle
from kvstore.daemon.publisher import Publisher
from kvstore.errors import MetadataUnavailable
from kvstore.index.records import BlockRecord


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_throttle_says_yes_at_most_once_per_period():
    clock = Clock()
    throttle = Throttle(30.0, clock)
    assert throttle() and not throttle()
    clock.now += 29.9
    assert not throttle()
    clock.now += 0.2
    assert throttle()


def test_evictions_are_one_line_per_period_with_what_went_where(caplog):
    """Kills: one log line per evicted block (or per eviction pass), and lines for quiet periods."""
    clock, counters = Clock(), {}
    evictions = EvictionLog(counters, lambda: ["dram", "nvme"], every=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="kvstore"):
        for _ in range(5000):  # a busy node: thousands of evictions within one period
            counters["evictions_dram"] = counters.get("evictions_dram", 0) + 1
            assert evictions.tick() is None
        counters["demotions"] = 4000
        counters["evictions_nvme"] = 7
        clock.now += 10
        line = evictions.tick()
        clock.now += 10
        assert evictions.tick() is None  # nothing evicted in this period: nothing said
    assert line == "evicted 5007 blocks in the last 10 s: 5000 from dram (4000 moved to nvme, 1000 dropped), 7 from nvme"
    assert [r.getMessage() for r in caplog.records] == [line]


def test_neighbours_joining_and_leaving_are_logged_once(caplog):
    """Kills: a node's death (its lease running out) passing without a line in its neighbours' logs."""
    seen = [["me", "a", "b"]]
    watch = NeighbourWatch("me", lambda: seen[0])
    with caplog.at_level(logging.INFO, logger="kvstore"):
        assert watch.tick() == ["other nodes in the cluster: a, b"]
        assert watch.tick() == []
        seen[0] = ["me", "a", "c"]
        lines = watch.tick()
        assert watch.tick() == []
    assert lines[0].startswith("node b left the cluster") and lines[1] == "node c joined the cluster"
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING", "INFO"]


def test_publish_failures_are_said_when_they_start_while_they_last_and_when_they_end(caplog, monkeypatch):
    """Kills: publish failures logged at INFO (invisible at the default level) once per retry
    (every 50 ms to 1 s while etcd is down), and their end never said."""
    monkeypatch.setattr(publisher_module, "LOG_EVERY_S", 1.2)
    failing = {"left": 7}

    async def apply(updates) -> None:
        if failing["left"]:
            failing["left"] -= 1
            raise MetadataUnavailable("etcd is down")

    publisher = Publisher(shared_loop(), apply, 2.0, {})
    try:
        with caplog.at_level(logging.WARNING, logger="kvstore"):
            publisher.publish([("f" * 32, b"h" * 16, BlockRecord("dram", 1, 0, 4096, b"\x01" * 32))], wait=True,
                              timeout=30)
    finally:
        publisher.stop()
    said = [r.getMessage() for r in caplog.records if r.name == "kvstore.daemon.publisher"]
    assert said[0].startswith("publishing 1 index updates failed, retrying") and "etcd is down" in said[0]
    assert said[-1].startswith("index publishing recovered after") and "7 failed batches" in said[-1]
    reminders = [s for s in said if s.startswith("index publishing still failing")]
    assert len(said) == 2 + len(reminders) and 1 <= len(reminders) <= 3  # not one per failed batch (6)
