# Two commands set up everything on a fresh machine:
#   make demo   - create .venv, install, run the main job (a real intervention on SmolLM2)
#   make test   - create .venv, install, run the whole test suite (unit + marked integration tests)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.asyncinterp-installed

.PHONY: setup demo test test-fast bench bench-serving vllm clean

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

bench: setup
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
