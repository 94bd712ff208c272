"""Free ports for servers started on a chosen port: never one an outgoing connection can take
meanwhile, never one in use, never the same one twice in a process."""
from __future__ import annotations

import socket

import pytest

from kvstore_testing import ports


def test_ports_come_from_below_the_ephemeral_range(monkeypatch):
    """Kills choosing with bind(0): the kernel's port is in its ephemeral range, where the next
    outgoing connection on the machine may take it before the server binds it. (The range is set
    here: a host whose own range starts below 10000 would leave no room to choose from.)"""
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (32768, 60999))
    chosen = [ports.free_port() for _ in range(50)]
    assert all(10_000 <= p < 30_000 for p in chosen)


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


@pytest.mark.parametrize("ephemeral, want", [((32768, 60999), range(18000, 30000)),
                                            ((22000, 60999), range(10000, 22000)),
                                            ((10500, 60999), range(10000, 10500)), ((9000, 60999), None),
                                            (None, None)])
def test_the_candidates_sit_just_below_the_ephemeral_range(ephemeral, want):
    assert ports.candidates(ephemeral) == want


def test_an_unreadable_range_lets_the_kernel_choose(tmp_path):
    assert ports.ephemeral_range(str(tmp_path / "missing")) is None
    (tmp_path / "bad").write_text("not numbers")
    assert ports.ephemeral_range(str(tmp_path / "bad")) is None


def test_two_test_workers_never_choose_the_same_port():
    """Kills one pool for every pytest-xdist worker: the bind check cannot see a port the other
    worker chose and has not bound yet (a vLLM engine binds its port a minute after the choice)."""
    pool = range(18000, 30000)
    shares = [set(ports.worker_share(pool, f"gw{i}", "3")) for i in range(3)]
    assert not (shares[0] & shares[1] or shares[0] & shares[2] or shares[1] & shares[2])
    assert set().union(*shares) == set(pool)
    assert ports.worker_share(pool, None, None) == pool == ports.worker_share(pool, "master", "2")


def test_the_command_line_gives_shell_assignments_or_a_count(capsys):
    assert ports.main(["ETCD_PORT", "PEER_PORT"]) == 0
    lines = capsys.readouterr().out.split()
    assert [line.split("=")[0] for line in lines] == ["ETCD_PORT", "PEER_PORT"]
    assert len({line.split("=")[1] for line in lines}) == 2
    assert ports.main(["3"]) == 0 and len(set(capsys.readouterr().out.split())) == 3
    assert ports.main(["not-a-name"]) == 2
    assert "not a count or a shell name: 'not-a-name'" in capsys.readouterr().err
