#!/bin/sh
# Make the Secrets' files of an overlay (once per cluster): the cluster secret every daemon and
# engine shares, the admin token (kvstore admin drain/evict/policy), the gateway's client API keys
# and the key Prometheus scrapes the gateway with. They land in OVERLAY/secrets/ (mode 0600, kept
# out of git by .gitignore); the overlay's secretGenerator turns them into Secrets. Existing files
# are kept, so running it again changes nothing.
#   sh deploy/k8s/gen-secrets.sh deploy/k8s/overlays/cpu-dev
set -eu
overlay=${1:?usage: gen-secrets.sh OVERLAY_DIRECTORY}
[ -f "$overlay/kustomization.yaml" ] || { echo "gen-secrets.sh: $overlay has no kustomization.yaml" >&2; exit 2; }
umask 077
mkdir -p "$overlay/secrets"
fresh() { head -c 32 /dev/urandom | base64 | tr -d '\n/+='; }
for name in cluster-secret admin-token metrics-api-key; do
  [ -s "$overlay/secrets/$name" ] || fresh > "$overlay/secrets/$name"
done
if [ ! -s "$overlay/secrets/api-keys" ]; then
  # one key a line: a client key, then the metrics key (the gateway accepts either)
  { echo "sk-$(fresh)"; cat "$overlay/secrets/metrics-api-key"; echo; } > "$overlay/secrets/api-keys"
fi
echo "secrets for $overlay in $overlay/secrets/ (client API key: first line of api-keys)"
