"""KV-cache events over ZMQ, byte for byte as vLLM 0.32 publishes them
(vllm/distributed/kv_events.py, `ZmqEventPublisher`).

Wire: a PUB socket sends `(topic, seq, payload)` per batch, `seq` an 8-byte big-endian counter
from 0 (it starts again at 0 when the engine restarts); `payload` is msgpack of an `EventBatch`
`[ts, [event, ...], data_parallel_rank]` (array-like), each event a map tagged by its class name
(`{"type": "BlockStored", ...}`, defaults omitted). An optional ROUTER replay socket answers a
request `(identity, b"", start_seq)` with every buffered batch from `start_seq` on, then
`(identity, b"", b"", -1 as 8 bytes, b"")`. Endpoints bind when they hold a wildcard (`tcp://*:N`)
or are ipc/inproc, and connect otherwise (the subscriber binds then), as vLLM does.

The structs below mirror vLLM's field for field (names, order, options); a test decodes what they
encode with vLLM's own classes."""
from __future__ import annotations

import time
from collections import deque
from typing import Any

import msgspec

from .hashing import external


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events (tagged with the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def to_events(items: list[tuple], block_size: int) -> list[KVCacheEvent]:
    """The prefix cache's changes (`BlockPool.events`) as vLLM's event objects."""
    out: list[KVCacheEvent] = []
    for item in items:
        kind = item[0]
        if kind == "stored":
            _, hashes, parent, tokens, first_extra = item
            extra: list = [None] * len(hashes)
            if first_extra is not None:
                extra[0] = first_extra
            out.append(BlockStored(block_hashes=[external(h) for h in hashes],
                                   parent_block_hash=None if parent is None else external(parent),
                                   token_ids=tokens, block_size=block_size, lora_id=None, medium=MEDIUM_GPU,
                                   lora_name=None, extra_keys=extra, group_idx=0))
        elif kind == "removed":
            out.append(BlockRemoved(block_hashes=[external(h) for h in item[1]], medium=MEDIUM_GPU, group_idx=0))
        else:
            out.append(AllBlocksCleared())
    return out


def is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _bind(socket, endpoint: str) -> str:
    """Bind `endpoint`; port 0 takes a free port the system picks (no window for another process
    to take it between choosing and binding). Returns the endpoint bound, port filled in."""
    import zmq

    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        socket.bind(endpoint[:-1] + "*")
        port = socket.getsockopt(zmq.LAST_ENDPOINT).decode().rpartition(":")[2]
        return endpoint[:-1] + port
    socket.bind(endpoint)
    return endpoint


class Publisher:
    """One engine's PUB socket (and replay ROUTER); `publish()` never blocks (ZMQ drops past HWM)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, data_parallel_rank: int = 0) -> None:
        import zmq
        import zmq.asyncio

        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.topic = topic.encode()
        self.rank = data_parallel_rank
        # PUB sends never wait (NOBLOCK), so a plain socket; the replay socket is read on the event loop.
        self.pub = zmq.Context.instance().socket(zmq.PUB)
        self.ctx = zmq.asyncio.Context.instance()
        self.pub.set_hwm(hwm)
        if is_bind_endpoint(endpoint):
            self.endpoint = _bind(self.pub, endpoint)
        else:
            self.pub.connect(endpoint)
        self.replay = None
        if replay_endpoint:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay_endpoint = _bind(self.replay, replay_endpoint)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.encoder = msgspec.msgpack.Encoder()
        self.sent = 0

    def publish(self, events: list[KVCacheEvent], send: bool = True) -> None:
        """`send=False`: the batch is lost on the wire (a fault), yet numbered and kept for replay."""
        if not events:
            return
        import zmq

        payload = self.encoder.encode(EventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank))
        seq = self.seq
        self.seq += 1
        try:
            if send:
                self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # past the high-water mark: dropped, as a PUB socket does
        self.buffer.append((seq, payload))
        self.sent += len(events)

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled."""
        if self.replay is None:
            return
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            await self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
