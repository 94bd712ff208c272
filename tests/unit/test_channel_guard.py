"""ChannelGuard against a real gRPC server in this process: a retired channel closes only after the
call on it ends, and a call started after retirement is refused with a typed error."""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from kvstore.access import ControlAuth
from kvstore.client.channel_guard import ChannelGuard
from kvstore.errors import ConnectionReplaced

METHOD = "/test.Slow/Echo"


@pytest.fixture
def slow_server():
    """A server whose one method waits for `release` before echoing."""
    release, entered = threading.Event(), threading.Event()

    def echo(request: bytes, context) -> bytes:
        entered.set()
        release.wait(10)
        return request

    server = grpc.server(futures.ThreadPoolExecutor(2))
    handler = grpc.method_handlers_generic_handler("test.Slow", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo, request_deserializer=bytes, response_serializer=bytes)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", release, entered
    release.set()
    server.stop(0)


def guarded(address: str) -> tuple[ChannelGuard, list[bool], object]:
    """A guard whose channel close is recorded (whether a call was on it then) before it happens."""
    guard = ChannelGuard(grpc.insecure_channel(address), "slow")
    closes, real_close = [], guard.raw.close
    channel = grpc.intercept_channel(guard.channel, ControlAuth(b"secret", "slow", "me"))  # as the client stacks them
    call = channel.unary_unary(METHOD, request_serializer=bytes, response_deserializer=bytes)

    def close():
        closes.append(guard._calls)
        if guard._calls == 0:  # (under a call it would crash this test instead of failing it)
            real_close()

    guard.raw.close = close
    return guard, closes, call


def test_a_retired_channel_closes_when_its_last_call_ends(slow_server):
    address, release, entered = slow_server
    guard, closes, call = guarded(address)
    replies = []
    caller = threading.Thread(target=lambda: replies.append(call(b"hi", timeout=10)))
    caller.start()
    assert entered.wait(10)  # the call is on the channel
    guard.retire()
    assert closes == []
    release.set()
    caller.join(10)
    assert replies == [b"hi"] and closes == [0]


def test_a_call_after_retirement_is_refused_and_an_idle_channel_closes_at_once(slow_server):
    address, release, _ = slow_server
    release.set()
    guard, closes, call = guarded(address)
    assert call(b"x", timeout=10) == b"x"
    guard.retire()
    guard.retire()
    assert closes == [0]
    with pytest.raises(ConnectionReplaced):
        call(b"y", timeout=10)


def test_a_failed_call_still_counts_as_ended(slow_server):
    address, release, _ = slow_server
    guard, closes, call = guarded(address)
    with pytest.raises(grpc.RpcError):
        call(b"z", timeout=0.2)  # the server holds it past the deadline
    guard.retire()
    assert closes == [0]
