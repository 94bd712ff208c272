"""The client's side of leased slots: which it writes into, which it gives back, and when."""
from __future__ import annotations

import time

from kvstore.client.leases import LEASE_MAX_BYTES, SlotLeases

MIB = 1 << 20
TTL = 60.0  # the node's hold: usable for 60 / 2 - timeout seconds after the commit asked


def granted(n: int, first: int = 1) -> list[tuple[int, int, int]]:
    return [(first + i, 1, i * MIB) for i in range(n)]


def test_a_put_takes_slots_leased_over_the_same_connection_only():
    leases, conn = SlotLeases(timeout=1.0), object()
    assert leases.keep(conn, "a", "fp", MIB, granted(4), time.monotonic(), TTL) == []
    taken, aged = leases.take(conn, "a", "fp", MIB, 3)
    assert [s.token for s in taken] == [1, 2, 3] and aged == []
    assert leases.take(conn, "a", "fp", MIB, 2) == (None, [])  # one left: not enough, and kept
    assert leases.take(conn, "a", "fp", 2 * MIB, 1) == (None, [])  # another block size
    assert leases.take(object(), "a", "fp", MIB, 1) == (None, [])  # a reconnect: that slot is forgotten
    assert leases.slots() == []


def test_slots_too_old_to_finish_a_write_in_are_handed_back_not_used():
    leases, conn = SlotLeases(timeout=1.0), object()
    leases.keep(conn, "a", "fp", MIB, granted(2), time.monotonic(), TTL)
    leases.slots()[0].usable_until = time.monotonic() + 0.5  # a write started now could outlive it
    taken, aged = leases.take(conn, "a", "fp", MIB, 1)
    assert [s.token for s in taken] == [2] and aged == [1]


def test_a_hold_too_short_for_the_timeout_gives_every_slot_back_and_asks_for_none():
    leases, conn = SlotLeases(timeout=5.0), object()
    assert leases.wanted(conn, "a", "fp", MIB, 4) == 4  # nothing known of the node yet
    assert leases.keep(conn, "a", "fp", MIB, granted(4), time.monotonic(), 12.0) == [1, 2, 3, 4]
    assert leases.slots() == [] and leases.wanted(conn, "a", "fp", MIB, 4) == 0
    assert leases.keep(conn, "a", "fp", MIB, granted(2), time.monotonic(), "bogus") == [1, 2]


def test_the_client_asks_for_one_more_put_of_slots_less_those_held_up_to_a_cap():
    leases, conn = SlotLeases(timeout=1.0), object()
    leases.keep(conn, "a", "fp", MIB, granted(3), time.monotonic(), TTL)
    assert leases.wanted(conn, "a", "fp", MIB, 8) == 5
    assert leases.wanted(object(), "a", "fp", MIB, 8) == 8  # those held came over another connection
    assert leases.wanted(conn, "a", "fp", 32 * MIB, 8) == LEASE_MAX_BYTES // (32 * MIB)
    assert leases.wanted(conn, "a", "fp", 0, 8) == 0  # blocks of mixed sizes: no lease


def test_closing_gives_back_only_slots_of_connections_still_open():
    leases, old, new = SlotLeases(timeout=1.0), object(), object()
    leases.keep(old, "a", "fp", MIB, granted(2), time.monotonic(), TTL)
    leases.keep(new, "b", "fp", MIB, granted(2, first=7), time.monotonic(), TTL)
    leases.keep(new, "c", "fp", MIB, granted(1, first=9), time.monotonic(), TTL)
    leases.forget("c")  # its connection failed
    assert leases.drain({"a": new, "b": new, "c": new}) == {"b": [7, 8]}
    assert leases.slots() == []
