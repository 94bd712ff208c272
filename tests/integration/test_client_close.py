"""Client.close() against a real daemon while its background hit report (Touch) is in flight:
grpc segfaults on a call racing its channel's close, so close must wait for the report."""
from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

from kvstore import Client
from kvstore.keys import ModelFingerprint, external_hashes

FP = ModelFingerprint("tiny-llama", "float32", 16, 2, 2, 64, kv_layout="bytes")
SECRET = "close-secret-0123456789"


def test_close_waits_for_a_hit_report_in_flight(etcd_server, spawn_daemon):
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("close-node", etcd_server.url, cluster, secret=SECRET)
    client = Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET)
    assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
    h = external_hashes([11], FP)[0]
    data = np.arange(4096, dtype=np.uint8)
    assert client.put(h, data) == 1
    assert client.mirror.wait_until(lambda m: m.contains(FP, h), 10)

    node = client.links.node("close-node")  # (a same-host put needs no engine peer: it may not exist yet)
    touching, overlaps = threading.Event(), []
    real_touch, real_close = node.stub.Touch, node.guard.raw.close

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

    node.stub.Touch, node.guard.raw.close = slow_touch, close_channel
    out = np.zeros_like(data)
    assert client.get(h, out) and np.array_equal(out, data)  # queues a hit report
    assert touching.wait(5)
    client.close()
    assert overlaps == [False]  # the channel closed only after the report finished
    real_close()


def test_a_call_on_a_connection_replaced_after_a_failure_is_refused_not_a_crash(etcd_server, spawn_daemon):
    """A put that took a node's connection before another thread marked the node down calls on
    the old channel later: a typed error (the put moves on), where grpc crashed the process."""
    from kvstore.errors import ConnectionReplaced, NoStoreNodes
    from kvstore.store.v1 import store_pb2

    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("down-node", etcd_server.url, cluster, secret=SECRET)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        old = client.links.node("down-node")
        client.links.mark_down("down-node", ConnectionError("a failed read, as a get would meet it"))
        with pytest.raises(ConnectionReplaced):
            old.stub.Lookup(store_pb2.LookupRequest(fingerprint=FP.digest, hashes=[]), timeout=5)
        client.links.placement._down.clear()  # (not waiting out the 2 s it is left alone)
        h = external_hashes([12], FP)[0]
        data = np.arange(4096, dtype=np.uint8)
        assert client.put(h, data) == 1
        assert client.links.node("down-node") is not old
        out = np.zeros_like(data)
        assert client.get(h, out) and np.array_equal(out, data)
        # A put refused on a stale connection leaves the new one (another thread's) alone.
        fresh, real_put_on = client.links.node("down-node"), client.puts.put_round

        def refused(*args, **kwargs):
            raise ConnectionReplaced("the connection to down-node was replaced; call again")

        client.puts.put_round = refused
        with pytest.raises(NoStoreNodes):
            client.put(external_hashes([13], FP)[0], data)
        client.puts.put_round = real_put_on
        assert client.links.nodes.get("down-node") is fresh and client.links.placement.usable("down-node")
        # A remove that met a connection replaced under it calls once more on the new one.
        stale, real_node, asked = client.links.node("down-node"), client.links.node, []
        client.links.mark_down("down-node", ConnectionError("another thread's failed read"))

        def stale_first(name):
            asked.append(name)
            return stale if len(asked) == 1 else real_node(name)

        client.links.node = stale_first
        assert client.remove([h]) == 1 and len(asked) == 2
        client.links.node = real_node
