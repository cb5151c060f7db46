# Two commands set up everything on a fresh machine:
#   make demo   - create .venv, install, run the main job (a real intervention on SmolLM2)
#   make test   - create .venv, install, run the whole test suite (unit + marked integration tests)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.asyncinterp-installed

.PHONY: setup demo test test-fast test-vllm bench bench-quick bench-vllm docs clean

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)
	@touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/asyncinterp demo

test: setup
	bash scripts/run_tests.sh $(VENV)

test-fast: setup
	$(PY) -m pytest -q -m "not smollm2 and not vllm and not slow" tests

# API reference from the docstrings (pdoc, warnings are errors) -> build/api/index.html
docs: setup
	$(PY) -W error scripts/build_api_docs.py

# vLLM (CPU): scripts/install.sh installs it into $(VENV) through scripts/install_vllm.sh
test-vllm: setup
	$(PY) -m pytest -q -m vllm tests

bench-vllm: setup
	$(PY) benchmarks/vllm.py --out vllm

# Benchmarks run in their own venv with nnsight (never a dependency of the library).
BENCH_VENV ?= .venv-bench
$(BENCH_VENV)/.installed: benchmarks/requirements-bench.txt pyproject.toml constraints.txt
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BENCH_VENV)/bin/python -m pip install -q -r benchmarks/requirements-bench.txt
	$(BENCH_VENV)/bin/python -m pip install -q -c constraints.txt -e .
	@touch $@

bench: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python benchmarks/overhead.py --out latest

bench-quick: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python benchmarks/overhead.py --quick

clean:
	rm -rf $(VENV) build *.egg-info
