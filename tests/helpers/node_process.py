"""A store node in its own process: registers under a lease, publishes blocks, then idles until
killed. Prints one JSON line: {"revision": R, "hashes": [...hex]}."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys

from kvstore.daemon.session import NodeSession
from kvstore.index.records import BlockRecord, Layout, NodeRecord
from kvstore.keys import ModelFingerprint, chain_hashes
from kvstore.metadata import open_metadata


def node_fingerprint() -> ModelFingerprint:
    return ModelFingerprint("tiny-llama", "float32", 16, 2, 2, 64)


async def main(args: argparse.Namespace) -> None:
    metadata = open_metadata(args.url)
    session = NodeSession(metadata, Layout(args.cluster), NodeRecord(args.node, "127.0.0.1:0", {"dram": 1 << 30}),
                          segment='{"engine": "test"}', ttl=args.ttl)
    await session.start()
    fp = node_fingerprint()
    hashes = chain_hashes(fp, [args.seed] * 16 * args.blocks)
    revision = await session.publish(fp.digest, [(h, BlockRecord("dram", 1, i * 4096, 4096, i.to_bytes(32, "little")))
                                                 for i, h in enumerate(hashes)])
    print(json.dumps({"revision": revision, "hashes": [h.hex() for h in hashes]}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await session.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--cluster", default="test")
    parser.add_argument("--node", required=True)
    parser.add_argument("--ttl", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    asyncio.run(main(parser.parse_args()))
