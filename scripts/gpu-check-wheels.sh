#!/usr/bin/env bash
# Fetch, on a machine with a network, the wheels scripts/gpu-check.sh needs for its store parts on
# a GPU machine that has PyTorch but not kvstore's own dependencies (and no network):
#
#   scripts/gpu-check-wheels.sh [DIR] [PYTHON_VERSION]    (default DIR scripts/gpu_check_wheels, 3.12)
#
# The GPU check unpacks every wheel in DIR (or $GPU_CHECK_WHEELS) into its scratch directory; the
# store parts also need the generated kvstore/*/v1 modules of a built checkout. Both travel with
# the checkout (DIR is ignored by git: name it, and kvstore/admin/v1, among
# the paths a remote run carries).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/scripts/gpu_check_wheels}"
VERSION="${2:-3.12}"
mkdir -p "$DIR"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
"$PYTHON" -m pip download --only-binary=:all: --python-version "$VERSION" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --dest "$DIR" "grpcio>=1.66" "grpcio-health-checking>=1.66" "grpcio-reflection>=1.66" "protobuf>=5" \
  "blake3>=1.0" "xxhash>=3.4" "prometheus-client>=0.20" typing_extensions
ls -1 "$DIR"
