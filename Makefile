# Two commands do all the set-up (see README.md):
#   make demo   install hfaccel and run the demo (plain transformers vs hfaccel on SmolLM2-135M)
#   make test   install hfaccel with its test extras, fetch the offline test model, run the test suite
#
# torch is installed first and pinned: on a CPU machine `torch==2.13.0` is the CPU build (any looser spec
# pulls gigabytes of CUDA wheels). A torch that is already installed (e.g. a CUDA build) is kept.

PYTHON ?= python3
TORCH_PIN ?= torch==2.13.0
PIP := $(PYTHON) -m pip

.PHONY: demo test install install-dev assets gpu-wheels gpu-test gpu-bench

demo: install
	$(PYTHON) -m hfaccel.tools.cli demo

test: install-dev assets
	$(PYTHON) -m pytest -n 2 tests

install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_PIN)
	$(PIP) install -e .

install-dev:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_PIN)
	$(PIP) install -e ".[dev]"

assets:
	$(PYTHON) -m hfaccel.tools.assets

# ---- On a lent GPU machine (no network there; see docs/benchmarks.md) -------------------------------------
# Here: `make gpu-wheels` puts the wheels of what the suite needs and the GPU image lacks into wheels/ (resolved
# from the wheels' own metadata; carry wheels/ with the tree). There: `make gpu-test` (the whole suite on CUDA
# tensors, kernels compiled, 8 workers; tests needing the offline assets skip when they are absent) and
# `make gpu-bench`.
gpu-wheels:
	$(PYTHON) -m hfaccel.tools.gpu_wheels wheels

gpu-test:
	$(PIP) install -q --no-index --no-deps wheels/*.whl
	$(PIP) install -q --no-deps --no-build-isolation -e .
	HFACCEL_TEST_DEVICE=cuda $(PYTHON) -m pytest -n 8 -q -ra tests

gpu-bench:
	mkdir -p docs/bench
	$(PYTHON) -m hfaccel.tools.cli bench --output docs/bench/$$(date +%Y%m%d-%H%M)-$$(nvidia-smi --query-gpu=name --format=csv,noheader | tr ' ' '-').json
