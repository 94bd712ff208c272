#!/usr/bin/env bash
# The GPU check, for the first machine with a CUDA GPU: builds the Transfer Engine's native module,
# runs the CUDA checks (device regions through the Transfer Engine; the vLLM connector's device copy
# path on CUDA tensors in every KV cache layout, without vLLM), measures device<->host bandwidth
# against torch copies, and writes one JSON. Needs only Python with PyTorch, a C++ compiler and
# libcrypto: no network, no pip, no pytest (see scripts/gpu_check.py). Bounded to 8 minutes.
#
#   scripts/gpu-check.sh [OUT.json] [--cpu-only]      (default OUT: ./gpu-check.json)
#
# Without a CUDA device (or with --cpu-only, as CI runs it) it still builds and runs the CPU checks,
# and records each CUDA check as skipped with the reason. Exit code: 0 all ran or were skipped,
# 1 a check failed, 124 the 8-minute bound was hit.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="gpu-check.json"
ARGS=()
for arg in "$@"; do
  case "$arg" in
    --cpu-only) ARGS+=("--cpu-only") ;;
    -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) OUT="$arg" ;;
  esac
done
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
if ! "$PYTHON" -c "import torch, numpy" 2>/dev/null; then
  echo "gpu-check: $PYTHON has no torch/numpy; set PYTHON to the interpreter that has PyTorch" >&2
  exit 2
fi
exec timeout --kill-after=10 "${GPU_CHECK_TIMEOUT_S:-480}" "$PYTHON" "$ROOT/scripts/gpu_check.py" --out "$OUT" "${ARGS[@]}"
