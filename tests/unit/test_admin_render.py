"""`kvstore admin` output: --json numbers as numbers, tables that fit an 80-column terminal (what
rich gives a pipe) without wrapping a row onto a second line."""
from __future__ import annotations

import io
import json

from rich.console import Console

from kvstore.admin import render
from kvstore.admin.v1 import admin_pb2


def test_json_gives_64_bit_integers_as_numbers():
    """Kills: protobuf's JSON mapping as is (uint64 fields as strings)."""
    status = admin_pb2.NodeStatus(name="node-a", tiers=[admin_pb2.TierStatus(
        name="dram", capacity_bytes=64 << 30, used_bytes=12345678901, blocks=3, hits=2 ** 60, high_watermark=0.9)],
        counters={"puts": 5.0}, fingerprints=2)
    data = json.loads(json.dumps(render.message_dict(status)))
    tier = data["tiers"][0]
    assert tier["capacity_bytes"] == 64 << 30 and tier["used_bytes"] == 12345678901 and tier["hits"] == 2 ** 60
    assert tier["evictions"] == 0 and data["fingerprints"] == 2 and data["counters"] == {"puts": 5.0}
    block = render.message_dict(admin_pb2.BlockInfo(size=1 << 20), defaults=False)
    assert block["size"] == 1 << 20


def test_tables_fit_80_columns_one_line_a_row():
    """A status table of long names, endpoints and sizes, as a pipe renders it.
    Kills: rich's default table (wraps cells onto extra lines, cuts figures), a table that drops
    columns to fit."""
    table = render.table("cluster production-eu-west: 3 node(s), 0 under-replicated block(s)",
                         ["node", "endpoint", "DRAM", "NVMe", "blocks", "hits", "policy", "state"],
                         right=("DRAM", "NVMe", "blocks", "hits"))
    for i in range(3):
        table.add_row(f"kvstore-node-{i}-us-east-1a", f"10.128.17.{100 + i}:50051",
                      f"{render.size(61 << 30)}/{render.size(64 << 30)}",
                      f"{render.size(3 << 40)}/{render.size(7 << 40)}", "12345678", "987654321", "lru",
                      "unreachable (deadline exceeded after 5 s)" if i == 2 else "serving")
    out = io.StringIO()
    Console(file=out, width=80, force_terminal=False, color_system=None).print(table)
    lines = out.getvalue().rstrip("\n").split("\n")
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    rows = [line for line in lines if line.startswith("kvstore-n")]
    assert len(rows) == 4 - 1 and len(lines) == 2 + 3, "\n".join(lines)  # title, header, one line a row
    for row in rows:  # every column there, the figures whole; text gives way
        assert all(f in row for f in ("61G/64G", "3T/7T", "12345678", "987654321", "lru")), row


def test_sizes_are_short():
    assert [render.size(n) for n in (0, 512, 1536, 61 << 30, 3 << 40, 1.5 * (1 << 30))] == \
        ["0", "512", "1.5K", "61G", "3T", "1.5G"]
