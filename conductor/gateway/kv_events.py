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

from kvstore.keys import ModelFingerprint, chain_hashes, encode_extra_keys

from .prefix import PrefixTracker

log = logging.getLogger("conductor.gateway")


class KVEventFollower:
    """Keeps the tracker's view of one engine exact: every batch applied in sequence order. A gap
    in the numbers (batches lost on the wire) is filled from the engine's replay socket when it has
    one (else the view is dropped: no credit is better than wrong credit); numbers that start again
    lower mean the engine restarted empty, and so does its view here."""

    def __init__(self, engine_url: str, endpoint: str, tracker: PrefixTracker, fingerprint: ModelFingerprint,
                 replay: str | None = None) -> None:
        self.engine, self.endpoint, self.tracker, self.fingerprint = engine_url, endpoint, tracker, fingerprint
        self.replay = replay
        self.ours: dict[Any, bytes] = {}  # vLLM block hash -> our chain hash
        self.events = 0
        self.next_seq: int | None = None
        self.resets = 0  # views dropped: the engine restarted, or a gap replay could not fill
        self.replayed = 0  # batches taken from the replay socket

    def reset(self) -> None:
        """Forget what the engine held (it restarted, or its events were lost for good)."""
        self.ours.clear()
        self.tracker.clear(self.engine)
        self.resets += 1

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

    async def receive(self, parts: list[bytes]) -> None:
        """One message off the SUB socket: `(topic, seq, payload)` as vLLM sends it, in order."""
        seq = int.from_bytes(parts[-2], "big", signed=True) if len(parts) >= 3 else None
        if seq is not None and self.next_seq is not None:
            if seq < self.next_seq:
                log.info("KV events of %s start again at %d (expected %d): the engine restarted", self.engine, seq,
                         self.next_seq)
                self.reset()
            elif seq > self.next_seq and not await self.fill(self.next_seq, seq):
                log.warning("KV events %d-%d of %s were lost and cannot be replayed: its view is dropped",
                            self.next_seq, seq - 1, self.engine)
                self.reset()
        try:
            self.apply_batch(parts[-1])
        except Exception as exc:  # one bad message must not stop the follower
            log.warning("KV event from %s not understood: %s", self.endpoint, exc)
        if seq is not None:
            self.next_seq = seq + 1

    async def fill(self, start: int, end: int, timeout: float = 1.0) -> bool:
        """Apply batches `start`..`end - 1` from the engine's replay socket; False if it has none or
        they do not all come within `timeout` seconds."""
        if not self.replay:
            return False
        import zmq
        import zmq.asyncio

        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.connect(self.replay.replace("*", urlsplit(self.engine).hostname or "127.0.0.1"))
        got: dict[int, bytes] = {}
        try:
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                left = deadline - loop.time()
                if left <= 0 or not await sock.poll(left * 1000):
                    return False
                frames = await sock.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq < 0:
                    break
                if start <= seq < end:
                    got[seq] = frames[-1]
        finally:
            sock.close(linger=0)
        if len(got) != end - start:
            return False
        for seq in range(start, end):
            self.apply_batch(got[seq])
        self.replayed += end - start
        return True

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
                await self.receive(await sock.recv_multipart())
        except asyncio.CancelledError:
            raise
        finally:
            sock.close(linger=0)
