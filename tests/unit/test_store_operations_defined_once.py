"""Each store operation is defined once (kvstore.daemon.operations) and the two transports only
translate: neither gRPC's service nor the framed wire calls the store's operations itself, so a
check, a refusal or a result cannot differ between them."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvstore.daemon.operations import OpFailed, check_digests, check_fingerprint, check_hashes, check_ints, check_peer

DAEMON = Path(__file__).resolve().parents[2] / "kvstore" / "daemon"
TRANSPORTS = ("service.py", "local.py")
# BlockStore's methods behind the store operations (reads of bytes for the wire's `read`, which
# only the wire serves, are not among them).
STORE_OPERATIONS = {"reserve", "commit_and_lease", "put_inline", "commit_reserved", "abort", "touch", "remove",
                    "records"}


def store_calls(path: Path) -> list[str]:
    """`X.store.NAME(...)` and `store.NAME(...)` calls of a store operation in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STORE_OPERATIONS:
            owner = node.func.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "store") or \
                    (isinstance(owner, ast.Name) and owner.id == "store"):
                found.append(f"{path.name}:{node.lineno} store.{node.func.attr}")
    return found


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_transport_calls_no_store_operation_itself(transport):
    """Kills: a handler that goes to the store directly (as both did, each with its own checks and
    error mapping) instead of through kvstore.daemon.operations."""
    assert store_calls(DAEMON / transport) == []


def test_the_operations_module_calls_each_of_them():
    called = {c.rsplit(".", 1)[1] for c in store_calls(DAEMON / "operations.py")}
    assert called == STORE_OPERATIONS


@pytest.mark.parametrize("check, args, code", [
    (check_hashes, ([b"x" * 15],), "invalid"),
    (check_hashes, (["00" * 16],), "invalid"),  # hex not decoded: a transport's job
    (check_digests, ([b"d" * 32], 2), "invalid"),
    (check_digests, ([b"d" * 16], 1), "invalid"),
    (check_ints, ([1, -1], "sizes", 2), "invalid"),
    (check_ints, ([True], "tokens"), "invalid"),
    (check_fingerprint, (7, ""), "invalid"),
    (check_fingerprint, ("other:abc", "acme"), "denied"),
    (check_peer, ("not-hex", ""), "invalid"),
])
def test_bad_arguments_fail_with_their_code(check, args, code):
    with pytest.raises(OpFailed) as failed:
        check(*args)
    assert failed.value.code == code and str(failed.value)


def test_good_arguments_pass():
    assert check_hashes([b"h" * 16]) == [b"h" * 16]
    assert check_digests([b"d" * 32], 1) == [b"d" * 32]
    assert check_ints([0, 5], "sizes", 2, 10) == [0, 5]
    assert check_fingerprint("acme:abc", "acme") == "acme:abc"
    assert check_fingerprint("abc", "") == "abc"
    assert check_peer("", "acme") == "" and check_peer("ab" * 16, "") == "ab" * 16
