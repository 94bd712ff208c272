# The kvstore image and the Kubernetes overlays (docs/deploy.md walks through them). Each overlay's
# settings.yaml names its image (repository, Dockerfile target, tag, digest); these targets read it.
#
#   make image OVERLAY=deploy/k8s/overlays/gpu        docker build of the overlay's image
#   make push  OVERLAY=...                            docker push, then the digest to pin
#   make pin   OVERLAY=... DIGEST=sha256:...          write the digest into settings.yaml (and the overlay)
#   make deploy-config                                every overlay's files from its settings.yaml
#   make deploy-check                                 overlays up to date, then tests/deploy
#
# DRY_RUN=1 prints the docker commands without running them. OVERLAY defaults to cpu-dev.

OVERLAY ?= deploy/k8s/overlays/cpu-dev
PYTHON ?= python3
DOCKER ?= docker
SETTINGS = $(PYTHON) deploy/k8s/settings.py

# Read from the overlay's settings.yaml when a target needs them (recursive: only then).
setting = $(or $(shell $(SETTINGS) get $(OVERLAY) $(1)),$(error $(OVERLAY): cannot read $(1) from its settings.yaml))
TARGET = $(call setting,image.target)
REF = $(call setting,image.repository):$(call setting,image.tag)

.PHONY: help image push pin deploy-config deploy-check

help:
	@sed -n '1,11s/^# \{0,1\}//p' Makefile

image:
	@echo "$(DOCKER) build --target $(TARGET) -t $(REF) ."
ifndef DRY_RUN
	@$(DOCKER) build --target $(TARGET) -t $(REF) .
endif

push:
	@echo "$(DOCKER) push $(REF)"
ifndef DRY_RUN
	@$(DOCKER) push $(REF)
	@digest=$$($(DOCKER) inspect --format '{{index .RepoDigests 0}}' $(REF) | sed 's/.*@//'); \
	 echo "pushed $(REF)@$$digest"; echo "next: make pin OVERLAY=$(OVERLAY) DIGEST=$$digest"
endif

pin:
	@test -n "$(DIGEST)" || { echo "make pin: give DIGEST=sha256:... (make push prints it)" >&2; exit 2; }
	@$(SETTINGS) pin $(OVERLAY) $(DIGEST)

deploy-config:
	@$(SETTINGS)

deploy-check:
	@$(SETTINGS) --check
	$(PYTHON) -m pytest -q -p no:cacheprovider tests/deploy
