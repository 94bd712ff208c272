"""deploy/k8s/settings.py: every overlay's files are what its settings.yaml makes (none stale, none
edited by hand), a value changed in a settings file reaches every place that needs it, in the
overlay and in those that extend it, and bad settings are refused in one line naming the key."""
from __future__ import annotations

import copy
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .test_k8s import (ALL_CHECKS, K8S, OVERLAYS, ROOT, argv, config_data, containers, engine_config,
                       engine_container, env_of, gateway, gateway_config, kustomize, make_secrets, named, pod_spec,
                       pods, prepare, quantity, run_check, store)

yaml = pytest.importorskip("yaml", reason="the deploy extra is part of the test install (scripts/install-test-deps.sh)")


def _module():
    spec = importlib.util.spec_from_file_location("deploy_settings", K8S / "settings.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


settings = _module()


def generate(tree: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(tree / "k8s" / "settings.py"), *args], capture_output=True, text=True,
                          timeout=120)


def edit(path: Path, change) -> None:
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def test_every_overlay_is_what_its_settings_make():
    """Kills: a settings.yaml edited without regenerating its overlay (kubectl apply -k would deploy
    the old values), a generated file edited by hand (the next regeneration silently reverts it)."""
    for overlay in OVERLAYS:
        assert settings.stale(str(K8S / "overlays" / overlay)) == [], f"{overlay}: run `make deploy-config`"
    checked = subprocess.run([sys.executable, str(K8S / "settings.py"), "--check"], capture_output=True, text=True,
                             cwd=ROOT, timeout=120)
    assert checked.returncode == 0, checked.stderr


def test_stale_files_are_found(tmp_path):
    tree = prepare(tmp_path)
    gpu = tree / "k8s" / "overlays" / "gpu"
    edit(gpu / "settings.yaml", lambda s: s["store"].update(dram="32GiB"))
    (tree / "k8s" / "overlays" / "cpu-dev" / "gateway.json").write_text("{}\n")
    checked = generate(tree, "--check")
    assert checked.returncode == 1
    assert "gpu: serve.toml, workloads.yaml differ" in checked.stderr  # the DRAM tier and the pod's memory
    assert "gpu-external-etcd: serve.toml, workloads.yaml differ" in checked.stderr  # it extends gpu
    assert "cpu-dev: gateway.json differ" in checked.stderr
    assert generate(tree).returncode == 0 and generate(tree, "--check").returncode == 0


def test_a_settings_change_reaches_every_place(tmp_path):
    """gpu's model, sizes, counts, cluster, block size, image and Prometheus namespace changed in its
    settings.yaml alone reach, once regenerated, every place in gpu and in gpu-external-etcd (which
    extends it) that needs them, and every invariant check still holds. Kills: a value taken from
    anywhere but the settings (a second copy that stays behind)."""
    tree = prepare(tmp_path)
    digest = "sha256:" + "ab" * 32

    def change(s):
        s["model"].update(repo="acme/Llama-9B", name="llama-9b", block_size=32)
        s["store"].update(dram="96GiB", disk="1TiB", replicas=3)
        s["engines"].update(prefill=1, decode=3, memory="48GiB", shm="8GiB")
        s["image"].update(repository="registry.example.com/ml/kvstore", digest=digest)
        s["monitoring"]["namespace"] = "observability"
        s["cluster"] = "prod"

    edit(tree / "k8s" / "overlays" / "gpu" / "settings.yaml", change)
    done = generate(tree)
    assert done.returncode == 0, done.stderr
    for overlay in ("gpu", "gpu-external-etcd"):
        objects = kustomize.build(str(tree / "k8s" / "overlays" / overlay))
        where = overlay
        model = config_data(objects, "kvstore-model")
        assert model == {"path": "/models/acme--Llama-9B", "name": "llama-9b", "repo": "acme/Llama-9B"}, where
        decode = named(objects, "StatefulSet", "vllm-decode")
        prefill = named(objects, "StatefulSet", "vllm-prefill")
        assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (1, 3), where
        for sts in (prefill, decode):
            args = argv(objects, sts, engine_container(sts))
            assert args[args.index("serve") + 1] == "/models/acme--Llama-9B", where
            assert args[args.index("--served-model-name") + 1] == "llama-9b", where
            cfg = engine_config(objects, sts)
            assert cfg["block-size"] == 32 and cfg["kv-transfer-config"]["kv_connector_extra_config"]["cluster"] == "prod"
            limits = engine_container(sts)["resources"]["limits"]
            assert quantity(limits["memory"]) == 48 << 30, where  # GPU engines: the KV cache is not host memory
            shm = next(v for v in pod_spec(sts)["volumes"] if v["name"] == "shm")
            assert shm["emptyDir"]["sizeLimit"] == "8Gi", where
            fetch = next(c for c in containers(sts) if c["name"] == "fetch-model")
            assert env_of(objects, sts, fetch)["MODEL_REPO"] == "acme/Llama-9B", where
        cfg = gateway_config(objects)
        assert cfg["model_dir"] == "/models/acme--Llama-9B" and cfg["block_tokens"] == 32, where
        assert cfg["prefill"] == ["http://vllm-prefill-0.vllm-prefill:8000"], where
        assert cfg["decode"] == [f"http://vllm-decode-{i}.vllm-decode:8000" for i in range(3)], where
        assert set(cfg["kv_events"]) == set(cfg["prefill"] + cfg["decode"]), where
        deployment, gw = gateway(objects)
        gw_args = argv(objects, deployment, gw)
        assert gw_args[gw_args.index("--cluster") + 1] == "prod", where
        fetch = next(c for c in containers(deployment) if c["name"] == "fetch-model")
        assert env_of(objects, deployment, fetch)["MODEL_REPO"] == "acme/Llama-9B", where
        toml = config_data(objects, "kvstore-store-config")["serve.toml"]
        assert 'dram = "96GiB"' in toml and 'disk-size = "1TiB"' in toml and "replicas = 3" in toml, where
        _, daemon = store(objects)
        assert daemon["resources"]["requests"]["memory"] == daemon["resources"]["limits"]["memory"] == "98Gi", where
        assert config_data(objects, "kvstore-cluster")["cluster"] == "prod", where
        images = {c["image"] for w in pods(objects) for c in containers(w) if "etcd" not in c["image"]}
        assert images == {f"registry.example.com/ml/kvstore:0.1.0-cuda@{digest}"}, where
        for policy in ("kvstore-scrape-store", "kvstore-scrape-engines"):
            source = named(objects, "NetworkPolicy", policy)["spec"]["ingress"][0]["from"][0]
            assert source["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "observability"}, where
        job = named(objects, "Job", "kvstore-etcd-auth")
        if job is not None:
            job_args = argv(objects, job, pod_spec(job)["containers"][0])
            assert job_args[job_args.index("--cluster") + 1] == "prod", where
        for check in ALL_CHECKS:
            run_check(check, copy.deepcopy(objects), tmp_path / overlay / check, tree)


def test_colocated_and_cpu_sizes(tmp_path):
    """cpu-dev-colocated extends cpu-dev: its engines are kv_both and alone (no prefill pool), and a
    KV cache or DRAM size changed in cpu-dev reaches both, in the engine config and in the pods'
    memory, which holds it."""
    tree = prepare(tmp_path)
    edit(tree / "k8s" / "overlays" / "cpu-dev" / "settings.yaml",
         lambda s: (s["engines"].update(kv_cache="3GiB"), s["store"].update(dram="2GiB")))
    assert generate(tree).returncode == 0
    for overlay in ("cpu-dev", "cpu-dev-colocated"):
        objects = kustomize.build(str(tree / "k8s" / "overlays" / overlay))
        decode = named(objects, "StatefulSet", "vllm-decode")
        cfg = engine_config(objects, decode)
        assert cfg["kv-cache-memory-bytes"] == 3 << 30
        assert quantity(engine_container(decode)["resources"]["limits"]["memory"]) == (2 << 30) + (3 << 30)
        assert quantity(store(objects)[1]["resources"]["limits"]["memory"]) == 3 << 30
        colocated = overlay.endswith("colocated")
        assert (named(objects, "StatefulSet", "vllm-prefill") is None) == colocated
        assert cfg["kv-transfer-config"]["kv_role"] == ("kv_both" if colocated else "kv_consumer")
        assert (decode["spec"]["replicas"], len(gateway_config(objects)["decode"])) == ((2, 2) if colocated else (1, 1))


@pytest.mark.parametrize("change, key", [
    (lambda s: s["engines"].update(replicas=2), "engines.replicas: unknown setting"),
    (lambda s: s["image"].update(digest="latest"), "image.digest"),
    (lambda s: s["image"].update(repository="kvstore:0.1.0-cpu"), "image.repository"),
    (lambda s: s["engines"].update(gpus=1), "image.target"),
    (lambda s: s["store"].update(dram="lots"), "store.dram"),
    (lambda s: s["store"].update(memory_overhead="256MiB"), "store.memory_overhead"),
    (lambda s: s["engines"].pop("kv_cache"), "engines.kv_cache"),
    (lambda s: s["engines"].update(prefill=0), "engines.prefill"),
    (lambda s: s["etcd"].update(mode="external"), "etcd.endpoints"),
    (lambda s: s.update(namespace="Kvstore_Dev"), "namespace"),
    (lambda s: s.pop("monitoring"), "monitoring"),
])
def test_bad_settings_are_refused_in_one_line(tmp_path, change, key):
    """Kills: a settings mistake that renders anyway (an unpinned image, a typo'd key silently
    ignored, a GPU count on the CPU image, a daemon with no room beside its DRAM tier)."""
    tree = prepare(tmp_path)
    path = tree / "k8s" / "overlays" / "cpu-dev" / "settings.yaml"
    edit(path, change)
    done = generate(tree, str(path.parent))
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "settings.yaml" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_pin_writes_the_digest_once_for_every_overlay_that_uses_it(tmp_path):
    tree = prepare(tmp_path)
    digest = "sha256:" + "cd" * 32
    path = tree / "k8s" / "overlays" / "cpu-dev" / "settings.yaml"
    comments = [line for line in path.read_text().splitlines() if line.lstrip().startswith("#")]
    done = generate(tree, "pin", str(path.parent), digest)
    assert done.returncode == 0, done.stderr
    assert [line for line in path.read_text().splitlines() if line.lstrip().startswith("#")] == comments
    assert yaml.safe_load(path.read_text())["image"]["digest"] == digest
    assert generate(tree, "--check").returncode == 0  # cpu-dev-colocated, which extends it, regenerated too
    for overlay in ("cpu-dev", "cpu-dev-colocated"):
        objects = kustomize.build(str(tree / "k8s" / "overlays" / overlay))
        assert store(objects)[1]["image"] == f"kvstore:0.1.0-cpu@{digest}"
    refused = generate(tree, "pin", str(tree / "k8s" / "overlays" / "cpu-dev-colocated"), digest)
    assert refused.returncode == 2 and "cpu-dev/settings.yaml" in refused.stderr  # pin the overlay that sets it
    assert generate(tree, "pin", str(path.parent), "v1.2.3").returncode == 2


def test_an_overlay_of_your_own(tmp_path):
    """An overlay folder elsewhere (a settings.yaml extending one of ours) renders with paths to base
    and components that resolve from where it is."""
    tree = prepare(tmp_path)
    mine = tmp_path / "mine" / "prod"
    mine.mkdir(parents=True)
    (mine / "settings.yaml").write_text(
        f"extends: {tree / 'k8s' / 'overlays' / 'gpu' / 'settings.yaml'}\nnamespace: prod\n")
    assert generate(tree, str(mine)).returncode == 0
    make_secrets(mine, tree / "k8s" / "gen-secrets.sh")
    objects = kustomize.build(str(mine))
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"prod"}
    assert json.dumps(objects).count("kvstore-etcd-auth") > 0
    assert re.search(r"\.\./", (mine / "kustomization.yaml").read_text())


def test_kustomize_py_refuses_a_stale_overlay(tmp_path):
    """Kills: rendering (and applying) an overlay whose files say other than its settings."""
    tree = prepare(tmp_path)
    overlay = tree / "k8s" / "overlays" / "cpu-dev"
    render = [sys.executable, str(tree / "k8s" / "kustomize.py"), str(overlay)]
    assert subprocess.run(render, capture_output=True, text=True, timeout=120).returncode == 0
    edit(overlay / "settings.yaml", lambda s: s["engines"].update(decode=2))
    done = subprocess.run(render, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "make deploy-config" in done.stderr and not done.stdout
