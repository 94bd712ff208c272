"""Client.close() against a real daemon while its background hit report (Touch) is in flight:
grpc segfaults on a call racing its channel's close, so close must wait for the report."""
from __future__ import annotations

import threading
import time
import uuid

import numpy as np

from kvstore import Client
from kvstore.keys import ModelFingerprint, external_hashes

FP = ModelFingerprint("tiny-llama", "float32", 16, 2, 2, 64)
SECRET = "close-secret"


def test_close_waits_for_a_hit_report_in_flight(etcd_server, spawn_daemon):
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("close-node", etcd_server.url, cluster, secret=SECRET)
    client = Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET)
    assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
    h = external_hashes([11], FP)[0]
    data = np.arange(4096, dtype=np.uint8)
    assert client.put(h, data) == 1
    assert client.mirror.wait_until(lambda m: m.contains(FP, h), 10)

    node = client._node("close-node")  # (a same-host put needs no engine peer: it may not exist yet)
    touching, overlaps = threading.Event(), []
    real_touch, real_close = node.stub.Touch, node.channel.close

    def slow_touch(*args, **kwargs):
        touching.set()
        time.sleep(0.5)  # the timer's report is mid-call when close() runs
        try:
            return real_touch(*args, **kwargs)
        finally:
            touching.clear()

    def close_channel():
        overlaps.append(touching.is_set())
        if not overlaps[-1]:  # (closing under the call would crash this test instead of failing it)
            real_close()

    node.stub.Touch, node.channel.close = slow_touch, close_channel
    out = np.zeros_like(data)
    assert client.get(h, out) and np.array_equal(out, data)  # queues a hit report
    assert touching.wait(5)
    client.close()
    assert overlaps == [False]  # the channel closed only after the report finished
    real_close()


def test_a_node_marked_down_under_a_hit_report_keeps_its_channel_until_no_call_can_be_on_it(
        etcd_server, spawn_daemon):
    """A get that fails on a node while the timer's report to it is mid-call replaces the node's
    connection: its channel must not close under that call."""
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("down-node", etcd_server.url, cluster, secret=SECRET)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        h = external_hashes([12], FP)[0]
        data = np.arange(4096, dtype=np.uint8)
        assert client.put(h, data) == 1
        node = client._node("down-node")
        touching, overlaps = threading.Event(), []
        real_touch, real_close = node.stub.Touch, node.channel.close

        def slow_touch(*args, **kwargs):
            touching.set()
            time.sleep(2.0)  # still mid-call while the node is marked down and reconnected
            try:
                return real_touch(*args, **kwargs)
            finally:
                touching.clear()

        def close_channel():
            overlaps.append(touching.is_set())
            if not overlaps[-1]:
                real_close()

        node.stub.Touch, node.channel.close = slow_touch, close_channel
        out = np.zeros_like(data)
        assert client.get(h, out)  # queues a hit report
        assert touching.wait(5)
        client._mark_down("down-node", ConnectionError("a failed read, as a get would meet it"))
        assert client._node("down-node") is not node  # a new connection for the next call
        assert touching.is_set() and overlaps == []
    assert overlaps == [False]  # closed with the client, after the report
