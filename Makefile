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
# Here: `make gpu-wheels` puts the pure-Python packages the GPU machine lacks into wheels/ (carried with the
# tree). There: `make gpu-test` (the suite on CUDA tensors, kernels compiled) and `make gpu-bench`.
GPU_PY ?= 3.12
GPU_WHEELS := pytest pluggy iniconfig packaging hypothesis sortedcontainers attrs rich markdown-it-py mdurl \
	pygments gguf filelock tqdm pyyaml pytest-xdist execnet fastapi starlette uvicorn h11 click \
	prometheus-client openai httpx httpcore anyio sniffio idna certifi distro jiter pydantic pydantic-core \
	annotated-types typing-inspection typing-extensions

gpu-wheels:
	$(PIP) download --no-deps --only-binary :all: --python-version $(GPU_PY) -d wheels $(GPU_WHEELS)

gpu-test:
	$(PIP) install --no-index --find-links wheels $(GPU_WHEELS) >/dev/null
	$(PIP) install --no-deps --no-build-isolation -e . >/dev/null
	HFACCEL_TEST_DEVICE=cuda $(PYTHON) -m pytest -q tests

gpu-bench:
	mkdir -p docs/bench
	$(PYTHON) -m hfaccel.tools.cli bench --output docs/bench/$$(date +%Y%m%d-%H%M)-$$(nvidia-smi --query-gpu=name --format=csv,noheader | tr ' ' '-').json
