"""vLLM KV-cache events (ZMQ PUB, msgpack): what an engine's own prefix cache holds, exactly.

Start the engine with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": ENDPOINT}'` and give the gateway `kv_events: {ENGINE_URL: ENDPOINT}`. vLLM binds an
endpoint with a wildcard (`tcp://*:5557`; the gateway then connects to the engine's host) and
connects to any other (`tcp://127.0.0.1:5557`; the gateway binds it: loopback only, one per engine).
vLLM's block hashes are not ours (random seed per process), so each stored block is re-keyed by
our chain from its parent and token ids."""
from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import urlsplit

from kvstore.integrations.vllm.request_keys import encode_extra_keys
from kvstore.keys import ModelFingerprint, chain_hashes

from .prefix import PrefixTracker

log = logging.getLogger("conductor.gateway")


class KVEventFollower:
    def __init__(self, engine_url: str, endpoint: str, tracker: PrefixTracker, fingerprint: ModelFingerprint) -> None:
        self.engine, self.endpoint, self.tracker, self.fingerprint = engine_url, endpoint, tracker, fingerprint
        self.ours: dict[Any, bytes] = {}  # vLLM block hash -> our chain hash
        self.events = 0

    def apply(self, event: dict) -> None:
        kind = event.get("type")
        if event.get("medium") == "STORAGE":
            return  # the kvstore connector's own events: the pool, which the index mirror already shows
        if kind == "BlockStored":
            size = int(event.get("block_size") or self.fingerprint.block_size)
            parent = event.get("parent_block_hash")
            if size != self.fingerprint.block_size or event.get("lora_id"):
                return  # not a chain the gateway's hashes can name
            if parent is not None and parent not in self.ours:
                return  # its prefix was never seen (events before we subscribed)
            extras = [encode_extra_keys(k) if k else None for k in event.get("extra_keys") or ()]
            ours = chain_hashes(self.fingerprint, event["token_ids"], parent=self.ours.get(parent), extras=extras or None)
            for theirs, mine in zip(event["block_hashes"], ours):
                self.ours[theirs] = mine
            self.tracker.add(self.engine, ours)
        elif kind == "BlockRemoved":
            gone = [self.ours.pop(h) for h in event.get("block_hashes", ()) if h in self.ours]
            self.tracker.remove(self.engine, gone)
        elif kind == "AllBlocksCleared":
            self.ours.clear()
            self.tracker.clear(self.engine)

    def apply_batch(self, payload: bytes) -> None:
        import msgspec

        batch = msgspec.msgpack.decode(payload)  # [ts, [event, ...], dp_rank]
        for event in batch[1]:
            if isinstance(event, dict):
                self.apply(event)
                self.events += 1

    async def run(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        if "*" in self.endpoint:  # vLLM binds wildcard endpoints
            sock.connect(self.endpoint.replace("*", urlsplit(self.engine).hostname or "127.0.0.1"))
        else:  # and connects to the rest, so one side must bind: here
            sock.bind(self.endpoint)
        try:
            while True:
                parts = await sock.recv_multipart()
                try:
                    self.apply_batch(parts[-1])
                except Exception as exc:  # one bad message must not stop the follower
                    log.warning("KV event from %s not understood: %s", self.endpoint, exc)
        except asyncio.CancelledError:
            raise
        finally:
            sock.close(linger=0)
