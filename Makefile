# Two commands do everything on a fresh machine: `make run` and `make test`.
# Each creates .venv if missing, installs the pinned environment, and makes the
# embedded models; a second run reuses all of it.

SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LOCK := requirements/cpu.lock.txt
MODELS := .cache/models
# torch==2.13.0+cpu is published on PyTorch's CPU wheel index, not on PyPI. pip
# looks torch alone up there (any x86-64 Linux host); a wheel folder or index in
# pip's own configuration (find-links, extra-index-url) is searched as well.
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu

export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_TARGET_DEVICE ?= cpu
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test test-engines test-services install postgres proto check-contract models bench clean compose-check compose-test

run: install models
	$(PY) -m tools.run_demo --model $(MODELS)/tiny-llama $(RUN_ARGS)

# Two streams run side by side, each output line prefixed with its stream:
# test-engines (the capture tests' vLLM engines inside the pytest process, then
# the multi-worker, multi-node and half-precision engines of tests/processes, in
# a second process so their abort latency is measured on a process that never
# hosted an engine) and test-services (everything else, the rest of
# tests/processes among it, so the two streams take about as long). An engine's
# start-up keeps one core busy, so two streams use both. Each pytest process
# takes ports from a range of its own, below the kernel's ephemeral ports
# (tools/processes.free_port).
ENGINE_PROCESS_TESTS := $(addprefix tests/processes/,test_half_precision.py test_multinode.py \
	test_tokens_ahead.py test_topologies.py)

test: install models postgres
	@$(MAKE) --no-print-directory -j2 test-engines test-services

test-engines:
	@set -o pipefail; { \
		UNDERCURRENT_TEST_PORTS=20000-23999 $(PY) -m pytest tests/capture $(PYTEST_ARGS) && \
		UNDERCURRENT_TEST_PORTS=24000-27999 $(PY) -m pytest $(ENGINE_PROCESS_TESTS) $(PYTEST_ARGS); \
	} 2>&1 | sed -u 's/^/engines  | /'

test-services:
	@set -o pipefail; \
	UNDERCURRENT_TEST_PORTS=28000-31999 $(PY) -m pytest --ignore=tests/capture \
		$(addprefix --ignore=,$(ENGINE_PROCESS_TESTS)) $(PYTEST_ARGS) 2>&1 | sed -u 's/^/services | /'

install: $(STAMP)

# The verdict log's tests start a real PostgreSQL server: Debian's postgresql
# package (initdb, pg_ctl), installed here when missing and apt-get can (root).
postgres:
	@command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
		  apt-get install -y -qq postgresql >/dev/null; } || \
		echo "PostgreSQL server not installed (apt-get install postgresql): its verdict-log tests will skip"

$(STAMP): $(LOCK) pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "Installing the pinned environment into $(VENV) (first run: a few minutes, ~3.5 GB)..."
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-deps --extra-index-url $(TORCH_INDEX_URL) \
		"$$(grep -E '^torch==' $(LOCK))"
	$(PY) -m pip install --quiet --no-deps -r $(LOCK)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $(STAMP)

models: install $(MODELS)/tiny-llama/config.json $(MODELS)/tiny-qwen3/config.json

$(MODELS)/%/config.json:
	$(PY) -m common.embedded_model --arch $* --out $(MODELS)/$*

# Regenerates the checked-in stubs. tests/test_proto_stubs.py fails when they are stale.
proto: install
	$(PY) -m common.protogen

# The contract lints clean (buf lint) and breaks nothing the released contract
# promised (buf breaking against proto/released/undercurrent-v1.binpb); `make
# test` runs the same checks (tests/foundation/test_proto_lint.py).
check-contract: install
	$(PY) -m tools.contract check

bench: install models
	$(PY) -m bench.stream_throughput
	$(PY) -m bench.capture_overhead --model $(MODELS)/tiny-llama
	$(PY) -m bench.abort_latency --model $(MODELS)/tiny-llama

# compose.yaml and its GPU and two-node overlays against the Compose
# Specification's JSON schema (no Docker needed; `make test` runs the same check).
compose-check: install
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.compose-spec compose.yaml compose.gpu.yaml \
		compose.multinode.yaml

# The real thing on a Docker daemon (started if none runs): builds both images,
# `docker compose up --wait`, a Generate with a probe, scaling, `down -v`.
compose-test: install
	$(PY) -m tools.compose_test $(COMPOSE_TEST_ARGS)

clean:
	rm -rf $(VENV) .cache
