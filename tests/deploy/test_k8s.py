"""deploy/k8s, offline: every overlay renders (deploy/k8s/kustomize.py, and the same objects as
`kubectl kustomize` wherever kubectl is installed), every object passes `kubernetes-validate
--strict` for Kubernetes 1.32, and the rendered objects keep the invariants a broken deploy would
violate: the pieces agree with each other (ports, selectors, configs, the store, the model), and
the hardening holds (etcd identities, network policies, Pod Security, no API tokens, images pinned
by digest). Each check_* function's docstring names the broken variant it kills;
test_each_check_kills_its_mutation breaks a copy of the rendered objects that way and sees the check
fail, and test_a_broken_source_file_is_caught does it once through a manifest's source file.

The Secrets' files are made by deploy/k8s/gen-secrets.sh in a copy of deploy/ (as a user runs it);
gpu-external-etcd's etcd certificates are placeholders. The rendered daemon and the etcd auth Job
run for real against an etcd of the test's own (test_the_rendered_pods_on_a_real_etcd). Images are
not built here (no container engine): test_dockerfile checks what can be checked without one.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="the deploy extra is part of the test install (scripts/install-test-deps.sh)")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
ETCD_CERTIFICATES = ("etcd-ca.crt", "etcd-store.crt", "etcd-store.key", "etcd-reader.crt", "etcd-reader.key")
STORE_USER, READER_USER = "kvstore", "kvstore-reader"  # etcd's users (deploy/k8s/components/etcd/etcd_auth.py)
KUBERNETES_VERSION = "1.32.0"  # the API version every object is validated against
DAEMON_OVERHEAD = 1 << 30  # a daemon's own memory beside its DRAM tier (Python, gRPC, buffers)
ENGINE_OVERHEAD = 1 << 30  # a CPU engine's own memory beside its KV cache (weights, activations)
FIELD_VALUES = {"spec.nodeName": "node-a", "status.podIP": "10.1.2.3", "status.hostIP": "10.1.0.1",
                "metadata.name": "pod-0"}
SERVICE_MONITOR_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object"},
        "spec": {"type": "object", "additionalProperties": False, "required": ["selector", "endpoints"], "properties": {
            "selector": {"type": "object"},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["port"], "properties": {
                    "port": {"type": "string"}, "path": {"type": "string"}, "interval": {"type": "string"},
                    "relabelings": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False, "required": ["sourceLabels", "targetLabel"],
                        "properties": {"sourceLabels": {"type": "array", "items": {"type": "string"}},
                                       "targetLabel": {"type": "string"}}}},
                    "authorization": {"type": "object", "additionalProperties": False, "properties": {
                        "type": {"type": "string"},
                        "credentials": {"type": "object", "additionalProperties": False,
                                        "required": ["name", "key"],
                                        "properties": {"name": {"type": "string"}, "key": {"type": "string"}}}}}}}}}}}}


def _renderer():
    spec = importlib.util.spec_from_file_location("deploy_kustomize", K8S / "kustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kustomize = _renderer()


# --- the tree, rendered ---------------------------------------------------------------------------

def prepare(tmp: Path) -> Path:
    """A copy of deploy/ with each overlay's Secrets' files made as a user makes them."""
    tree = tmp / "deploy"
    shutil.copytree(ROOT / "deploy", tree, ignore=shutil.ignore_patterns("secrets", "__pycache__"))
    for overlay in OVERLAYS:
        make_secrets(tree / "k8s" / "overlays" / overlay)
    return tree


def make_secrets(overlay: Path, script: Path | None = None) -> None:
    """gen-secrets.sh's files, and placeholders for an external etcd's certificates (the user's)."""
    script = script or overlay.parents[1] / "gen-secrets.sh"
    subprocess.run(["sh", str(script), str(overlay)], check=True, capture_output=True)
    text = (overlay / "kustomization.yaml").read_text()
    for name in ETCD_CERTIFICATES:
        if f"secrets/{name}" in text:
            (overlay / "secrets" / name).write_text(f"placeholder-{name}-0123456789abcdef\n")


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return prepare(tmp_path_factory.mktemp("k8s"))


@pytest.fixture(scope="module")
def rendered(tree) -> dict[str, list[dict]]:
    return {overlay: kustomize.build(str(tree / "k8s" / "overlays" / overlay)) for overlay in OVERLAYS}


def secret_values(tree: Path, overlay: str) -> set[str]:
    """The values an overlay's Secrets carry (from the files it generates them from, and those of the
    overlays it builds on)."""
    values = set()
    folder = tree / "k8s" / "overlays"
    for path in folder.glob("*/secrets/*"):
        for line in path.read_text().splitlines():
            if len(line.strip()) >= 16:
                values.add(line.strip())
    return values


# --- helpers over objects -------------------------------------------------------------------------

WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
POD_KINDS = WORKLOADS + ("Job",)  # everything that runs pods


def pods(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in POD_KINDS]


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict], kind: str, name: str) -> dict | None:
    return next((o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name), None)


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"].get("labels") or {}


def containers(workload: dict, init: bool = True) -> list[dict]:
    spec = pod_spec(workload)
    return (list(spec.get("initContainers") or []) if init else []) + list(spec["containers"])


def component(workload: dict) -> str:
    return pod_labels(workload).get("app.kubernetes.io/component", "")


def matches(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels/matchExpressions, or a Service's plain map) against labels."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        return all(labels.get(k) == v for k, v in selector.items())
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        value, op = labels.get(expr["key"]), expr["operator"]
        if op == "In" and value not in expr["values"]:
            return False
        if op == "NotIn" and value in expr["values"]:
            return False
        if op == "Exists" and expr["key"] not in labels:
            return False
        if op == "DoesNotExist" and expr["key"] in labels:
            return False
    return True


def config_data(objects: list[dict], name: str) -> dict[str, str]:
    cm = named(objects, "ConfigMap", name)
    assert cm is not None, f"ConfigMap {name} is not rendered"
    return cm.get("data") or {}


def secret_data(objects: list[dict], name: str) -> dict[str, str]:
    secret = named(objects, "Secret", name)
    assert secret is not None, f"Secret {name} is not rendered"
    return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


def env_of(objects: list[dict], workload: dict, container: dict) -> dict[str, str]:
    """The container's environment as the kubelet makes it (fields from FIELD_VALUES; $(VAR) expanded)."""
    env: dict[str, str] = {}
    namespace = workload["metadata"].get("namespace", "default")
    for item in container.get("env") or []:
        source = item.get("valueFrom")
        if source is None:
            env[item["name"]] = expand(item.get("value", ""), env)
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            env[item["name"]] = namespace if path == "metadata.namespace" else FIELD_VALUES[path]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[item["name"]] = config_data(objects, ref["name"])[ref["key"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            if named(objects, "Secret", ref["name"]) is not None:
                env[item["name"]] = secret_data(objects, ref["name"])[ref["key"]]
    return env


def expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def argv(objects: list[dict], workload: dict, container: dict) -> list[str]:
    env = env_of(objects, workload, container)
    return [expand(str(a), env) for a in list(container.get("command") or []) + list(container.get("args") or [])]


def mounted_files(objects: list[dict], workload: dict, container: dict, into: Path) -> dict[str, Path]:
    """Container mount path -> a local folder holding the ConfigMap or Secret volume's files."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes") or []}
    out = {}
    for mount in container.get("volumeMounts") or []:
        volume = volumes.get(mount["name"]) or {}
        if "configMap" in volume:
            data = config_data(objects, volume["configMap"]["name"])
        elif "secret" in volume:
            data = secret_data(objects, volume["secret"]["secretName"])
        else:
            continue
        folder = into / re.sub(r"[^A-Za-z0-9]+", "_", mount["mountPath"])
        folder.mkdir(parents=True, exist_ok=True)
        for key, value in data.items():
            (folder / key).write_text(value)
        out[mount["mountPath"]] = folder
    return out


def localize(args: list[str], mounts: dict[str, Path]) -> list[str]:
    """`args` with paths under a mounted ConfigMap/Secret pointing at their local copies."""
    out = []
    for arg in args:
        for mount, folder in mounts.items():
            for prefix in (mount + "/", "=" + mount + "/"):
                if prefix in arg:
                    arg = arg.replace(mount + "/", str(folder) + "/")
        out.append(arg)
    return out


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """The container's KVSTORE_* variables in os.environ (the parsers read some, e.g. the etcd
    password), the rest of the test's environment without any of its own."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("KVSTORE_")}
    for key in saved:
        del os.environ[key]
    os.environ.update({k: v for k, v in env.items() if k.startswith("KVSTORE_")})
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("KVSTORE_")]:
            del os.environ[key]
        os.environ.update(saved)


def parse_or_fail(parse, args: list[str], what: str, env: dict[str, str] | None = None):
    """parse(args) in the container's environment, an argparse exit turned into an AssertionError
    carrying its message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), environment(env or {}):
            return parse(args)
    except SystemExit as exc:
        raise AssertionError(f"{what}: {' '.join(args)}: {err.getvalue().strip() or exc}") from None


def quantity(text: str | int) -> int:
    """A Kubernetes quantity in bytes (Ki, Mi, Gi, Ti; k, M, G, T)."""
    text = str(text)
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def store(objects: list[dict]) -> tuple[dict, dict]:
    daemonset = named(objects, "DaemonSet", "kvstore-store")
    assert daemonset is not None, "no kvstore-store DaemonSet"
    return daemonset, next(c for c in pod_spec(daemonset)["containers"] if c["name"] == "store")


def engines(objects: list[dict]) -> list[dict]:
    return [w for w in objects if w["kind"] in WORKLOADS and component(w) in ("prefill", "decode")]


def engine_container(workload: dict) -> dict:
    return next(c for c in pod_spec(workload)["containers"] if c["name"] == "vllm")


def engine_config(objects: list[dict], workload: dict) -> dict:
    """The engine's vLLM --config YAML, as a dict."""
    args = engine_container(workload)["args"]
    path = args[args.index("--config") + 1]
    mounts = {m["mountPath"]: m["name"] for m in engine_container(workload)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    folder, name = path.rsplit("/", 1)
    assert folder in mounts, f"{workload['metadata']['name']}: --config {path} is on no mounted volume"
    volume = volumes[mounts[folder]]
    assert "configMap" in volume, f"{workload['metadata']['name']}: --config {path} is not from a ConfigMap"
    data = config_data(objects, volume["configMap"]["name"])
    assert name in data, f"{workload['metadata']['name']}: ConfigMap {volume['configMap']['name']} has no {name}"
    return yaml.safe_load(data[name])


def gateway(objects: list[dict]) -> tuple[dict, dict]:
    deployment = named(objects, "Deployment", "conductor-gateway")
    assert deployment is not None, "no conductor-gateway Deployment"
    return deployment, next(c for c in pod_spec(deployment)["containers"] if c["name"] == "gateway")


def gateway_config(objects: list[dict]) -> dict:
    return json.loads(config_data(objects, "conductor-gateway-config")["gateway.json"])


def container_port(container: dict, port) -> int | None:
    """The number of `port` (a number or a port name) among the container's ports, else None."""
    for p in container.get("ports") or []:
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    return None


# --- the invariants -------------------------------------------------------------------------------

def check_selectors(objects: list[dict]) -> None:
    """Kills: a workload whose selector does not match its own pod labels (rejected by the API, or a
    controller that adopts nothing); a Service, NetworkPolicy, PodDisruptionBudget or ServiceMonitor
    that selects no pod (a Service with no endpoints: the gateway cannot reach its engines)."""
    workloads = [w for w in objects if w["kind"] in WORKLOADS]
    for w in workloads:
        assert matches(w["spec"]["selector"], pod_labels(w)), \
            f"{w['kind']} {w['metadata']['name']}: selector {w['spec']['selector']} misses its pods' labels"
    for svc in by_kind(objects, "Service"):
        assert any(matches(svc["spec"]["selector"], pod_labels(w)) for w in workloads), \
            f"Service {svc['metadata']['name']} selects no pod"
    for kind, field in (("NetworkPolicy", "podSelector"), ("PodDisruptionBudget", "selector")):
        for obj in by_kind(objects, kind):
            assert any(matches(obj["spec"][field], pod_labels(w)) for w in pods(objects)), \
                f"{kind} {obj['metadata']['name']} selects no pod"
    for monitor in by_kind(objects, "ServiceMonitor"):
        assert any(matches(monitor["spec"]["selector"], s["metadata"].get("labels") or {})
                   for s in by_kind(objects, "Service")), f"ServiceMonitor {monitor['metadata']['name']} selects no Service"


def check_references(objects: list[dict]) -> None:
    """Kills: a pod that names a Secret or ConfigMap (or a key of one) that the overlay does not
    render (stuck in CreateContainerConfigError), a StatefulSet whose serviceName is no headless
    Service (its pods get no DNS names), a ServiceMonitor whose credentials Secret is missing."""
    def exists(kind: str, name: str, key: str | None, optional: bool, where: str) -> None:
        obj = named(objects, kind, name)
        if obj is None:
            assert optional, f"{where}: {kind} {name} is not rendered"
            return
        if key is not None:
            assert key in (obj.get("data") or {}) or optional, f"{where}: {kind} {name} has no key {key!r}"

    for w in pods(objects):
        where = f"{w['kind']} {w['metadata']['name']}"
        for volume in pod_spec(w).get("volumes") or []:
            if "configMap" in volume:
                ref = volume["configMap"]
                exists("ConfigMap", ref["name"], None, ref.get("optional", False), where)
                for item in ref.get("items") or []:
                    exists("ConfigMap", ref["name"], item["key"], ref.get("optional", False), where)
            if "secret" in volume:
                ref = volume["secret"]
                exists("Secret", ref["secretName"], None, ref.get("optional", False), where)
                for item in ref.get("items") or []:
                    exists("Secret", ref["secretName"], item["key"], ref.get("optional", False), where)
        for c in containers(w):
            for item in c.get("env") or []:
                source = item.get("valueFrom") or {}
                for field, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                    if field in source:
                        ref = source[field]
                        exists(kind, ref["name"], ref["key"], ref.get("optional", False), where)
            for item in c.get("envFrom") or []:
                for field, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                    if field in item:
                        exists(kind, item[field]["name"], None, item[field].get("optional", False), where)
            mounts = {m["name"] for m in c.get("volumeMounts") or []}
            volumes = {v["name"] for v in pod_spec(w).get("volumes") or []} | \
                {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates") or []}
            assert mounts <= volumes, f"{where}: {c['name']} mounts volumes no pod has: {sorted(mounts - volumes)}"
        if w["kind"] == "StatefulSet":
            svc = named(objects, "Service", w["spec"]["serviceName"])
            assert svc is not None and svc["spec"].get("clusterIP") == "None", \
                f"{where}: serviceName {w['spec']['serviceName']} is no headless Service"
    for monitor in by_kind(objects, "ServiceMonitor"):
        for endpoint in monitor["spec"]["endpoints"]:
            creds = (endpoint.get("authorization") or {}).get("credentials")
            if creds:
                exists("Secret", creds["name"], creds["key"], False, f"ServiceMonitor {monitor['metadata']['name']}")


def check_volumes(objects: list[dict]) -> None:
    """Kills: a volume with two sources (a strategic-merge patch that adds a hostPath to a volume
    that was an emptyDir keeps both: the API rejects the pod)."""
    sources = {"emptyDir", "hostPath", "configMap", "secret", "persistentVolumeClaim", "projected", "downwardAPI",
               "csi", "ephemeral", "nfs"}
    for w in pods(objects):
        for volume in pod_spec(w).get("volumes") or []:
            found = sources & set(volume)
            assert len(found) == 1, f"{w['metadata']['name']}: volume {volume['name']} has sources {sorted(found)}"


def check_ports(objects: list[dict]) -> None:
    """Kills: a Service whose targetPort no selected container opens (connections refused), a probe
    on a port the container does not open (the pod never becomes ready or is restarted forever), a
    NetworkPolicy naming a port no selected pod has (the traffic it means to allow is dropped)."""
    workloads = pods(objects)
    for svc in by_kind(objects, "Service"):
        chosen = [w for w in workloads if matches(svc["spec"]["selector"], pod_labels(w))]
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for w in chosen:
                assert any(container_port(c, target) for c in pod_spec(w)["containers"]), \
                    f"Service {svc['metadata']['name']} port {port.get('name')}: {w['metadata']['name']} opens no {target}"
    for w in workloads:
        for c in pod_spec(w)["containers"]:
            for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = c.get(probe_name) or {}
                for kind in ("httpGet", "tcpSocket", "grpc"):
                    if kind in probe:
                        assert container_port(c, probe[kind]["port"]) is not None, \
                            f"{w['metadata']['name']}/{c['name']} {probe_name} on {probe[kind]['port']}: no such port"
    for policy in by_kind(objects, "NetworkPolicy"):
        chosen = [w for w in workloads if matches(policy["spec"]["podSelector"], pod_labels(w))]
        for rule in policy["spec"].get("ingress") or []:
            for port in rule.get("ports") or []:
                for w in chosen:
                    assert any(container_port(c, port["port"]) for c in pod_spec(w)["containers"]), \
                        f"NetworkPolicy {policy['metadata']['name']}: {w['metadata']['name']} has no port {port['port']}"


def check_store_daemon(objects: list[dict], tmp: Path) -> None:
    """Kills: daemon arguments or a serve.toml that `kvstore serve` refuses (a typo'd flag or key, a
    bad size: CrashLoopBackOff), a daemon listening on other ports than its pod declares (probes,
    Services and peers miss it) or only on loopback (no other node reaches it), metrics on
    127.0.0.1 (Prometheus scrapes nothing), --insecure, a secret or admin token not taken from the
    Secret, an NVMe tier outside the node's hostPath (lost with the pod)."""
    from kvstore.cli import parse

    daemonset, container = store(objects)
    mounts = mounted_files(objects, daemonset, container, tmp)
    args = localize(argv(objects, daemonset, container), mounts)
    assert args[0] == "kvstore", f"the daemon runs {args[0]}, not kvstore"
    parsed = parse_or_fail(parse, args[1:], "kvstore serve refuses the daemon's arguments",
                           env_of(objects, daemonset, container))
    assert parsed.command == "serve"
    ports = {name: container_port(container, name) for name in ("grpc", "engine", "wire", "metrics")}
    host, _, port = parsed.listen.rpartition(":")
    assert int(port) == ports["grpc"], f"--listen port {port}, container port grpc {ports['grpc']}"
    assert host not in ("127.0.0.1", "localhost", "::1"), "--listen on loopback: no other node reaches the daemon"
    assert int(parsed.engine_listen.rpartition(":")[2]) == ports["engine"], "--engine-listen port != container port engine"
    assert parsed.wire_port == ports["wire"], f"--wire-port {parsed.wire_port} != container port wire {ports['wire']}"
    assert parsed.metrics_port == ports["metrics"], f"--metrics-port {parsed.metrics_port} != {ports['metrics']}"
    assert parsed.metrics_listen not in ("127.0.0.1", "localhost"), "metrics on loopback: Prometheus scrapes nothing"
    assert not parsed.insecure, "the daemon runs --insecure"
    env = {e["name"]: e for e in container.get("env") or []}
    for name in ("KVSTORE_SECRET", "KVSTORE_ADMIN_TOKEN"):
        assert "secretKeyRef" in ((env.get(name) or {}).get("valueFrom") or {}) or \
            (name == "KVSTORE_SECRET" and parsed.secret_file) or (name == "KVSTORE_ADMIN_TOKEN" and parsed.admin_token_file), \
            f"the daemon's {name} does not come from a Secret"
    assert parsed.disk_dir, "no NVMe tier (--disk-dir)"
    host_paths = {m["mountPath"] for m in container["volumeMounts"]
                  if "hostPath" in next(v for v in pod_spec(daemonset)["volumes"] if v["name"] == m["name"])}
    assert any(parsed.disk_dir.startswith(p.rstrip("/") + "/") for p in host_paths), \
        f"--disk-dir {parsed.disk_dir} is on no hostPath mount ({sorted(host_paths)})"


def check_store_memory(objects: list[dict], tmp: Path) -> None:
    """Kills: a daemon whose memory limit is below its DRAM tier plus overhead (the tier is shared
    memory the daemon fills at start, charged to its pod: OOM-killed at once or under load), or whose
    request differs from its limit (not Guaranteed: the node overcommits what the tier pins)."""
    from kvstore.cli import parse
    from kvstore.sizes import parse_size

    daemonset, container = store(objects)
    args = localize(argv(objects, daemonset, container), mounted_files(objects, daemonset, container, tmp))
    parsed = parse_or_fail(parse, args[1:], "kvstore serve refuses the daemon's arguments",
                           env_of(objects, daemonset, container))
    resources = container.get("resources") or {}
    limit = (resources.get("limits") or {}).get("memory")
    request = (resources.get("requests") or {}).get("memory")
    assert limit is not None and request is not None, "the daemon has no memory request and limit"
    assert quantity(request) == quantity(limit), f"memory request {request} != limit {limit}"
    dram = parse_size(parsed.dram)
    assert quantity(limit) >= dram + DAEMON_OVERHEAD, \
        f"memory limit {limit} < DRAM tier {parsed.dram} + {DAEMON_OVERHEAD >> 30} GiB"


def check_gateway(objects: list[dict], tmp: Path) -> None:
    """Kills: gateway arguments or a gateway.json `conductor serve` refuses, a gateway listening on
    another port than its container declares, API keys not from a Secret, a gateway that addresses
    an engine that does not exist (a pod index past the StatefulSet's replicas, a wrong Service or
    port), KV-event endpoints on another port than the engines open or for engines it does not
    route to, block_tokens other than the engines' block size (its cache accounting is off), a
    gateway on another metadata service or cluster than the engines, a model_dir other than the
    engines' model path (the fingerprint's model_id differs: no block of theirs is ever found)."""
    from conductor.cli import build_parser
    from conductor.gateway.serve import config_from

    deployment, container = gateway(objects)
    mounts = mounted_files(objects, deployment, container, tmp)
    args = localize(argv(objects, deployment, container), mounts)
    assert args[0] == "conductor", f"the gateway runs {args[0]}, not conductor"
    env = env_of(objects, deployment, container)
    parsed = parse_or_fail(build_parser().parse_args, args[1:], "conductor serve refuses the gateway's arguments", env)
    assert parsed.command == "serve"
    try:
        with environment(env):
            config = config_from(parsed)  # reads --config and --api-key-file as conductor does
    except (OSError, ValueError, TypeError) as exc:
        raise AssertionError(f"conductor serve refuses the gateway's settings: {exc}") from None
    assert int(parsed.listen.rpartition(":")[2]) == container_port(container, "http"), "--listen port != container port"
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    key_file = args[args.index("--api-key-file") + 1] if "--api-key-file" in args else None
    assert key_file and config.api_keys, "the gateway serves without API keys"
    key_mount = next(m for m in container["volumeMounts"]
                     if m["mountPath"] in mounts and key_file.startswith(str(mounts[m["mountPath"]]) + "/"))
    assert "secret" in volumes[key_mount["name"]], "the gateway's API keys are not from a Secret"
    urls = list(config.prefill) + list(config.decode)
    for url in urls:
        match = re.fullmatch(r"http://([a-z0-9-]+)-(\d+)\.([a-z0-9-]+):(\d+)", url)
        assert match, f"engine URL {url} is not a StatefulSet pod's name (NAME-N.SERVICE:PORT)"
        name, index, service, port = match.group(1), int(match.group(2)), match.group(3), int(match.group(4))
        sts = named(objects, "StatefulSet", name)
        assert sts is not None, f"{url}: no StatefulSet {name}"
        assert index < sts["spec"].get("replicas", 1), f"{url}: {name} has {sts['spec'].get('replicas', 1)} replicas"
        assert sts["spec"]["serviceName"] == service, f"{url}: {name}'s pods are named under {sts['spec']['serviceName']}"
        assert container_port(engine_container(sts), port) is not None, f"{url}: {name} opens no port {port}"
    assert set(config.kv_events) <= set(urls), f"KV events for engines the gateway does not route to: {set(config.kv_events) - set(urls)}"
    for url, endpoint in config.kv_events.items():
        sts = named(objects, "StatefulSet", re.match(r"http://([a-z0-9-]+)-\d+\.", url).group(1))
        port = int(endpoint.rsplit(":", 1)[1])
        assert container_port(engine_container(sts), port) is not None, f"KV events of {url} on {port}: not opened"
    for sts in engines(objects):
        assert engine_config(objects, sts).get("block-size") == config.block_tokens, \
            f"{sts['metadata']['name']} block-size != the gateway's block_tokens {config.block_tokens}"
    cluster = config_data(objects, "kvstore-cluster")
    metadata = config.metadata or ""
    for mount, folder in mounts.items():  # back to the paths the pod sees
        metadata = metadata.replace(str(folder) + "/", mount + "/")
    assert (metadata, config.cluster) == (cluster["metadata-reader"], cluster["cluster"]), \
        "the gateway reads another metadata service or cluster than the engines"
    for sts in engines(objects):
        path = env_of(objects, sts, engine_container(sts)).get("MODEL_PATH")
        assert config.model_dir == path, \
            f"the gateway's model_dir {config.model_dir} is not {sts['metadata']['name']}'s model {path}: " \
            "its fingerprint (model_id) differs from the engines', so it finds none of their blocks"


def check_engines(objects: list[dict], tmp: Path) -> None:
    """Kills: an engine without the kvstore connector or with another module path, a prefill pool
    that is not kv_producer or a decode pool that is not kv_consumer (kv_both where the gateway
    runs them colocated), an engine on another metadata service or cluster than the daemons (it saves
    where nobody looks), engines with different block sizes or PYTHONHASHSEED (no shared keys),
    KV events off where the gateway reads them, an engine listening on another port than its
    container declares, a cluster secret not from the Secret, a CPU engine whose memory limit does not
    hold its KV cache plus vLLM itself (OOM-killed when the cache fills) or whose request differs."""
    cluster = config_data(objects, "kvstore-cluster")
    pools = engines(objects)
    assert pools, "no engines"
    colocated = not gateway_config(objects).get("prefill")
    seeds, blocks = set(), set()
    for sts in pools:
        where = sts["metadata"]["name"]
        cfg = engine_config(objects, sts)
        kv = cfg.get("kv-transfer-config") or {}
        assert kv.get("kv_connector") == "KVStoreConnector", f"{where}: connector {kv.get('kv_connector')}"
        assert kv.get("kv_connector_module_path") == "kvstore.integrations.vllm.connector", f"{where}: module path"
        want = "kv_both" if colocated else {"prefill": "kv_producer", "decode": "kv_consumer"}[component(sts)]
        assert kv.get("kv_role") == want, f"{where}: kv_role {kv.get('kv_role')}, not {want}"
        extra = kv.get("kv_connector_extra_config") or {}
        assert (extra.get("metadata"), extra.get("cluster", "default")) == (cluster["metadata-reader"], cluster["cluster"]), \
            f"{where}: the connector's store {extra.get('metadata')} / {extra.get('cluster')} is not the cluster's"
        assert "secret" not in extra, f"{where}: the cluster secret is in the engine's ConfigMap"
        events = cfg.get("kv-events-config") or {}
        if sts["metadata"]["name"] in json.dumps(gateway_config(objects).get("kv_events") or {}):
            assert events.get("enable_kv_cache_events") and events.get("publisher") == "zmq", f"{where}: KV events off"
        blocks.add(cfg.get("block-size"))
        container = engine_container(sts)
        env = {e["name"]: e for e in container.get("env") or []}
        seeds.add((env.get("PYTHONHASHSEED") or {}).get("value"))
        assert "secretKeyRef" in ((env.get("KVSTORE_SECRET") or {}).get("valueFrom") or {}), \
            f"{where}: KVSTORE_SECRET does not come from the Secret"
        args = argv(objects, sts, container)
        assert "--port" in args and container_port(container, int(args[args.index("--port") + 1])) is not None, \
            f"{where}: vLLM's --port is no container port"
        resources = container.get("resources") or {}
        limit = quantity((resources.get("limits") or {}).get("memory", 0))
        assert limit and limit == quantity((resources.get("requests") or {}).get("memory", 0)), \
            f"{where}: memory request and limit differ or are unset"
        on_gpu = "nvidia.com/gpu" in (resources.get("limits") or {})
        if not on_gpu:  # the KV cache is host memory: it must fit in the pod beside vLLM itself
            kv_cache = cfg.get("kv-cache-memory-bytes")
            assert kv_cache, f"{where}: a CPU engine without kv-cache-memory-bytes takes what it finds"
            assert limit >= int(kv_cache) + ENGINE_OVERHEAD, \
                f"{where}: memory limit {limit >> 20} MiB < KV cache {int(kv_cache) >> 20} MiB + {ENGINE_OVERHEAD >> 30} GiB"
    assert None not in seeds and len(seeds) == 1, f"PYTHONHASHSEED differs or is unset across engines: {seeds}"
    assert len(blocks) == 1 and None not in blocks, f"engines' block sizes differ or are unset: {blocks}"


def check_same_host_path(objects: list[dict], tmp: Path) -> None:
    """Kills: an engine that cannot take the daemon's same-host path (and silently falls back to
    TCP): no socket directory mount, mounted elsewhere than the daemon's, KVSTORE_SOCKET_DIR unset or
    pointing elsewhere, KVSTORE_HOST_ID not the node's name (downward API), or a user the daemon's
    socket does not admit (neither the daemon's nor root)."""
    def view(workload: dict, container: dict) -> tuple[str | None, str | None, str | None, int | None]:
        env = env_of(objects, workload, container)
        volumes = {v["name"]: v for v in pod_spec(workload).get("volumes") or []}
        socket_dir = env.get("KVSTORE_SOCKET_DIR")
        host_dir = None
        for m in container.get("volumeMounts") or []:
            if m["mountPath"] == socket_dir and "hostPath" in volumes.get(m["name"], {}):
                host_dir = volumes[m["name"]]["hostPath"]["path"]
        uid = (container.get("securityContext") or {}).get("runAsUser",
                                                           (pod_spec(workload).get("securityContext") or {}).get("runAsUser"))
        return socket_dir, host_dir, env.get("KVSTORE_HOST_ID"), uid

    daemonset, container = store(objects)
    want = view(daemonset, container)
    assert want[0] and want[1], "the daemon has no socket directory on a hostPath"
    assert want[2] == FIELD_VALUES["spec.nodeName"], "the daemon's KVSTORE_HOST_ID is not its node's name"
    for sts in engines(objects):
        got = view(sts, engine_container(sts))
        where = sts["metadata"]["name"]
        assert got[0] == want[0], f"{where}: KVSTORE_SOCKET_DIR {got[0]}, the daemon's {want[0]}"
        assert got[1] == want[1], f"{where}: socket directory on host {got[1]}, the daemon's {want[1]}"
        assert got[2] == FIELD_VALUES["spec.nodeName"], f"{where}: KVSTORE_HOST_ID is not the node's name"
        assert got[3] in (want[3], 0), f"{where}: runs as {got[3]}; the daemon's socket admits {want[3]} and root"


def check_secrets_stay_secret(objects: list[dict], tree: Path) -> None:
    """Kills: a secret value (cluster secret, admin token, API key, etcd password or key) written
    into a ConfigMap, an argument, an annotation or anything else that is not a Secret."""
    values = secret_values(tree, "")
    assert values, "no secret values to look for"
    for obj in objects:
        if obj["kind"] == "Secret":
            continue
        text = json.dumps(obj)
        for value in values:
            assert value not in text, f"{obj['kind']} {obj['metadata']['name']} carries a secret value"


def etcd_url(url: str) -> tuple[str, str | None, str, str]:
    """(scheme, user, hosts, query) of a metadata URL."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    user, _, hosts = parts.netloc.rpartition("@")
    return parts.scheme, user or None, hosts, parts.query


def secrets_of(workload: dict) -> set[str]:
    """Every Secret a pod can read (environment and volumes)."""
    names = set()
    for c in containers(workload):
        for item in c.get("env") or []:
            ref = (item.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                names.add(ref["name"])
        for item in c.get("envFrom") or []:
            if "secretRef" in item:
                names.add(item["secretRef"]["name"])
    for volume in pod_spec(workload).get("volumes") or []:
        if "secret" in volume:
            names.add(volume["secret"]["secretName"])
    return names


def check_etcd_identities(objects: list[dict]) -> None:
    """Kills: the gateway or an engine logging in to etcd as the store user (the internet-facing
    gateway could rewrite the index: fake nodes, other locations and digests), the store daemons as
    the reader (they could not publish), readers and daemons on different etcds, etcd's root password
    in any pod but the auth Job, a reader holding the store's password or certificate, the in-cluster
    etcd without the Job that turns its authentication on, a Job making users for another cluster or
    with other passwords than the pods log in with."""
    cluster = config_data(objects, "kvstore-cluster")
    store_url, reader_url = cluster["metadata"], cluster["metadata-reader"]
    s_scheme, s_user, s_hosts, s_query = etcd_url(store_url)
    r_scheme, r_user, r_hosts, r_query = etcd_url(reader_url)
    assert (s_scheme, s_hosts, s_query) == (r_scheme, r_hosts, r_query), \
        f"the daemons' etcd {store_url} and the readers' {reader_url} differ beyond their users"
    assert (s_user, r_user) == (STORE_USER, READER_USER), \
        f"etcd users: daemons {s_user}, readers {r_user} (want {STORE_USER}, {READER_USER})"

    def password_secret(workload: dict, container: dict) -> str | None:
        item = next((e for e in container.get("env") or [] if e["name"] == "KVSTORE_ETCD_PASSWORD"), {})
        return ((item.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")

    daemonset, daemon = store(objects)
    args = argv(objects, daemonset, daemon)
    assert f"--metadata={store_url}" in args, "the daemons do not log in to etcd as the store user"
    assert password_secret(daemonset, daemon) == "kvstore-etcd-store", "the daemons' etcd password is not the store user's"
    readers = [(sts, engine_container(sts), engine_config(objects, sts)["kv-transfer-config"]
                ["kv_connector_extra_config"]["metadata"]) for sts in engines(objects)]
    deployment, gw = gateway(objects)
    gw_args = argv(objects, deployment, gw)
    readers.append((deployment, gw, gw_args[gw_args.index("--metadata") + 1]))
    for workload, container, url in readers:
        where = workload["metadata"]["name"]
        assert etcd_url(url)[1] == READER_USER, f"{where} logs in to etcd as {etcd_url(url)[1]}, not the reader"
        assert password_secret(workload, container) == "kvstore-etcd-reader", f"{where}'s etcd password is not the reader's"
        held = secrets_of(workload)
        assert not held & {"kvstore-etcd-store", "kvstore-etcd-store-tls", "kvstore-etcd-root"}, \
            f"{where} can read the store user's or root's etcd credentials: {sorted(held)}"
    for workload in pods(objects):
        if component(workload) != "etcd-auth":
            assert "kvstore-etcd-root" not in secrets_of(workload), f"{workload['metadata']['name']} holds etcd's root password"
    if named(objects, "StatefulSet", "kvstore-etcd") is not None:
        job = named(objects, "Job", "kvstore-etcd-auth")
        assert job is not None, "the in-cluster etcd runs without the Job that turns its authentication on"
        container = pod_spec(job)["containers"][0]
        job_args = argv(objects, job, container)
        assert job_args[job_args.index("--cluster") + 1] == cluster["cluster"], "the auth Job makes users of another cluster"
        assert job_args[job_args.index("--endpoints") + 1] == s_hosts, "the auth Job sets up another etcd"
        assert "--store-user" not in job_args and "--reader-user" not in job_args, \
            "the auth Job names other users than the pods' (etcd_auth.py's defaults)"
        sources = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"]
                   if "secretKeyRef" in (e.get("valueFrom") or {})}
        assert sources == {"ETCD_ROOT_PASSWORD": "kvstore-etcd-root", "ETCD_STORE_PASSWORD": "kvstore-etcd-store",
                           "ETCD_READER_PASSWORD": "kvstore-etcd-reader"}, f"the auth Job's passwords: {sources}"
    else:  # an etcd of the user's own: TLS, a certificate per identity
        assert s_scheme == "etcd+tls", "an etcd outside the cluster without TLS"
        assert "kvstore-etcd-store-tls" in secrets_of(daemonset), "the daemons have no etcd client certificate"
        for workload, _, _ in readers:
            assert "kvstore-etcd-reader-tls" in secrets_of(workload), \
                f"{workload['metadata']['name']} has no reader certificate of its own"


def check_network_policy(objects: list[dict]) -> None:
    """Kills: Prometheus not pinned to its namespace (any pod labelled like it, in any namespace,
    reaches vLLM's unauthenticated port and the daemons' /metrics), no default deny (a pod reaches
    anything), the gateway able to reach the store daemons or etcd's peers, engines reaching each
    other, the store or etcd or the auth Job reaching out of the cluster, engines or the gateway
    reaching the internet when no model is downloaded, strangers reaching the engines, the daemons or
    etcd or any other pod of the namespace, and any pod that cannot reach what it must (etcd, DNS,
    the daemons, the engines)."""
    from .netpol import Cluster, allowed, outside, pod

    namespace = next(o["metadata"]["name"] for o in objects if o["kind"] == "Namespace")
    policies = [dict(p, metadata={**p["metadata"], "namespace": p["metadata"].get("namespace", namespace)})
                for p in by_kind(objects, "NetworkPolicy")]
    scrape = named(objects, "NetworkPolicy", "kvstore-scrape-store")
    assert scrape is not None, "no policy admits Prometheus to the daemons' /metrics"
    source = scrape["spec"]["ingress"][0]["from"][0]
    pinned = (source.get("namespaceSelector") or {}).get("matchLabels") or {}
    assert set(pinned) == {"kubernetes.io/metadata.name"} and not source["namespaceSelector"].get("matchExpressions"), \
        f"Prometheus is not pinned to one namespace by name: {source.get('namespaceSelector')}"
    monitoring = pinned["kubernetes.io/metadata.name"]
    prometheus_labels = (source.get("podSelector") or {}).get("matchLabels") or {}
    assert prometheus_labels, "Prometheus's pods are not named by label"
    cluster = Cluster({namespace: {}, monitoring: {}, "kube-system": {}, "elsewhere": {}}, policies)

    def endpoint(workload: dict):
        ports = {p["name"]: p["containerPort"] for c in pod_spec(workload)["containers"] for p in c.get("ports") or []
                 if "name" in p}
        return pod(workload["metadata"]["name"], namespace, pod_labels(workload), ports)

    by_component: dict[str, list] = {}
    for w in pods(objects):
        by_component.setdefault(component(w), []).append(endpoint(w))
    ours = [e for group in by_component.values() for e in group]
    store_pods, etcd_pods = by_component.get("store", []), by_component.get("etcd", [])
    engine_pods = by_component.get("prefill", []) + by_component.get("decode", [])
    gateways, jobs = by_component.get("gateway", []), by_component.get("etcd-auth", [])
    assert store_pods and engine_pods and gateways
    prometheus = pod("prometheus", monitoring, prometheus_labels)
    impostor = pod("a pod labelled as Prometheus elsewhere", "elsewhere", prometheus_labels)
    stranger = pod("a pod elsewhere", "elsewhere", {"app": "other"})
    neighbour = pod("another pod of the namespace", namespace, {"app": "other"})
    dns = pod("kube-dns", "kube-system", {"k8s-app": "kube-dns"}, {"dns": 53})
    internet = outside("the internet", "203.0.113.7")
    downloads = any(c["name"] == "fetch-model" for w in pods(objects) for c in containers(w))

    def must(source, target, port, protocol="TCP", want=True):
        got = allowed(cluster, source, target, port, protocol)
        verb = "cannot reach" if want else "reaches"
        assert got == want, f"{source.name} {verb} {target.name} on {port}/{protocol}"

    for e in ours:
        must(e, dns, 53, "UDP")
        must(e, dns, 53, "TCP")
    for s in store_pods:
        for other in store_pods:
            for port in ("grpc", "engine", "wire"):
                must(other, s, port)
        for e in engine_pods:
            for port in ("grpc", "engine", "wire"):
                must(e, s, port)
            must(s, e, "http", want=False)
        for g in gateways:
            for port in ("grpc", "engine", "wire", "metrics"):
                must(g, s, port, want=False)
        must(prometheus, s, "metrics")
        must(impostor, s, "metrics", want=False)
        for port in ("grpc", "engine", "wire", "metrics"):
            must(stranger, s, port, want=False)
        must(s, internet, 443, want=False)
    for e in engine_pods:
        for g in gateways:
            must(g, e, "http")
            must(g, e, "kv-events")
        must(prometheus, e, "http")
        must(impostor, e, "http", want=False)
        for port in ("http", "kv-events"):
            must(stranger, e, port, want=False)
            must(neighbour, e, port, want=False)
        for other in engine_pods:
            if other is not e:
                must(other, e, "http", want=False)
    must(stranger, pod(neighbour.name, namespace, {"app": "other"}, {"http": 8080}), "http", want=False)  # closed by default
    for g in gateways:
        must(stranger, g, "http")  # it faces clients
        for e in engine_pods:
            must(e, g, "http", want=False)
    for e in engine_pods + gateways:
        must(e, internet, 443, want=downloads)
        must(e, internet, 80, want=False)
    for e in etcd_pods + jobs:
        must(e, internet, 443, want=False)
        for s in store_pods:
            must(e, s, "grpc", want=False)
    if etcd_pods:
        clients = store_pods + engine_pods + gateways + jobs
        for etcd in etcd_pods:
            for c in clients:
                must(c, etcd, "client")
                must(c, etcd, "peer", want=False)
            for other in etcd_pods:
                must(other, etcd, "peer")
            for outsider in (stranger, neighbour, impostor, prometheus):
                must(outsider, etcd, "client", want=False)
    else:  # an etcd of the user's own: its addresses only, its port only
        egress = named(objects, "NetworkPolicy", "kvstore-etcd-clients")
        assert egress is not None, "no egress policy to the external etcd"
        port = int(etcd_url(config_data(objects, "kvstore-cluster")["metadata"])[2].split(",")[0].rsplit(":", 1)[1])
        blocks = [peer["ipBlock"]["cidr"] for rule in egress["spec"]["egress"] for peer in rule.get("to") or []]
        assert blocks and all(b not in ("0.0.0.0/0", "::/0") for b in blocks), f"etcd egress open to everything: {blocks}"
        import ipaddress

        etcd = outside("the external etcd", str(next(ipaddress.ip_network(blocks[0]).hosts())))
        for c in store_pods + engine_pods + gateways:
            must(c, etcd, port)
            must(c, etcd, 22, want=False)
            must(c, outside("elsewhere", "198.51.100.9"), port, want=False)


def check_pod_security(objects: list[dict]) -> None:
    """Kills: a pod with the Kubernetes API token mounted (none of them calls the API: a compromised
    gateway would hold credentials), a namespace whose Pod Security level refuses its own pods
    (hostPath under baseline or restricted) or is missing (the cluster's default decides), no
    restricted audit and warning, etcd, the gateway or the auth Job falling short of restricted
    (privileged, escalation, root, capabilities), and a store or engine pod falling short for any
    reason but its host directories (hostPath, and the root init containers that hand them over)."""
    from .pod_security import level, weakest

    host_dir_inits = {"host-dirs", "models-dir"}  # root, CHOWN/FOWNER: they chown the hostPath directories
    namespace = next(o for o in objects if o["kind"] == "Namespace")
    labels = namespace["metadata"].get("labels") or {}
    levels = []
    for w in pods(objects):
        where = f"{w['kind']} {w['metadata']['name']}"
        spec = pod_spec(w)
        assert spec.get("automountServiceAccountToken") is False, f"{where} mounts a Kubernetes API token"
        got, why = level(spec)
        levels.append(got)
        if component(w) in ("etcd", "gateway", "etcd-auth"):
            assert got == "restricted", f"{where} falls short of restricted: {why}"
        else:
            others = [r for r in why if not r.startswith("hostPath volume ")
                      and not any(r.startswith(f"{name}: ") for name in host_dir_inits)]
            assert not others, f"{where} falls short of restricted beyond its host directories: {others}"
    want = weakest(levels)
    enforce = labels.get("pod-security.kubernetes.io/enforce")
    assert enforce == want, f"namespace enforces {enforce}; its pods need {want}"
    for mode in ("audit", "warn"):
        assert labels.get(f"pod-security.kubernetes.io/{mode}") == "restricted", f"no restricted {mode} on the namespace"
    for mode in ("enforce", "audit", "warn"):
        assert labels.get(f"pod-security.kubernetes.io/{mode}-version"), f"the {mode} level's version is not pinned"


def check_images_pinned(objects: list[dict]) -> None:
    """Kills: an image by tag only (a tag moves: a re-push changes what runs, and nodes may run
    different builds), etcd's included, a container added after the overlay's image was set (left on
    the unpinned base name), two builds of the kvstore image in one deploy."""
    ours = set()
    for w in pods(objects):
        for c in containers(w):
            ref = c.get("image", "")
            assert re.fullmatch(r"[^\s@]+@sha256:[0-9a-f]{64}", ref), \
                f"{w['metadata']['name']}/{c['name']}: image {ref!r} is not pinned by digest"
            if "etcd" not in ref.split("@")[0].rsplit("/", 1)[-1]:
                ours.add(ref)
    assert len(ours) == 1, f"several kvstore images in one deploy: {sorted(ours)}"


CHECKS = {f.__name__: f for f in (check_selectors, check_references, check_volumes, check_ports,
                                  check_etcd_identities, check_network_policy, check_pod_security,
                                  check_images_pinned)}
CHECKS_WITH_TMP = {f.__name__: f for f in (check_store_daemon, check_store_memory, check_gateway, check_engines,
                                           check_same_host_path)}


def run_check(name: str, objects: list[dict], tmp: Path, tree: Path) -> None:
    if name in CHECKS:
        CHECKS[name](objects)
    elif name == "check_secrets_stay_secret":
        check_secrets_stay_secret(objects, tree)
    else:
        CHECKS_WITH_TMP[name](objects, tmp)


ALL_CHECKS = [*CHECKS, *CHECKS_WITH_TMP, "check_secrets_stay_secret"]


# --- the tests ------------------------------------------------------------------------------------

def test_overlays_are_there():
    assert {"cpu-dev", "cpu-dev-colocated", "gpu", "gpu-external-etcd"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders(rendered, overlay):
    kinds = {o["kind"] for o in rendered[overlay]}
    assert {"DaemonSet", "StatefulSet", "Deployment", "Service", "ConfigMap", "Secret"} <= kinds
    assert named(rendered[overlay], "ConfigMap", "kvstore-grafana-dashboard") is not None
    dashboard = json.loads(config_data(rendered[overlay], "kvstore-grafana-dashboard")["kvstore.json"])
    assert dashboard == json.loads((ROOT / "deploy" / "grafana" / "kvstore.json").read_text())
    namespaces = {o["metadata"].get("namespace") for o in rendered[overlay] if o["kind"] != "Namespace"}
    assert len(namespaces) == 1 and None not in namespaces, f"objects in several or no namespaces: {namespaces}"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: the Python renderer alone")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderer_agrees_with_kubectl(tree, rendered, overlay):
    out = subprocess.run(["kubectl", "kustomize", str(tree / "k8s" / "overlays" / overlay)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]

    def keyed(objects):
        result = {}
        for obj in copy.deepcopy(objects):
            if obj["kind"] == "Secret":  # kubectl wraps long base64 lines
                obj["data"] = {k: base64.b64decode(v) for k, v in obj.get("data", {}).items()}
            result[(obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])] = obj
        return result

    assert keyed(list(yaml.safe_load_all(out.stdout))) == keyed(rendered[overlay])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_validate_strict(rendered, overlay):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="part of the deploy extra")
    import jsonschema

    for obj in rendered[overlay]:
        if obj["kind"] == "ServiceMonitor":  # a CRD: no schema ships with Kubernetes
            jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
            continue
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("check", ALL_CHECKS)
def test_invariant(rendered, tree, tmp_path, overlay, check):
    run_check(check, rendered[overlay], tmp_path, tree)


def test_engine_configs_are_ones_vllm_takes(rendered, tmp_path):
    """Each engine's --config YAML, as vLLM's own `serve` parser reads it (every key a flag it knows,
    every value one it accepts: a KV cache size in bytes, a dtype, a block size), with a
    kv-transfer-config that builds vLLM's KVTransferConfig. Kills: a generated key vLLM does not know
    (`vllm serve` exits at start), a size in a form it refuses."""
    pytest.importorskip("vllm", reason="the vllm extra is part of the test install")
    from vllm.config import KVTransferConfig
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    for overlay, objects in rendered.items():
        for sts in engines(objects):
            cfg = engine_config(objects, sts)
            KVTransferConfig(**cfg["kv-transfer-config"])
            path = tmp_path / f"{overlay}-{sts['metadata']['name']}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    args = parser.parse_args(["--model", "/models/model", "--config", str(path)])
            except SystemExit:
                raise AssertionError(f"{overlay} {sts['metadata']['name']}: vLLM refuses its config: "
                                     f"{err.getvalue().strip().splitlines()[-1]}") from None
            assert args.block_size == cfg["block-size"] and args.max_model_len == cfg["max-model-len"]
            assert args.kv_cache_memory_bytes == cfg.get("kv-cache-memory-bytes")


# --- each check against the broken variant it names ---------------------------------------------

def _sts(objects, name):
    return named(objects, "StatefulSet", name)


def _env(container, name, value=None, drop=False):
    items = [e for e in container.get("env", []) if e["name"] != name]
    if not drop:
        items.append({"name": name, "value": value})
    container["env"] = items


def _env_from(container, name, kind, source, key):
    container["env"] = [e for e in container.get("env", []) if e["name"] != name] + \
        [{"name": name, "valueFrom": {kind: {"name": source, "key": key}}}]


def _ingress_only_policies(objects):
    """The policies as they were: ingress only, the daemons and etcd open to every kvstore pod."""
    objects.remove(named(objects, "NetworkPolicy", "kvstore-dns"))
    for policy in by_kind(objects, "NetworkPolicy"):
        policy["spec"]["policyTypes"] = [t for t in policy["spec"]["policyTypes"] if t == "Ingress"] or ["Ingress"]
        policy["spec"].pop("egress", None)
    for name in ("kvstore-store", "kvstore-etcd"):
        named(objects, "NetworkPolicy", name)["spec"]["ingress"][0]["from"] = [
            {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "kvstore"}}}]


def _set_config(objects, cm, key, transform):
    data = named(objects, "ConfigMap", cm)["data"]
    data[key] = transform(data[key])


def _gateway_json(objects, change):
    def edit(text):
        cfg = json.loads(text)
        change(cfg)
        return json.dumps(cfg)
    _set_config(objects, "conductor-gateway-config", "gateway.json", edit)


MUTATIONS = {
    "selector misses labels": ("check_selectors", lambda o: _sts(o, "vllm-decode")["spec"]["template"]["metadata"]["labels"]
                               .update({"app.kubernetes.io/component": "decoder"})),
    "service selects nothing": ("check_selectors", lambda o: named(o, "Service", "vllm-prefill")["spec"]["selector"]
                                .update({"app.kubernetes.io/component": "prefil"})),
    "secret not rendered": ("check_references", lambda o: o.remove(named(o, "Secret", "kvstore-secrets"))),
    "configmap key missing": ("check_references", lambda o: named(o, "ConfigMap", "kvstore-model")["data"].pop("name")),
    "serviceName not headless": ("check_references", lambda o: _sts(o, "vllm-decode")["spec"]
                                 .update({"serviceName": "conductor-gateway"})),
    "volume with two sources": ("check_volumes", lambda o: next(v for v in pod_spec(_sts(o, "vllm-prefill"))["volumes"]
                                                                if v["name"] == "sockets").update({"emptyDir": {}})),
    "service targets a closed port": ("check_ports", lambda o: named(o, "Service", "vllm-decode")["spec"]["ports"][0]
                                      .update({"targetPort": 8001})),
    "probe on a closed port": ("check_ports", lambda o: store(o)[1]["readinessProbe"]["grpc"].update({"port": 7005})),
    "policy names a missing port": ("check_ports", lambda o: named(o, "NetworkPolicy", "kvstore-store")["spec"]["ingress"][0]
                                    ["ports"].append({"port": "admin"})),
    "daemon flag typo": ("check_store_daemon", lambda o: store(o)[1]["args"].append("--dram-size=4GiB")),
    "serve.toml unknown key": ("check_store_daemon", lambda o: _set_config(o, "kvstore-store-config", "serve.toml",
                                                                         lambda t: t + 'dram_tier = "1GiB"\n')),
    "daemon port drift": ("check_store_daemon", lambda o: store(o)[1]["ports"][0].update({"containerPort": 7011})),
    "daemon on loopback": ("check_store_daemon", lambda o: store(o)[1]["args"].append("--listen=127.0.0.1:7001")),
    "metrics on loopback": ("check_store_daemon", lambda o: store(o)[1]["args"].append("--metrics-listen=127.0.0.1")),
    "daemon insecure": ("check_store_daemon", lambda o: store(o)[1]["args"].append("--insecure")),
    "admin token not from the Secret": ("check_store_daemon", lambda o: _env(store(o)[1], "KVSTORE_ADMIN_TOKEN", drop=True)),
    "NVMe tier off the hostPath": ("check_store_daemon", lambda o: store(o)[1]["args"].append("--disk-dir=/tmp/nvme")),
    "limit below the DRAM tier": ("check_store_memory", lambda o: store(o)[1]["args"].append("--dram=64GiB")),
    "request below the limit": ("check_store_memory", lambda o: store(o)[1]["resources"]["requests"]
                                .update({"memory": "512Mi"})),
    "gateway flag typo": ("check_gateway", lambda o: gateway(o)[1]["args"].append("--polcy=round_robin")),
    "gateway listen port drift": ("check_gateway", lambda o: gateway(o)[1]["args"].extend(["--listen", "0.0.0.0:9090"])),
    "gateway addresses a missing pod": ("check_gateway", lambda o: _gateway_json(
        o, lambda c: c["decode"].append("http://vllm-decode-7.vllm-decode:8000"))),
    "gateway block size drift": ("check_gateway", lambda o: _gateway_json(o, lambda c: c.update(block_tokens=64))),
    "gateway KV events port drift": ("check_gateway", lambda o: _gateway_json(
        o, lambda c: c["kv_events"].update({c["decode"][0]: "tcp://*:5558"}))),
    "gateway on another cluster": ("check_gateway", lambda o: gateway(o)[1]["args"].extend(["--cluster", "other"])),
    "engine on another store": ("check_engines", lambda o: _set_config(
        o, "kvstore-engine-config", "decode.yaml", lambda t: t.replace("@kvstore-etcd:2379", "@etcd:2379")
        .replace("etcd+tls://kvstore@etcd.example.internal", "etcd+tls://kvstore@etcd.other"))),
    "decode as producer": ("check_engines", lambda o: _set_config(
        o, "kvstore-engine-config", "decode.yaml", lambda t: t.replace("kv_consumer", "kv_producer"))),
    "hash seed differs": ("check_engines", lambda o: _env(engine_container(_sts(o, "vllm-decode")), "PYTHONHASHSEED", "1")),
    "secret in the engine's ConfigMap": ("check_engines", lambda o: _set_config(
        o, "kvstore-engine-config", "decode.yaml", lambda t: t.replace("    cluster: default", "    cluster: default\n    secret: x"))),
    "engine without the socket mount": ("check_same_host_path", lambda o: engine_container(_sts(o, "vllm-decode"))
                                        .update(volumeMounts=[m for m in engine_container(_sts(o, "vllm-decode"))["volumeMounts"]
                                                              if m["name"] != "sockets"])),
    "engine's host id not the node": ("check_same_host_path", lambda o: _env(engine_container(_sts(o, "vllm-prefill")),
                                                                          "KVSTORE_HOST_ID", "$(HOSTNAME)")),
    "engine as another user": ("check_same_host_path", lambda o: pod_spec(_sts(o, "vllm-prefill"))["securityContext"]
                               .update(runAsUser=1000)),
    "secret in a ConfigMap": ("check_secrets_stay_secret", lambda o: named(o, "ConfigMap", "kvstore-cluster")["data"]
                              .update(secret=secret_data(o, "kvstore-secrets")["cluster-secret"])),
    "secret in an argument": ("check_secrets_stay_secret", lambda o: gateway(o)[1]["args"]
                              .append("--api-key=" + secret_data(o, "conductor-api-keys")["metrics-api-key"])),
    "gateway model dir differs": ("check_gateway", lambda o: _gateway_json(o, lambda c: c.update(model_dir="/models/x"))),
    "engine memory below its KV cache": ("check_engines", lambda o: _set_config(
        o, "kvstore-engine-config", "decode.yaml", lambda t: re.sub(r"kv-cache-memory-bytes: \d+",
                                                                    "kv-cache-memory-bytes: 8589934592", t))),
    "gateway as etcd's store user": ("check_etcd_identities", lambda o: _env_from(
        gateway(o)[1], "KVSTORE_ETCD_PASSWORD", "secretKeyRef", "kvstore-etcd-store", "password")),
    "engine connector as etcd's store user": ("check_etcd_identities", lambda o: _set_config(
        o, "kvstore-engine-config", "decode.yaml", lambda t: t.replace("kvstore-reader@", "kvstore@"))),
    "root password in the gateway": ("check_etcd_identities", lambda o: _env_from(
        gateway(o)[1], "ETCD_ROOT_PASSWORD", "secretKeyRef", "kvstore-etcd-root", "password")),
    "etcd without its auth Job": ("check_etcd_identities", lambda o: o.remove(named(o, "Job", "kvstore-etcd-auth"))),
    "Prometheus from any namespace": ("check_network_policy", lambda o: named(o, "NetworkPolicy", "kvstore-scrape-engines")
                                      ["spec"]["ingress"][0]["from"][0].update(namespaceSelector={})),
    "no default deny": ("check_network_policy", lambda o: o.remove(named(o, "NetworkPolicy", "kvstore-default-deny"))),
    "ingress-only policies admitting every kvstore pod": ("check_network_policy", _ingress_only_policies),
    "engines' egress open": ("check_network_policy", lambda o: named(o, "NetworkPolicy", "kvstore-engines")
                             ["spec"]["egress"].append({})),
    "API token mounted": ("check_pod_security", lambda o: pod_spec(gateway(o)[0]).pop("automountServiceAccountToken")),
    "namespace enforces restricted": ("check_pod_security", lambda o: next(x for x in o if x["kind"] == "Namespace")
                                      ["metadata"]["labels"].update({"pod-security.kubernetes.io/enforce": "restricted"})),
    "gateway privileged": ("check_pod_security", lambda o: gateway(o)[1]["securityContext"].update(privileged=True)),
    "daemon as root": ("check_pod_security", lambda o: store(o)[1].setdefault("securityContext", {}).update(runAsUser=0)),
    "image by tag": ("check_images_pinned", lambda o: store(o)[1].update(image="kvstore:0.1.0-cpu")),
    "etcd image by tag": ("check_images_pinned", lambda o: pod_spec(_sts(o, "kvstore-etcd"))["containers"][0]
                          .update(image="quay.io/coreos/etcd:v3.5.18")),
    "two kvstore builds": ("check_images_pinned", lambda o: gateway(o)[1].update(
        image=gateway(o)[1]["image"].split("@")[0] + "@sha256:" + "1" * 64)),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_check_kills_its_mutation(rendered, tree, tmp_path, mutation):
    check, mutate = MUTATIONS[mutation]
    objects = copy.deepcopy(rendered["cpu-dev"])
    run_check(check, objects, tmp_path / "before", tree)  # passes as rendered
    mutate(objects)
    with pytest.raises(AssertionError):
        run_check(check, objects, tmp_path / "after", tree)


def test_strict_validation_kills_an_unknown_field(rendered):
    """kubernetes-validate --strict refuses a misspelt field the API server would drop silently."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="part of the deploy extra")
    daemonset = copy.deepcopy(store(rendered["cpu-dev"])[0])
    kubernetes_validate.validate(daemonset, KUBERNETES_VERSION, strict=True)
    pod_spec(daemonset)["containers"][0]["resource"] = {"limits": {"memory": "2Gi"}}  # for "resources"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSION, strict=True)


def test_a_broken_source_file_is_caught(tmp_path):
    """The whole path once from a source file: cpu-dev's gateway.json sent to a decode engine that
    does not exist renders fine and fails check_gateway."""
    tree = prepare(tmp_path / "copy")
    path = tree / "k8s" / "overlays" / "cpu-dev" / "gateway.json"
    path.write_text(path.read_text().replace("vllm-decode-0.vllm-decode", "vllm-decode-1.vllm-decode"))
    objects = kustomize.build(str(tree / "k8s" / "overlays" / "cpu-dev"))
    with pytest.raises(AssertionError, match="replicas"):
        check_gateway(objects, tmp_path)


def test_renderer_refuses_what_it_does_not_know(tmp_path):
    """A kustomization field this renderer does not implement fails by name instead of being ignored."""
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(kustomize.KustomizeError, match="namePrefix"):
        kustomize.build(str(tmp_path))


def test_gen_secrets_makes_private_files_and_keeps_them(tmp_path):
    tree = prepare(tmp_path)
    folder = tree / "k8s" / "overlays" / "cpu-dev" / "secrets"
    before = {p.name: p.read_text() for p in folder.iterdir()}
    assert {"cluster-secret", "admin-token", "api-keys", "metrics-api-key"} <= set(before)
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in folder.iterdir())
    assert all(len(v.strip().splitlines()[0]) >= 32 for v in before.values())
    subprocess.run(["sh", str(tree / "k8s" / "gen-secrets.sh"), str(folder.parent)], check=True, capture_output=True)
    assert {p.name: p.read_text() for p in folder.iterdir()} == before
    keys = before["api-keys"].split()
    assert before["metrics-api-key"].strip() in keys and len(keys) == 2
    ignored = subprocess.run(["git", "check-ignore", "-q", str(K8S / "overlays" / "cpu-dev" / "secrets" / "x")],
                             cwd=ROOT, capture_output=True)
    assert ignored.returncode == 0, "deploy/k8s/**/secrets/ is not ignored by git"


_ = (argparse, os, sys)  # imported for the helpers' type hints and for tests run alone


def test_the_rendered_pods_on_a_real_etcd(rendered, tree, tmp_path, fresh_etcd):
    """cpu-dev's pods, run for real on an etcd of the test's own: the kvstore-etcd-auth Job's
    command, arguments, script and environment as the kubelet would give them turn authentication on
    (twice: it is idempotent); the daemon container (its arguments, serve.toml and environment; the
    pod IP 127.0.0.1, free ports and folders in place of the pod's) logs in as the store user, answers
    the gRPC health check its readiness probe makes with SERVING and serves /metrics; an engine's
    identity stores and reads blocks through the daemon on its same-host path; and the gateway's and
    engines' identity reads the index but may not write it, nor may a request without a user read it.
    Kills: a reader role that may write (the internet-facing gateway could rewrite the index),
    authentication never turned on (anyone reaching etcd reads and writes), a Job that fails when run
    again, a store user that may not publish (the daemon never becomes ready)."""
    import asyncio

    import numpy as np
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    import kvstore
    from kvstore.errors import MetadataError
    from kvstore.metadata import open_metadata
    from kvstore_testing.ports import free_port
    from transfer import descriptor

    objects = copy.deepcopy(rendered["cpu-dev"])
    here = fresh_etcd.url.split("://", 1)[1]
    cluster = "k8s" + os.urandom(4).hex()
    cm = named(objects, "ConfigMap", "kvstore-cluster")["data"]
    cm.update({k: v.replace("kvstore-etcd:2379", here) for k, v in cm.items() if k.startswith("metadata")},
              cluster=cluster)
    for key in ("prefill.yaml", "decode.yaml"):
        _set_config(objects, "kvstore-engine-config", key,
                    lambda t: t.replace("kvstore-etcd:2379", here).replace("cluster: default", f"cluster: {cluster}"))

    job = named(objects, "Job", "kvstore-etcd-auth")
    job_container = pod_spec(job)["containers"][0]
    job_env = env_of(objects, job, job_container)
    job_args = localize(argv(objects, job, job_container), mounted_files(objects, job, job_container, tmp_path / "job"))
    job_args = [here if a == "kvstore-etcd:2379" else a for a in job_args]
    job_args[job_args.index("--wait") + 1] = "30"
    for attempt in ("first", "again"):
        ran = subprocess.run([sys.executable if a == "python" else a for a in job_args], env={**os.environ, **job_env},
                             capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, f"the auth Job's {attempt} run: {ran.stderr[-2000:]}"
        assert "authentication on" in ran.stdout

    daemonset, container = store(objects)
    ports = {port["containerPort"]: free_port() for port in container["ports"]}
    sockets = Path(__import__("tempfile").mkdtemp(prefix="kvs-k8s-"))
    _set_config(objects, "kvstore-store-config", "serve.toml", lambda t: re.sub(
        r"= (\d{4})\n", lambda m: f"= {ports.get(int(m.group(1)), m.group(1))}\n", t)
        .replace("/var/lib/kvstore/nvme", str(tmp_path / "nvme")))
    env = {**env_of(objects, daemonset, container), "POD_IP": "127.0.0.1", "KVSTORE_SOCKET_DIR": str(sockets),
           "HOME": str(tmp_path)}
    args = [expand(a, env) for a in container["command"] + container["args"]]
    args = [re.sub(r":(7\d{3})$", lambda m: f":{ports[int(m.group(1))]}", a) for a in args]
    args = localize(args, mounted_files(objects, daemonset, container, tmp_path / "mounts"))
    proc = subprocess.Popen(args, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        hello = proc.stdout.readline()
        assert hello, proc.stderr.read()[-2000:]
        probe = container["readinessProbe"]["grpc"]["port"]
        with grpc.insecure_channel(f"127.0.0.1:{ports[probe]}") as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with __import__("urllib.request").request.urlopen(f"http://127.0.0.1:{json.loads(hello)['metrics_port']}/metrics",
                                                          timeout=10) as resp:
            assert b"kvstore_capacity_bytes" in resp.read()

        decode = named(objects, "StatefulSet", "vllm-decode")
        engine_env = env_of(objects, decode, engine_container(decode))
        reader_url = engine_config(objects, decode)["kv-transfer-config"]["kv_connector_extra_config"]["metadata"]
        with environment({**engine_env, "KVSTORE_SOCKET_DIR": str(sockets)}):
            descriptor.host_id.cache_clear()
            fp = kvstore.ModelFingerprint("k8s", "float16", block_size=16, num_layers=1, num_kv_heads=1, head_size=64)
            hashes = kvstore.chain_hashes(fp, list(range(32)))
            with kvstore.Client(reader_url, cluster=cluster, fingerprint=fp, timeout=5) as client:
                client.put_many([(h, np.full(fp.block_bytes, 7, np.uint8)) for h in hashes])
                assert client.stats["local_puts"] > 0  # through /run/kvstore's stand-in, as an engine on the node
                outs = [np.empty(fp.block_bytes, np.uint8) for _ in hashes]
                assert sum(client.get_many(hashes, outs)) == len(hashes)

        deployment, gw = gateway(objects)
        gw_args = argv(objects, deployment, gw)
        gateway_url = gw_args[gw_args.index("--metadata") + 1]
        prefix = f"/kvstore/{cluster}/"

        async def as_reader(url: str):
            metadata = open_metadata(url, timeout=5)
            try:
                page = await metadata.range_page((prefix + "nodes/").encode(), (prefix + "nodes0").encode(), limit=10)
                assert page.keys, "the reader sees no node record"
                with pytest.raises(MetadataError, match="permission denied"):
                    await metadata.put(prefix + "nodes/forged", b"{}")
            finally:
                await metadata.close()

        async def anonymous():
            metadata = open_metadata(fresh_etcd.url, timeout=5)
            try:
                with pytest.raises(MetadataError):
                    await metadata.range_page(prefix.encode(), (prefix[:-1] + "0").encode(), limit=1)
            finally:
                await metadata.close()

        for url, who in ((gateway_url, gateway(objects)[0]), (reader_url, decode)):
            with environment(env_of(objects, who, pod_spec(who)["containers"][0])):
                asyncio.run(as_reader(url))
        with environment({}):
            asyncio.run(anonymous())
    finally:
        descriptor.host_id.cache_clear()
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(sockets, ignore_errors=True)
