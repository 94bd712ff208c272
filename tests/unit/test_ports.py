"""Free ports for servers started on a chosen port: never one an outgoing connection can take
meanwhile, never one in use, never the same one twice in a process."""
from __future__ import annotations

import socket

import pytest

from kvstore.testing import ports


def test_ports_come_from_below_the_ephemeral_range():
    """Kills choosing with bind(0): the kernel's port is in its ephemeral range, where the next
    outgoing connection on the machine may take it before the server binds it."""
    ephemeral = ports.ephemeral_range()
    if ephemeral is None:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here")
    chosen = [ports.free_port() for _ in range(50)]
    assert all(p < ephemeral[0] for p in chosen)


def test_a_process_never_hands_out_a_port_twice():
    """Kills a chooser without memory: a batch of ports picked before any server binds (an etcd
    cluster takes nine) then held two servers on one port (with bind(0), 6 in 100,000
    back-to-back pairs; with random picks from 12,000, dozens in 1,000)."""
    chosen = [ports.free_port() for _ in range(1000)]
    assert len(set(chosen)) == len(chosen)


def test_a_port_something_listens_on_is_skipped(monkeypatch):
    """Kills handing out a chosen port without checking that it binds."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = iter([taken, taken, 0])
        monkeypatch.setattr(ports, "candidates", lambda ephemeral: range(1))  # any pool: choice is faked
        monkeypatch.setattr(ports._random, "choice", lambda pool: next(picks) or ports._kernel_choice())
        assert ports.free_port() != taken


@pytest.mark.parametrize("ephemeral, want", [((32768, 60999), range(20768, 32768)), ((10500, 60999), range(10000, 10500)),
                                            ((9000, 60999), None), (None, None)])
def test_the_candidates_sit_just_below_the_ephemeral_range(ephemeral, want):
    assert ports.candidates(ephemeral) == want


def test_an_unreadable_range_lets_the_kernel_choose(tmp_path):
    assert ports.ephemeral_range(str(tmp_path / "missing")) is None
    (tmp_path / "bad").write_text("not numbers")
    assert ports.ephemeral_range(str(tmp_path / "bad")) is None
