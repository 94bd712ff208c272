"""The daemon's background index publisher: coalescing, ordering, retry, sync waits."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvstore.aio import shared_loop
from kvstore.daemon.publisher import Publisher
from kvstore.errors import MetadataUnavailable
from kvstore.index.records import BlockRecord


def rec(n: int) -> BlockRecord:
    return BlockRecord("dram", 1, n * 4096, 4096, n.to_bytes(32, "little"))


class Sink:
    """A metadata service stand-in: applies batches in order, can fail or stall on demand."""

    def __init__(self) -> None:
        self.state: dict = {}
        self.batches: list[list] = []
        self.events: list[tuple[str, bytes]] = []  # what a watcher would see: etcd has no event for deleting nothing
        self.fail = 0
        self.delay = 0.0  # seconds each batch spends "in etcd"
        self.gate = threading.Event()
        self.gate.set()

    async def apply(self, updates) -> None:
        while not self.gate.is_set():
            await asyncio.sleep(0.005)
        await asyncio.sleep(self.delay)
        if self.fail:
            self.fail -= 1
            raise MetadataUnavailable("etcd is down")
        self.batches.append(list(updates))
        for fp, h, record in updates:
            if record is None:
                if self.state.pop((fp, h), None) is not None:
                    self.events.append(("delete", h))
            else:
                self.state[(fp, h)] = record
                self.events.append(("put", h))


@pytest.fixture
def sink_and_publisher():
    sink = Sink()
    counters: dict = {}
    publisher = Publisher(shared_loop(), sink.apply, 2.0, counters)
    yield sink, publisher, counters
    publisher.stop()


def test_last_word_wins_and_batches_gather_while_one_is_in_flight(sink_and_publisher):
    sink, publisher, counters = sink_and_publisher
    sink.gate.clear()  # the first batch stalls "in etcd"
    publisher.enqueue([("fp", b"a", rec(1))])
    for n in range(50):  # meanwhile: many updates, the last word on b is a deletion
        publisher.enqueue([("fp", b"b", rec(n)), ("fp", bytes([n]), rec(n))])
    publisher.enqueue([("fp", b"b", None)])
    sink.gate.set()
    publisher.flush(5)
    assert ("fp", b"b") not in sink.state and sink.state[("fp", b"a")] == rec(1)
    assert len(sink.batches) <= 3  # not one transaction per update
    assert counters["published_updates"] < 52 * 2


def test_a_failed_batch_is_retried_under_newer_words(sink_and_publisher):
    sink, publisher, counters = sink_and_publisher
    sink.fail = 2
    publisher.enqueue([("fp", b"x", rec(1)), ("fp", b"y", rec(2))])
    publisher.enqueue([("fp", b"x", None)])  # may land in the failing batch or after it: x stays gone
    publisher.flush(5)
    assert sink.state == {("fp", b"y"): rec(2)}
    assert counters["publish_failures"] >= 1


def test_sync_publish_waits_and_times_out_while_etcd_is_down(sink_and_publisher):
    sink, publisher, _ = sink_and_publisher
    publisher.publish([("fp", b"s", rec(3))], True, 5)
    assert sink.state[("fp", b"s")] == rec(3)  # published before publish() returned
    sink.fail = 10_000
    with pytest.raises(MetadataUnavailable):
        publisher.publish([("fp", b"t", rec(4))], True, 0.3)
    sink.fail = 0
    publisher.flush(5)  # and it gets there once etcd is back
    assert sink.state[("fp", b"t")] == rec(4)


def test_sparse_updates_go_alone_and_a_stream_gathers_into_few_batches():
    sink = Sink()
    publisher = Publisher(shared_loop(), sink.apply, 2.0, window=0.2)
    try:
        for n in range(4):  # a put now and then: each published on its own, without waiting for others
            publisher.flush(5)
            publisher.enqueue([("fp", bytes([n]), rec(n))])
            threading.Event().wait(0.05)
        publisher.flush(5)
        assert [len(b) for b in sink.batches] == [1, 1, 1, 1]
        sink.batches.clear()
        due = time.perf_counter()
        for n in range(200):  # a stream, one update every 0.5 ms (catching up after a stall)
            while time.perf_counter() < due:
                time.sleep(0)
            publisher.enqueue([("fp", b"s" + n.to_bytes(2, "little"), rec(n))])
            due += 0.0005
        publisher.flush(5)
        assert sum(len(b) for b in sink.batches) == 200
        assert len(sink.batches) <= 15, [len(b) for b in sink.batches]  # a fixed 2 ms gap: ~50 batches
    finally:
        publisher.stop()


def test_an_eviction_before_the_put_went_out_still_reaches_watchers(sink_and_publisher):
    """The putting client learned the block from the put's reply: merging the put and its deletion
    into a bare delete would leave no event, and that client listing the block for good."""
    sink, publisher, _ = sink_and_publisher
    sink.delay = 0.02  # a wait that returned one batch early would see the deletion still to come
    sink.gate.clear()  # a batch is in flight; the next gathers behind it
    publisher.enqueue([("fp", b"other", rec(9))])
    time.sleep(0.05)
    publisher.enqueue([("fp", b"b", rec(1))])
    ticket = publisher.enqueue([("fp", b"b", None)])
    sink.gate.set()
    publisher.wait(ticket, 5)  # a sync deletion returns only once the deletion itself is out
    assert ("fp", b"b") not in sink.state
    assert [e for e in sink.events if e[1] == b"b"] == [("put", b"b"), ("delete", b"b")]
    assert publisher.pending == 0


def test_a_re_put_after_a_held_deletion_is_the_last_word(sink_and_publisher):
    sink, publisher, _ = sink_and_publisher
    sink.gate.clear()
    publisher.enqueue([("fp", b"other", rec(9))])
    time.sleep(0.05)
    publisher.enqueue([("fp", b"b", rec(1))])
    publisher.enqueue([("fp", b"b", None)])
    publisher.enqueue([("fp", b"b", rec(2))])
    sink.gate.set()
    publisher.flush(5)
    assert sink.state[("fp", b"b")] == rec(2)
    assert [e for e in sink.events if e[1] == b"b"] == [("put", b"b")]


def test_a_deletion_behind_a_failed_put_still_reaches_watchers(sink_and_publisher):
    sink, publisher, counters = sink_and_publisher
    sink.delay = 0.02
    sink.gate.clear()
    sink.fail = 1  # the batch carrying the put fails...
    publisher.enqueue([("fp", b"b", rec(1))])
    time.sleep(0.05)  # ...and the deletion arrives while it is in flight
    ticket = publisher.enqueue([("fp", b"b", None)])
    sink.gate.set()
    publisher.wait(ticket, 5)
    assert counters["publish_failures"] == 1
    assert ("fp", b"b") not in sink.state
    assert sink.events == [("put", b"b"), ("delete", b"b")]
    later = publisher.enqueue([("fp", b"c", rec(2))])  # and later tickets still wait for their batch
    publisher.wait(later, 5)
    assert sink.state[("fp", b"c")] == rec(2)


def test_the_publish_delay_counts_from_each_update_not_from_an_older_batch():
    """Evictions right behind every put hold a deletion in every batch: the reported wait is each
    batch's oldest update's, not one that keeps growing from the first batch."""
    sink, waits = Sink(), []
    sink.delay = 0.005
    publisher = Publisher(shared_loop(), sink.apply, 2.0, on_published=waits.append)
    try:
        until = time.monotonic() + 0.5
        n = 0
        while time.monotonic() < until:
            publisher.enqueue([("fp", n.to_bytes(4, "little"), rec(n))])
            publisher.enqueue([("fp", n.to_bytes(4, "little"), None)])
            n += 1
            time.sleep(0.001)
        publisher.flush(5)
        assert waits and max(waits) < 0.25, max(waits)
    finally:
        publisher.stop()
