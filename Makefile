# Two commands do all the set-up (see README.md):
#   make demo   install hfaccel and run the demo (plain transformers vs hfaccel on SmolLM2-135M)
#   make test   install hfaccel with its test extras, fetch the offline test model, run the test suite
#
# torch is installed first and pinned: on a CPU machine `torch==2.13.0` is the CPU build (any looser spec
# pulls gigabytes of CUDA wheels). A torch that is already installed (e.g. a CUDA build) is kept.

PYTHON ?= python3
TORCH_PIN ?= torch==2.13.0
PIP := $(PYTHON) -m pip

.PHONY: demo test install install-dev assets

demo: install
	$(PYTHON) -m hfaccel.cli demo

test: install-dev assets
	$(PYTHON) -m pytest -n 2 tests

install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_PIN)
	$(PIP) install -e .

install-dev:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_PIN)
	$(PIP) install -e ".[dev]"

assets:
	$(PYTHON) -m hfaccel.assets
