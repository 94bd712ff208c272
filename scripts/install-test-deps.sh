#!/bin/sh
# System packages the tests need (Debian/Ubuntu): a real etcd for the integration tests.
# Idempotent: installs only what is missing.
set -eu
missing=""
command -v etcd >/dev/null 2>&1 || missing="$missing etcd-server"
[ -z "$missing" ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing
