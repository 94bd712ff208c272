#!/bin/sh
# Make the Secrets' files of an overlay (once per cluster): the cluster secret every daemon and
# engine shares, the admin token (kvstore admin drain/evict/policy), the gateway's client API keys,
# the key Prometheus scrapes the gateway with, and etcd's passwords (root's, for the in-cluster
# etcd's auth Job only; the store daemons' user; the readers' user). Only the files the overlay's
# kustomization.yaml names are made. They land in OVERLAY/secrets/ (mode 0600, kept out of git by
# .gitignore); the overlay's secretGenerator turns them into Secrets. Existing files are kept, so
# running it again changes nothing. An etcd of your own needs its CA and client certificates there
# too (etcd-ca.crt, etcd-store.crt/.key, etcd-reader.crt/.key): those are yours to put.
#   sh deploy/k8s/gen-secrets.sh deploy/k8s/overlays/cpu-dev
set -eu
overlay=${1:?usage: gen-secrets.sh OVERLAY_DIRECTORY}
[ -f "$overlay/kustomization.yaml" ] || { echo "gen-secrets.sh: $overlay has no kustomization.yaml" >&2; exit 2; }
umask 077
mkdir -p "$overlay/secrets"
fresh() { head -c 32 /dev/urandom | base64 | tr -d '\n/+='; }
for name in cluster-secret admin-token metrics-api-key etcd-root-password etcd-store-password etcd-reader-password; do
  grep -q "secrets/$name" "$overlay/kustomization.yaml" || continue
  [ -s "$overlay/secrets/$name" ] || fresh > "$overlay/secrets/$name"
done
if [ ! -s "$overlay/secrets/api-keys" ]; then
  # one key a line: a client key, then the metrics key (the gateway accepts either)
  { echo "sk-$(fresh)"; cat "$overlay/secrets/metrics-api-key"; echo; } > "$overlay/secrets/api-keys"
fi
missing=""
for name in etcd-ca.crt etcd-store.crt etcd-store.key etcd-reader.crt etcd-reader.key; do
  if grep -q "secrets/$name" "$overlay/kustomization.yaml" && [ ! -s "$overlay/secrets/$name" ]; then
    missing="$missing $name"
  fi
done
echo "secrets for $overlay in $overlay/secrets/ (client API key: first line of api-keys)"
[ -z "$missing" ] || echo "still to put in $overlay/secrets/ (your etcd's):$missing" >&2
