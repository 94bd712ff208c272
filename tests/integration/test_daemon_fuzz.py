"""Bounded fuzz of a daemon's two protocols with hypothesis: its gRPC admin API (requests with
random field values, random bytes as requests) and the store operations of its framed wire
(random ops and field values, past authentication, answered as the same-host socket answers
them). Every gRPC call must end in a reply or a deliberate status — never UNKNOWN/INTERNAL (an
unhandled exception) — every wire request in a reply or one of the wire's error codes, and the
daemon must keep serving."""
from __future__ import annotations

import os

import grpc
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from google.protobuf.descriptor import FieldDescriptor as F  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvstore  # noqa: E402
from kvstore.admin.v1 import admin_pb2, admin_pb2_grpc  # noqa: E402
from kvstore.keys import ModelFingerprint, external_hashes  # noqa: E402
from kvstore.daemon.local import OPS  # noqa: E402
from kvstore.daemon.operations import CODES  # noqa: E402

FP = ModelFingerprint("fuzz", "float16", 16, 2, 2, 64, kv_layout="bytes")
FUZZ = settings(max_examples=int(os.environ.get("KVT_FUZZ_EXAMPLES", "200")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
# Drain empties the node for good; everything else may be called with anything.
ADMIN = admin_pb2.DESCRIPTOR.services_by_name["Admin"]
CALLS = [(f"/{ADMIN.full_name}/{m.name}", m) for m in ADMIN.methods if m.name != "Drain"]


@pytest.fixture(scope="module")
def daemon():
    store = kvstore.open(dram="16MiB", fingerprint=FP)
    hashes = external_hashes(list(range(1, 9)), FP)
    for h in hashes:
        store.put(h, np.full(4096, h[0], np.uint8))
    yield store
    store.close()


def scalar(field) -> st.SearchStrategy:
    t = field.type
    if t == F.TYPE_STRING:
        return st.one_of(st.text(max_size=40), st.sampled_from(["", FP.digest, "dram", "nvme", "lru", "lfu", "x" * 300]))
    if t == F.TYPE_BYTES:
        return st.one_of(st.binary(max_size=40), st.binary(min_size=16, max_size=16))
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, -1.0, 1e308]))
    if t == F.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    unsigned = t in (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_FIXED32, F.TYPE_FIXED64)
    bits = 32 if t in (F.TYPE_INT32, F.TYPE_UINT32, F.TYPE_SINT32, F.TYPE_FIXED32, F.TYPE_SFIXED32) else 64
    lo, hi = (0, 2**bits - 1) if unsigned else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, 0, 1, 4096]))


def repeated(field) -> bool:
    flag = getattr(field, "is_repeated", None)
    return flag if flag is not None else field.label == F.LABEL_REPEATED


def message(descriptor, cls, depth: int = 0) -> st.SearchStrategy:
    fields = {}
    for field in descriptor.fields:
        if field.type == F.TYPE_MESSAGE:
            if depth >= 2 or field.message_type.GetOptions().map_entry:
                continue
            sub = message(field.message_type, None, depth + 1)
            fields[field.name] = st.lists(sub, max_size=3) if repeated(field) else sub
        elif repeated(field):
            fields[field.name] = st.lists(scalar(field), max_size=5)
        else:
            fields[field.name] = scalar(field)
    strategy = st.fixed_dictionaries({}, optional=fields)
    if cls is None:
        return strategy
    return strategy.map(lambda values: cls(**values))


def request_class(method):
    return getattr(admin_pb2, method.input_type.name)


def call(daemon, path: str, payload: bytes, *, streaming: bool) -> grpc.StatusCode:
    d = daemon.daemon
    with grpc.insecure_channel(d.address) as channel:
        kind = channel.unary_stream if streaming else channel.unary_unary
        fn = kind(path, request_serializer=None, response_deserializer=None)
        try:
            reply = fn(payload, timeout=10)
            if streaming:
                for _ in reply:
                    pass
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


@FUZZ
@given(data=st.data())
def test_random_requests_get_deliberate_answers(daemon, data):
    path, method = data.draw(st.sampled_from(CALLS))
    cls = request_class(method)
    request = data.draw(message(method.input_type, cls))
    try:
        payload = request.SerializeToString()
    except Exception:  # noqa: BLE001 - e.g. out-of-range floats the encoder refuses: nothing to send
        return
    code = call(daemon, path, payload, streaming=method.server_streaming if hasattr(method, "server_streaming") else False)
    assert code not in BAD, (path, request)


@FUZZ
@given(index=st.integers(0, len(CALLS) - 1), payload=st.binary(max_size=256))
def test_random_bytes_as_requests_are_refused_cleanly(daemon, index, payload):
    path, method = CALLS[index]
    code = call(daemon, path, payload, streaming=False)
    try:
        request_class(method).FromString(payload)
    except Exception:  # noqa: BLE001 - not a request at all: gRPC itself refuses it (INTERNAL)
        assert code != grpc.StatusCode.OK
        return
    assert code not in BAD, (path, payload)  # it parsed: the service must answer deliberately


def test_the_daemon_still_serves_after_the_fuzz(daemon):
    d = daemon.daemon
    with grpc.insecure_channel(d.address) as channel:
        status = admin_pb2_grpc.AdminStub(channel).GetNodeStatus(admin_pb2.NodeStatusRequest(), timeout=5)
        assert status.name == d.config.node
    # (the fuzz may have evicted the blocks, set watermarks that take no more: the wire still answers)
    reply, _, _ = d.local.in_process({"op": "lookup", "fp": FP.digest, "hashes": [external_hashes([1], FP)[0].hex()]})
    assert reply["ok"] and len(reply["records"]) == 1


# --- the framed wire's store operations ------------------------------------------------------------
HEX = st.one_of(st.text("0123456789abcdef", max_size=70), st.sampled_from(["", "zz", "0" * 32, "f" * 64]))
VALUE = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), HEX,
                               st.text(max_size=20)),
                     lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=3)),
                     max_leaves=8)
FIELDS = ("fp", "hashes", "sizes", "digests", "tokens", "sync", "repair", "peer", "lease", "corrupt", "codec")


@FUZZ
@given(data=st.data())
def test_random_wire_requests_get_deliberate_answers(daemon, data):
    """Kills: a store operation whose handler lets a malformed field escape as an exception."""
    op = data.draw(st.sampled_from(OPS + ("nothing", "")))
    request = {"op": op, **data.draw(st.dictionaries(st.sampled_from(FIELDS), VALUE, max_size=6))}
    if isinstance(request.get("fp"), str) and data.draw(st.booleans()):
        request["fp"] = FP.digest  # past the fingerprint check more often
    if op == "put":
        request.pop("sizes", None)  # (its bytes are the fuzz of the put test below)
    node = daemon.links.in_process[daemon.daemon.config.node]
    reply, fd, _ = daemon.daemon.local.in_process(request, ())
    if fd is not None:
        os.close(fd)
    assert reply.get("ok") is True or reply.get("code") in CODES, (request, reply)
    assert node is daemon.links.in_process[daemon.daemon.config.node]
