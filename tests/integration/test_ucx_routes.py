"""Route reporting and UCX_TLS resolution; these run with or without the ucx extra installed."""
from __future__ import annotations

import logging

import pytest

from transfer import Engine, PeerUnreachable
from transfer.ucx_routes import fast, resolve_tls, unavailable


def test_engine_says_once_which_routes_it_has(caplog):
    with caplog.at_level(logging.INFO, logger="transfer.ucx"):
        with Engine("quiet", insecure=True, ucx=None) as engine:
            assert engine.export().ucx_tls == ()
    said = [r.getMessage() for r in caplog.records if "routes" in r.getMessage()]
    assert said == ["engine quiet routes: shm, tcp, file; no ucx (off)"]


def test_ucx_tls_resolution(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    assert resolve_tls(None) is None and resolve_tls("off") is None
    assert resolve_tls("posix,cma") == "posix,cma"
    monkeypatch.setenv("UCX_TLS", "rc,sm")
    assert resolve_tls("auto") == "rc,sm"  # the operator's UCX_TLS wins over the RDMA probe
    assert fast(("rc_mlx5", "tcp")) and fast(("cma",)) and not fast(("tcp",))


def test_forcing_ucx_without_the_route_is_a_typed_error(spawn_peer):
    peer_proc = spawn_peer(size=1 << 20)
    with Engine("none", insecure=True, ucx=None) as engine:
        with pytest.raises(PeerUnreachable, match="this engine has no UCX route"):
            engine.connect(peer_proc.descriptor, transport="ucx")
        assert engine.connect(peer_proc.descriptor).transport == "shm"  # auto still works


@pytest.mark.skipif(unavailable() is None, reason="the ucx extra is installed")
def test_without_ucxx_the_engine_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="transfer.ucx"):
        with Engine("plain", insecure=True, ucx="tcp"):
            pass
    assert any("ucxx is not usable" in r.getMessage() for r in caplog.records)
