"""Store control tokens: one call, one method, one node, a bounded time; never replayable."""
from __future__ import annotations

import os
import time

from kvstore.access import TOKEN_WINDOW_S, TokenCheck, control_token

SECRET = b"cluster-secret"
PUT = "/kvstore.store.v1.StoreControl/Allocate"


def test_a_fresh_token_is_accepted_once():
    check = TokenCheck(SECRET, "node-a")
    token = control_token(SECRET, "node-a", PUT, "client-1")
    assert check.verify(token, PUT) is None
    assert check.verify(token, PUT) == "replayed cluster token"


def test_a_token_inside_its_window_is_never_forgotten_however_many_come(monkeypatch):
    """At the cap of tokens remembered, new ones are refused (the caller retries) rather than the
    oldest forgotten. Kills: evicting the oldest token at the cap (200,000 calls later, a token
    captured inside its window replayed)."""
    monkeypatch.setattr("kvstore.access._MAX_SEEN", 3)
    check = TokenCheck(SECRET, "node-a")
    now = time.time()
    first = control_token(SECRET, "node-a", PUT, "c", now)
    assert check.verify(first, PUT, now) is None
    for _ in range(2):
        assert check.verify(control_token(SECRET, "node-a", PUT, "c", now), PUT, now) is None
    assert "too many calls" in check.verify(control_token(SECRET, "node-a", PUT, "c", now), PUT, now)
    assert check.verify(first, PUT, now + 1) == "replayed cluster token"  # still remembered
    later = now + 2 * TOKEN_WINDOW_S + 1  # the first three are out of every window: forgotten, room again
    assert check.verify(control_token(SECRET, "node-a", PUT, "c", later), PUT, later) is None


def test_tokens_differ_per_call_and_never_carry_the_secret():
    tokens = {control_token(SECRET, "node-a", PUT, "client-1") for _ in range(100)}
    assert len(tokens) == 100
    assert not any(SECRET.decode() in t or SECRET.hex() in t for t in tokens)


def test_a_token_is_bound_to_its_node_method_and_secret():
    token = control_token(SECRET, "node-a", PUT, "client-1")
    assert "wrong" in TokenCheck(SECRET, "node-b").verify(token, PUT)
    assert "wrong" in TokenCheck(SECRET, "node-a").verify(token, "/kvstore.store.v1.StoreControl/Delete")
    assert "wrong" in TokenCheck(b"other", "node-a").verify(token, PUT)


def test_old_or_future_tokens_are_refused():
    check = TokenCheck(SECRET, "node-a")
    now = time.time()
    assert "expired" in check.verify(control_token(SECRET, "node-a", PUT, "c", now - TOKEN_WINDOW_S - 5), PUT)
    assert "expired" in check.verify(control_token(SECRET, "node-a", PUT, "c", now + TOKEN_WINDOW_S + 5), PUT)


def test_malformed_tokens_are_refused():
    check = TokenCheck(SECRET, "node-a")
    for token in ("", "Bearer abc", "KVS1 a.b.c", "KVS1 a.x.y.n.mac", "KVS1 " + "." * 4):
        assert check.verify(token, PUT) is not None


def test_clients_find_the_secret_kvstore_serve_generated(tmp_path, monkeypatch):
    from kvstore.access import cluster_secret, secret_path

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KVSTORE_SECRET", raising=False)
    assert cluster_secret("c1") is None
    path = secret_path("c1")
    os.makedirs(os.path.dirname(path))
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("generated\n")
    assert cluster_secret("c1") == "generated"
    assert cluster_secret("c2") is None
    monkeypatch.setenv("KVSTORE_SECRET", "from-env")
    assert cluster_secret("c1") == "from-env"


def test_a_token_is_bound_to_its_request_body():
    """Kills: a token whose MAC leaves out the request: one seen on the wire, not used yet, carried
    another request (a Remove of someone else's block) to the node."""
    check = TokenCheck(SECRET, "node-a")
    token = control_token(SECRET, "node-a", PUT, "c", body=b"remove block 1")
    assert "request body" in check.verify(token, PUT, body=b"remove block 2")
    assert check.verify(token, PUT, body=b"remove block 1") is None  # the one it was made for, once
    assert check.verify(token, PUT, body=b"remove block 1") == "replayed cluster token"


def test_a_tenant_token_proves_its_tenant_and_nothing_else():
    """Kills: tokens checked with the cluster key whatever tenant they name, or with any tenant's."""
    tenants = {"acme": b"acme-secret-0123456789", "beta": b"beta-secret-0123456789"}
    check = TokenCheck(SECRET, "node-a", tenants)
    good = control_token(tenants["acme"], "node-a", PUT, "c", tenant="acme")
    assert check.authenticate(good, PUT) == (None, "acme")
    assert check.authenticate(control_token(SECRET, "node-a", PUT, "c"), PUT) == (None, "")  # the operator
    for secret, tenant in ((tenants["beta"], "acme"), (SECRET, "acme"), (tenants["acme"], "gamma"),
                           (tenants["acme"], "")):
        why, who = check.authenticate(control_token(secret, "node-a", PUT, "c", tenant=tenant), PUT)
        assert why is not None and "wrong" in why and who == ""
    assert "older" in check.verify("KVS1 c.1.2.abc.def", PUT)


def test_a_tenant_may_name_only_its_own_fingerprints():
    from kvstore.access import denied

    assert denied("", "acme:" + "0" * 32) is None and denied("", "0" * 32) is None  # the operator: all
    assert denied("acme", "acme:" + "0" * 32) is None
    for other in ("beta:" + "0" * 32, "0" * 32, "acme", "acme-2:" + "0" * 32, "free-form"):
        assert "its own" in denied("acme", other)


def test_plaintext_etcd_off_loopback_is_warned_about_once(caplog):
    """Kills: no start-up warning for etcd:// off loopback (anyone who reaches it reads and rewrites
    the index); it names etcd+tls and never the user or password in the URL."""
    import logging

    from kvstore.metadata import warn_plaintext_etcd

    with caplog.at_level(logging.WARNING, logger="kvstore.metadata"):
        for quiet in ("etcd://127.0.0.1:2379", "etcd://localhost:2379", "etcd://[::1]:2379",
                      "etcd+tls://10.9.8.7:2379", "memory://x"):
            assert not warn_plaintext_etcd(quiet)
        assert warn_plaintext_etcd("etcd://kv:pw-not-logged@10.9.8.7:2379")
        assert not warn_plaintext_etcd("etcd://10.9.8.7:2379")  # once per address
    text = caplog.text
    assert "10.9.8.7:2379" in text and "etcd+tls://" in text and "pw-not-logged" not in text
    assert text.count("plaintext") == 1
