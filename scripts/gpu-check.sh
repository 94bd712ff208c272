#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA GPU: builds the Transfer Engine's native module, runs the
# CUDA checks (device regions; the connector's per-block and batched copy paths in every KV cache
# layout, byte for byte), measures a step of Llama-3-8B-shaped KV through the batched path and the
# Transfer Engine's CUDA regions against pinned torch copies, a step and a 1 GiB hand-off through an
# embedded kvstore, and a Llama-3-8B-shaped layer stack (the h200-llama3-8b-measured profile), and
# writes one JSON. Needs Python with PyTorch, a C++ compiler and libcrypto; no network (kvstore's own
# dependencies as wheels: GPU_CHECK_WHEELS, scripts/gpu-check-wheels.sh). Bounded to 8 minutes.
#
#   scripts/gpu-check.sh [OUT.json] [--cpu-only]      (default OUT: ./gpu-check.json)
#
# Without CUDA (or with --cpu-only, as CI runs it) the CPU parts run small and each CUDA part is
# recorded as skipped with the reason. Exit code: 0 all ran or were skipped, 1 a check failed, 124
# the 8-minute bound was hit (the JSON then holds what ran before).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="gpu-check.json"
ARGS=()
for arg in "$@"; do
  case "$arg" in
    --cpu-only) ARGS+=("--cpu-only") ;;
    -h|--help) sed -n '2,14p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) OUT="$arg" ;;
  esac
done
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
if ! "$PYTHON" -c "import torch, numpy" 2>/dev/null; then
  echo "gpu-check: $PYTHON has no torch/numpy; set PYTHON to the interpreter that has PyTorch" >&2
  exit 2
fi
exec timeout --kill-after=10 "${GPU_CHECK_TIMEOUT_S:-480}" "$PYTHON" "$ROOT/scripts/gpu_check.py" --out "$OUT" "${ARGS[@]}"
