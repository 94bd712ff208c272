"""The Grafana dashboard (deploy/grafana/kvstore.json) charts what the daemons expose, honestly."""
from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

from prometheus_client import generate_latest

from kvstore.daemon.metrics import DaemonMetrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = json.load(open(os.path.join(ROOT, "deploy", "grafana", "kvstore.json")))
EXPRS = {p["title"]: [t["expr"] for t in p["targets"]] for p in DASHBOARD["panels"]}
CHARTED = {m for exprs in EXPRS.values() for e in exprs for m in re.findall(r"kvstore_[a-z_]+", e)}


def exposed() -> set[str]:
    tiers = [SimpleNamespace(name=n, capacity=1 << 20, used=0, sealed={}) for n in ("dram", "nvme")]
    metrics = DaemonMetrics("n", {}, lambda: tiers, lambda: {})
    metrics.latency.labels("put").observe(0.001)  # a labelled histogram shows once a label was used
    text = generate_latest(metrics.registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_replication_and_publishing_are_charted():
    """Kills: a dashboard with no replication or index-publishing panels."""
    wanted = {"kvstore_under_replicated_blocks", "kvstore_replicas_repaired_total", "kvstore_publish_delay_seconds_bucket",
              "kvstore_publish_pending", "kvstore_publish_batches_total", "kvstore_publish_failures_total"}
    assert wanted <= CHARTED, wanted - CHARTED


def test_every_charted_metric_is_exposed_by_a_daemon():
    assert CHARTED <= exposed(), CHARTED - exposed()


def test_no_hit_ratio_the_nodes_cannot_see():
    """Kills: a "hit ratio" of hits / (hits + kvstore_misses): a node never sees a client's misses
    (kvstore_misses counts corrupt copies clients reported), so that ratio is ~100% whatever the
    real hit rate is."""
    for title, exprs in EXPRS.items():
        assert "hit ratio" not in title.lower(), title
        for expr in exprs:
            assert not ("kvstore_misses" in expr and "/" in expr), (title, expr)


def test_panels_do_not_overlap():
    cells = set()
    for panel in DASHBOARD["panels"]:
        g = panel["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, panel["title"]
        cells |= mine
    assert len({p["id"] for p in DASHBOARD["panels"]}) == len(DASHBOARD["panels"])
