"""Bounded fuzz of a daemon's gRPC services (StoreControl, Admin) with hypothesis: requests with
random field values (past authentication, with fresh tokens) and random bytes as requests. Every
call must end in a reply or a deliberate status — never UNKNOWN/INTERNAL (an unhandled exception)
— and the daemon must keep serving."""
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
from kvstore.access import control_token  # noqa: E402
from kvstore.admin.v1 import admin_pb2, admin_pb2_grpc  # noqa: E402
from kvstore.keys import ModelFingerprint, external_hashes  # noqa: E402
from kvstore.store.v1 import store_pb2, store_pb2_grpc  # noqa: E402

FP = ModelFingerprint("fuzz", "float16", 16, 2, 2, 64, kv_layout="bytes")
FUZZ = settings(max_examples=int(os.environ.get("KVT_FUZZ_EXAMPLES", "200")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
# Drain empties the node for good; everything else may be called with anything.
METHODS = [(store_pb2.DESCRIPTOR.services_by_name["StoreControl"], store_pb2)] + \
          [(admin_pb2.DESCRIPTOR.services_by_name["Admin"], admin_pb2)]
CALLS = [(f"/{svc.full_name}/{m.name}", m) for svc, _ in METHODS for m in svc.methods if m.name != "Drain"]


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
    module = store_pb2 if method.containing_service.name == "StoreControl" else admin_pb2
    return getattr(module, method.input_type.name)


def call(daemon, path: str, payload: bytes, *, streaming: bool) -> grpc.StatusCode:
    d = daemon.daemon
    token = control_token(d.config.secret.encode(), d.config.node, path, "fuzzer")
    with grpc.insecure_channel(d.address) as channel:
        kind = channel.unary_stream if streaming else channel.unary_unary
        fn = kind(path, request_serializer=None, response_deserializer=None)
        try:
            reply = fn(payload, timeout=10, metadata=[("authorization", token)])
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
        token = control_token(d.config.secret.encode(), d.config.node, "/kvstore.store.v1.StoreControl/Stats", "x")
        store_pb2_grpc.StoreControlStub(channel).Stats(store_pb2.StatsRequest(), timeout=5,
                                                        metadata=[("authorization", token)])
