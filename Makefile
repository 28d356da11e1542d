# phasewatch: `make demo` runs the main job on embedded defaults; `make test` passes the suite.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install demo up test lint typecheck bench-overhead clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

demo: install
	$(BIN)/phasewatch demo

up: install
	$(BIN)/phasewatch up

lint: install
	$(BIN)/ruff check app tests benchmarks

typecheck: install
	$(BIN)/mypy

test: install lint typecheck
	$(BIN)/pytest -q

bench-overhead: install
	$(BIN)/python benchmarks/proxy_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
