"""Each store operation is defined once (kvstore.daemon.operations) and served by one protocol,
the framed wire (kvstore.daemon.local), which only translates: it calls no store operation itself,
it calls each operation from one place, and nothing else in the package serves them (gRPC carries
the admin API only)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvstore.daemon.operations import OpFailed, check_digests, check_fingerprint, check_hashes, check_ints, check_peer

DAEMON = Path(__file__).resolve().parents[2] / "kvstore" / "daemon"
PACKAGE = DAEMON.parent
# BlockStore's methods behind the store operations (reads of bytes for the wire's `read`, which
# only the wire serves, are not among them).
STORE_OPERATIONS = {"reserve", "commit_and_lease", "commit_reserved", "abort", "touch", "remove", "records"}
# StoreOperations' operations, as the wire's handler calls them.
OPERATIONS = {"reserve", "commit", "begin_put", "finish_put", "abort", "lookup", "touch", "remove"}


def calls(path: Path, owner: str, names: set[str]) -> list[str]:
    """`X.<owner>.NAME(...)` and `<owner>.NAME(...)` calls in `path`, NAME one of `names`, as
    "file:line owner.NAME" (the file relative to the package)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names:
            value = node.func.value
            if (isinstance(value, ast.Attribute) and value.attr == owner) or \
                    (isinstance(value, ast.Name) and value.id == owner):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {owner}.{node.func.attr}")
    return found


def store_calls(path: Path) -> list[str]:
    """Calls of the BlockStore's methods behind the store operations in `path`."""
    return calls(path, "store", STORE_OPERATIONS)


def operation_calls(path: Path) -> list[str]:
    """Calls of StoreOperations' operations in `path`."""
    return calls(path, "ops", OPERATIONS)


def test_the_wire_calls_no_store_operation_itself():
    """Kills: a handler that goes to the store directly (as gRPC's and the wire's once did, each
    with its own checks and error mapping) instead of through kvstore.daemon.operations."""
    assert store_calls(DAEMON / "local.py") == []


def test_each_operation_is_served_in_one_place():
    """Kills: a second protocol serving the store operations beside the wire (a gRPC service, as
    there was): every operation is called from kvstore/daemon/local.py only, each from one line
    (abort also where a put's bytes fail to arrive)."""
    found = [c for path in sorted(PACKAGE.rglob("*.py")) if path.name != "operations.py" for c in operation_calls(path)]
    assert {c.split(":")[0] for c in found} == {"daemon/local.py"}, found
    names = [c.rsplit(".", 1)[1] for c in found]
    assert set(names) == OPERATIONS
    assert all(names.count(n) == 1 for n in OPERATIONS - {"abort"}) and names.count("abort") == 2, found


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
