"""Client.close() against a real daemon while its background hit report (a `touch` on the control
wire) is in flight: close must wait for the report, not close the connection under it."""
from __future__ import annotations

import threading
import time
import uuid

import numpy as np

from kvstore import Client
from kvstore.keys import ModelFingerprint, external_hashes

FP = ModelFingerprint("tiny-llama", "float32", 16, 2, 2, 64, kv_layout="bytes")
SECRET = "close-secret-0123456789"


def test_close_waits_for_a_hit_report_in_flight(etcd_server, spawn_daemon):
    """Kills a close() that tears the connections down before the report thread has finished."""
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("close-node", etcd_server.url, cluster, secret=SECRET)
    client = Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET)
    assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
    h = external_hashes([11], FP)[0]
    data = np.arange(4096, dtype=np.uint8)
    assert client.put(h, data) == 1
    assert client.mirror.wait_until(lambda m: m.contains(FP, h), 10)

    wire = client.links.control("close-node")
    touching, overlaps, reported = threading.Event(), [], []
    real_call, real_close = wire.call, wire.close

    def slow_call(message, *args, **kwargs):
        if message.get("op") != "touch":
            return real_call(message, *args, **kwargs)
        touching.set()
        time.sleep(0.5)  # the timer's report is mid-call when close() runs
        try:
            reported.append(real_call(message, *args, **kwargs))
            return reported[-1]
        finally:
            touching.clear()

    def close_wire():
        overlaps.append(touching.is_set())
        real_close()

    wire.call, wire.close = slow_call, close_wire
    out = np.zeros_like(data)
    assert client.get(h, out) and np.array_equal(out, data)  # queues a hit report
    assert touching.wait(5)
    client.close()
    assert overlaps and not overlaps[0] and reported  # the wire closed only after the report went out
