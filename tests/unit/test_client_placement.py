"""Where a client's puts go: same host first, then by DRAM use counting puts in flight and the use
nodes reported in their replies."""
from __future__ import annotations

import time

from kvstore.client.placement import USAGE_FRESH_S, PutPlacement
from kvstore.index.records import NodeRecord

GIB = 1 << 30
MIB = 1 << 20


def node(name: str, used: int = 0, host: str = "other", capacity: int = GIB, draining: bool = False) -> NodeRecord:
    return NodeRecord(name, "127.0.0.1:1", {"dram": capacity}, host, used={"dram": used}, draining=draining)


def test_a_burst_spreads_over_nodes_by_what_is_in_flight():
    placement = PutPlacement("here")
    nodes = [node("a"), node("b"), node("c")]
    picked = [placement.pick(nodes, (), 64 * MIB).name for _ in range(30)]  # none settled yet
    assert {name: picked.count(name) for name in "abc"} == {"a": 10, "b": 10, "c": 10}


def test_settled_puts_no_longer_count_and_published_use_breaks_the_tie():
    placement = PutPlacement("here")
    nodes = [node("a", used=100 * MIB), node("b", used=300 * MIB)]
    first = placement.pick(nodes, (), 250 * MIB)
    assert first.name == "a"
    assert placement.pick(nodes, (), 10 * MIB).name == "b"  # a: 350 MiB counting the put under way
    placement.settle("a", 250 * MIB)
    assert placement.pick(nodes, (), 10 * MIB).name == "a"


def test_a_fresh_reply_beats_the_published_record_and_an_old_one_does_not():
    placement = PutPlacement("here")
    nodes = [node("a", used=0), node("b", used=500 * MIB)]
    placement.seen("a", {"used": 900 * MIB, "capacity": GIB})  # other clients filled it since it published
    assert placement.pick(nodes, (), 0).name == "b"
    placement._usage["a"] = (900 * MIB, GIB, time.monotonic() - USAGE_FRESH_S - 1)
    assert placement.pick(nodes, (), 0).name == "a"
    placement.seen("b", {"used": "lots", "capacity": 0})  # malformed: ignored
    assert placement.pick(nodes, (), 0).name == "a"


def test_same_host_first_and_draining_excluded_or_down_nodes_never():
    placement = PutPlacement("here")
    nodes = [node("far"), node("near", used=900 * MIB, host="here"), node("leaving", draining=True)]
    assert placement.pick(nodes, (), 0).name == "near"
    assert placement.pick(nodes, {"near"}, 0).name == "far"
    placement.mark_down("far")
    assert not placement.usable("far")
    assert placement.pick(nodes, {"near"}, 0) is None
