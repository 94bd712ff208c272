#!/bin/sh
# Everything the tests need on a fresh Debian/Ubuntu machine: a real etcd for the integration
# tests, then kvstore with its test and vLLM extras. Idempotent.
set -eu
cd "$(dirname "$0")/.."
if ! command -v etcd >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq etcd-server
fi
sh scripts/install.sh test gateway ucx  # ucx: ~70 MB of wheels, ~20 s; the UCX transport tests need it
