"""The Grafana dashboard as deployed (deploy/grafana/kvstore.json, in every overlay as a ConfigMap):
one node or several picked by its node variable, and panels for what the daemons export about the
persistent NVMe tier, its codec and the wire's reads. tests/unit/test_dashboard.py checks that every
charted series exists and that panels do not overlap."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

yaml = pytest.importorskip("yaml", reason="the deploy extra is part of the test install (scripts/install-test-deps.sh)")

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "deploy" / "grafana" / "kvstore.json").read_text())
SELECTOR = re.compile(r"(kvstore_[a-z_]+)(\{[^}]*\})?")


def exported_families() -> set[str]:
    """The kvstore_* series a daemon exports (counters with _total, histograms with _bucket)."""
    from prometheus_client import generate_latest

    from kvstore.daemon.metrics import DaemonMetrics

    tiers = [SimpleNamespace(name=n, capacity=1 << 20, used=0, sealed={}) for n in ("dram", "nvme")]
    metrics = DaemonMetrics("n", {}, lambda: tiers, lambda: {})
    metrics.latency.labels("put").observe(0.001)
    text = generate_latest(metrics.registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def charted(dashboard: dict) -> set[str]:
    return {m.group(1) for p in dashboard["panels"] for t in p["targets"] for m in SELECTOR.finditer(t["expr"])}


def check_node_variable(dashboard: dict) -> None:
    """Kills: no node variable, or one over a label no daemon series carries; a panel whose query
    ignores the node picked (it charts every node whatever the choice)."""
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    node = variables.get("node")
    assert node is not None, "no node variable"
    query = node["query"]["query"] if isinstance(node["query"], dict) else node["query"]
    match = re.fullmatch(r"label_values\((kvstore_[a-z_]+), node\)", query)
    assert match and match.group(1) in exported_families(), f"the node variable's query {query!r}"
    assert node.get("includeAll") and node.get("multi"), "the node variable picks one node only"
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for m in SELECTOR.finditer(target["expr"]):
                assert m.group(2) and 'node=~"$node"' in m.group(2), \
                    f"{panel['title']}: {m.group(1)} is not filtered by the node variable"


def check_panels_cover(dashboard: dict) -> None:
    """Kills: a dashboard without the persistent tier's journal and restores, the codec or the wire
    reads (every family of theirs a daemon exports, charted), or charting a series nobody exports."""
    exported = exported_families()
    families = {n for n in exported if re.match(r"kvstore_(tier_journal_|tier_restore|tier_restored|persisted_|"
                                                r"disk_codec_|wire_read_)", n)}
    assert len(families) >= 14, sorted(families)  # the daemon's own list, not an empty match
    shown = charted(dashboard)
    assert families <= shown, f"not charted: {sorted(families - shown)}"
    assert shown <= exported, f"charted but not exported: {sorted(shown - exported)}"


def test_the_dashboard_has_a_node_variable_every_panel_uses():
    check_node_variable(DASHBOARD)


def test_the_dashboard_charts_the_persistent_tier_the_codec_and_wire_reads():
    check_panels_cover(DASHBOARD)


@pytest.mark.parametrize("mutation", ["no variable", "a panel ignores it", "journal left off", "invented metric"])
def test_the_dashboard_checks_kill_their_mutations(mutation):
    dashboard = json.loads(json.dumps(DASHBOARD))
    check = check_node_variable
    if mutation == "no variable":
        dashboard["templating"]["list"] = [v for v in dashboard["templating"]["list"] if v["name"] != "node"]
    elif mutation == "a panel ignores it":
        target = dashboard["panels"][0]["targets"][0]
        target["expr"] = target["expr"].replace('node=~"$node"', "").replace("{}", "")
    elif mutation == "journal left off":
        check = check_panels_cover
        dashboard["panels"] = [p for p in dashboard["panels"]
                               if not any("tier_journal" in t["expr"] for t in p["targets"])]
    else:
        check = check_panels_cover
        dashboard["panels"][0]["targets"][0]["expr"] = 'sum(rate(kvstore_journal_errors_total{node=~"$node"}[5m]))'
    with pytest.raises(AssertionError):
        check(dashboard)


def test_the_node_label_is_set_where_prometheus_scrapes_the_daemons():
    """Kills: a dashboard filtering on a `node` label that no scrape sets (every panel empty): the
    daemons' ServiceMonitor copies each pod's node name into it."""
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "components" / "servicemonitor" /
                                    "servicemonitor.yaml").read_text()))
    monitor = next(d for d in docs if d["metadata"]["name"] == "kvstore-store")
    for endpoint in monitor["spec"]["endpoints"]:
        assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in \
            (endpoint.get("relabelings") or []), "the daemons' series get no node label"
