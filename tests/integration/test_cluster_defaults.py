"""What a client takes from the cluster when it is told nothing: the replica count its daemons
were started with, and which secret to use — and the one line it gives when that secret cannot
work with a node. Real etcd, daemons in their own processes."""
from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from kvstore import Client, ModelFingerprint, external_hashes
from kvstore.errors import AuthenticationFailed

FP = ModelFingerprint("defaults", "float16", 16, 2, 2, 64, kv_layout="bytes")
SECRET = "cluster-defaults-secret-0123456789"


def wait_for_nodes(client: Client, names: set[str]) -> None:
    assert client.mirror.wait_until(lambda m: names <= set(m.nodes), 10)


def test_a_client_writes_the_replica_count_its_cluster_was_started_with(etcd_server, spawn_daemon):
    """`kvstore serve --replicas 2` is the cluster's default for clients that name none. Kills: a
    client writing one copy by default (one kill -9 then loses blocks the operator asked to keep twice)."""
    cluster = uuid.uuid4().hex[:8]
    for name in ("r1", "r2", "r3"):
        spawn_daemon(name, etcd_server.url, cluster, secret=SECRET, extra=["--replicas", "2"])
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET) as client:
        wait_for_nodes(client, {"r1", "r2", "r3"})
        assert client.cluster_replicas() == 2
        hashes = external_hashes(range(10), FP)
        client.put_many([(h, np.full(4096, i, dtype=np.uint8)) for i, h in enumerate(hashes)])
        assert all(len(client.mirror.lookup(FP.digest, h)) == 2 for h in hashes)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, replicas=1) as client:
        wait_for_nodes(client, {"r1", "r2", "r3"})
        h = external_hashes([100], FP)[0]
        client.put(h, np.zeros(4096, dtype=np.uint8))
        assert len(client.mirror.lookup(FP.digest, h)) == 1  # an explicit count still wins


def test_a_stray_secret_file_against_an_insecure_daemon_fails_at_connect_naming_the_file(
        etcd_server, spawn_daemon, tmp_path, monkeypatch):
    """A client given no secret takes ~/.kvstore/<cluster>.secret when an earlier `kvstore serve`
    left one; against an --insecure daemon every put then failed, silently for the vLLM connector.
    Kills: connecting without comparing what the node expects with what the client has."""
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("open", etcd_server.url, cluster)  # --insecure
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KVSTORE_SECRET", raising=False)
    stray = tmp_path / ".kvstore" / f"{cluster}.secret"
    stray.parent.mkdir()
    stray.write_text("left-over-secret-from-another-run")
    stray.chmod(0o600)  # as `kvstore serve` leaves it (a loose one is refused before this)
    probe = Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret="")  # none on purpose: works
    try:
        wait_for_nodes(probe, {"open"})
        probe.put(external_hashes([1], FP)[0], np.ones(4096, dtype=np.uint8))
    finally:
        probe.close()
    with pytest.raises(AuthenticationFailed) as raised:
        Client(etcd_server.url, cluster=cluster, fingerprint=FP)
    message = str(raised.value)
    assert "--insecure" in message and str(stray) in message and "\n" not in message


def test_a_client_without_the_secret_of_a_secured_node_is_told_where_to_get_it(
        etcd_server, spawn_daemon, tmp_path, monkeypatch):
    """Kills: a missing secret surfacing only as a failed put (or an UNAUTHENTICATED status string)."""
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("closed", etcd_server.url, cluster, secret=SECRET)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KVSTORE_SECRET", raising=False)
    with pytest.raises(AuthenticationFailed, match="requires the cluster secret and this client has none"):
        Client(etcd_server.url, cluster=cluster, fingerprint=FP)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_wrong_secret_is_refused_in_one_line_that_says_where_it_came_from(
        etcd_server, spawn_daemon, monkeypatch, transport):
    """Kills: the handshake's bare 'peer could not prove it knows the cluster secret'."""
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("closed", etcd_server.url, cluster, secret=SECRET)
    monkeypatch.setenv("KVSTORE_SECRET", "not-the-cluster-secret-at-all")
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, transport=transport) as client:
        wait_for_nodes(client, {"closed"})
        with pytest.raises(AuthenticationFailed, match="refused this client's cluster secret .from KVSTORE_SECRET"):
            client.put(external_hashes([1], FP)[0], np.ones(4096, dtype=np.uint8))
    assert os.environ["KVSTORE_SECRET"]


def test_a_node_whose_secret_file_is_missing_does_not_make_a_second_secret_for_a_secured_cluster(
        etcd_server, spawn_daemon, tmp_path):
    """A mistyped --secret-file used to generate a fresh secret and join: the cluster split in two
    halves that refuse each other (a later drain dropped blocks). Kills: generating a secret file
    without asking whether the cluster's live nodes already hold one."""
    import subprocess
    import sys

    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("first", etcd_server.url, cluster, secret=SECRET)
    typo = tmp_path / "secrte"
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--node", "second", "--metadata",
                           etcd_server.url, "--cluster", cluster, "--dram", "16MiB", "--secret-file", str(typo),
                           "--admin-token-file", str(tmp_path / "token")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"kvstore serve: error: --secret-file: {typo} does not exist, and cluster {cluster!r} already has nodes "
        "with a secret (first): give this node their secret file (a fresh secret would split the cluster)"]
    assert not typo.exists()
