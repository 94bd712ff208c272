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
