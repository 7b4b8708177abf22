# Two commands do all the set-up (see README.md):
#   make demo   install hfaccel and run the demo (plain transformers vs hfaccel on SmolLM2-135M)
#   make test   build the test environments inside the clone, lint (ruff), fetch the offline test model, run the
#               test suites
#
# torch is installed first and pinned: on a CPU machine `torch==2.13.0` is the CPU build (any looser spec
# pulls gigabytes of CUDA wheels). A torch that is already installed (e.g. a CUDA build) is kept.
#
# `make test` runs the suite twice, each in a virtual environment of its own inside the clone, so that what a new
# user installs today is what is tested: .venv gets the newest releases of everything but torch (upgraded
# eagerly on every run, so an old transformers left there cannot hide a break), .venv-lowest the floors
# pyproject.toml declares for transformers and triton (what the GPU machines run) and peft, for the model-level
# tests; numpy below 2.4 there, where triton 3.6's interpreter (what tests on a CPU run) works ("only 0-dimensional
# arrays can be converted to Python scalars" under 2.4). The floor of torch (2.11, the GPU machines') is tested there
# only (make gpu-test): the only CPU torch wheel here is 2.13.

PYTHON ?= python3
TORCH_PIN ?= torch==2.13.0
PIP := $(PYTHON) -m pip
VENV ?= .venv
VENV_LOWEST ?= .venv-lowest
LOWEST_PINS ?= transformers==5.17.0 peft==0.18.0
# with a CPU torch only: a CUDA torch pins the triton it was built with
LOWEST_CPU_PINS ?= triton==3.6.0 "numpy<2.4"
# What the lowest transformers is tested on: where hfaccel meets transformers' code (accelerate, generate's loop and
# arguments, the model forwards the runner, speculative decoding and LoRA layers drive, the engine's exactness
# against generate), and that the test processes' interpreter speed-up applies to triton's floor too; the rest of the
# engine, the server and the kernels do not depend on the transformers release — except Llama 4's images through the
# engine, which only the floor can check (transformers 5.24's own Llama 4 image-text forward raises), and images under
# tensor parallelism, whose pixels the floor's ranks each encode in their forward (5.24's leader encodes them ahead).
MODEL_TESTS ?= tests/hf tests/runner tests/engine/test_engine.py tests/engine/test_families_engine.py tests/speculative \
	tests/lora tests/test_interpreter.py "tests/engine/test_images.py::test_one_steps_images_are_encoded_together[llama4]" \
	"tests/engine/test_images.py::test_prompts_repeating_images_take_prefix_hits_past_them[llama4]" \
	"tests/tp/test_tp_images.py::test_image_requests_under_tp_equal_single_process[eager steps-qwen2_5_vl]" \
	"tests/tp/test_tp_images.py::test_image_requests_under_tp_equal_single_process[static steps-qwen2_5_vl]" \
	tests/tp/test_tp_images.py::test_generate_with_images_under_tp_equals_single_process
MODEL_TESTS_SKIP ?= --deselect tests/hf/test_compile_cache.py
PYTEST_WORKERS ?= 2

.PHONY: demo test test-newest test-lowest suite-newest suite-lowest environments requirements-newest \
	requirements-lowest venv requirements editable install assets gpu-wheels gpu-install gpu-test gpu-smoke gpu-bench \
	gpu-round gpu-round-1 gpu-round-2 gpu-round-3 gpu-round-4

demo: install
	$(PYTHON) -m hfaccel.tools.cli demo

test: environments
	$(MAKE) --no-print-directory suite-newest
	$(MAKE) --no-print-directory suite-lowest

test-newest: requirements-newest
	$(MAKE) --no-print-directory editable VENV=$(VENV)
	$(MAKE) --no-print-directory suite-newest

test-lowest: requirements-lowest
	$(MAKE) --no-print-directory editable VENV=$(VENV_LOWEST)
	$(MAKE) --no-print-directory suite-lowest

suite-newest:
	$(VENV)/bin/ruff check hfaccel tests
	$(VENV)/bin/ruff format --check hfaccel tests
	$(VENV)/bin/python -m hfaccel.tools.assets
	$(VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) --durations=15 tests

suite-lowest:
	$(VENV_LOWEST)/bin/python -m hfaccel.tools.assets
	$(VENV_LOWEST)/bin/python -m pytest -n $(PYTEST_WORKERS) --durations=10 $(MODEL_TESTS) $(MODEL_TESTS_SKIP)

# Both test environments: their requirements installed at once (pip works on one core), then hfaccel into each in
# turn (its editable build writes hfaccel.egg-info into the tree).
environments:
	$(MAKE) --no-print-directory -j2 -Orecurse requirements-newest requirements-lowest
	$(MAKE) --no-print-directory editable VENV=$(VENV)
	$(MAKE) --no-print-directory editable VENV=$(VENV_LOWEST)

requirements-newest:
	$(MAKE) --no-print-directory requirements VENV=$(VENV)

requirements-lowest:
	$(MAKE) --no-print-directory requirements VENV=$(VENV_LOWEST) PINS="$(LOWEST_PINS)"
	if $(VENV_LOWEST)/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
		$(VENV_LOWEST)/bin/pip install $(LOWEST_CPU_PINS) && $(VENV_LOWEST)/bin/python -c \
		"import numpy, triton; print('$(VENV_LOWEST): triton', triton.__version__, 'numpy', numpy.__version__)"; fi

# A virtual environment $(VENV) with hfaccel (editable) and its test extras at their newest releases (or at
# $(PINS)); the torch it has is kept.
venv:
	$(MAKE) --no-print-directory requirements
	$(MAKE) --no-print-directory editable

# $(VENV) with what `pip install -e ".[dev]"` would install besides hfaccel (pyproject.toml's requirements and its
# dev extras', upgraded eagerly). pip would compile the installed modules to bytecode one file at a time; they are
# compiled afterwards on every core instead (the same files: 40 s rather than 70 on two cores; as pip does, a file
# written for another Python, such as torch's py312_intrinsics, is skipped).
requirements:
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(VENV)/bin/pip install --no-compile $(TORCH_PIN)
	$(VENV)/bin/python -c "$$DEV_REQUIREMENTS" > $(VENV)/dev-requirements.txt
	$(VENV)/bin/pip install --no-compile --upgrade --upgrade-strategy eager -r $(VENV)/dev-requirements.txt \
		"torch==$$($(VENV)/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')" $(PINS)
	$(VENV)/bin/python -c "import compileall, sysconfig; \
		compileall.compile_dir(sysconfig.get_path('purelib'), quiet=2, workers=0)"

# hfaccel itself, editable, into $(VENV)
editable:
	$(VENV)/bin/pip install --no-deps -e .
	$(VENV)/bin/python -c "import torch, transformers, triton; print('$(VENV):', 'torch', torch.__version__, \
		'transformers', transformers.__version__, 'triton', triton.__version__)"

# hfaccel's requirements and its dev extras' from pyproject.toml, one per line (the extras of hfaccel that an extra
# names expanded in place)
define DEV_REQUIREMENTS
import re
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
def expanded(requirements):
    for requirement in requirements:
        own = re.fullmatch(r"hfaccel\[(.+)\]", requirement)
        yield from (r for extra in own[1].split(",") for r in expanded(extras[extra])) if own else [requirement]
print("\n".join(expanded([*project["dependencies"], *extras["dev"]])))
endef
export DEV_REQUIREMENTS

install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_PIN)
	$(PIP) install -e .

assets:
	$(PYTHON) -m hfaccel.tools.assets

gpu-wheels: install assets
	$(PYTHON) -m hfaccel.tools.gpu_wheels wheels

# ---- On a lent GPU machine (no network there; see docs/benchmarks.md) -------------------------------------
# Here: `make gpu-wheels` puts the wheels of what the suite needs and the GPU image lacks into wheels/ (resolved
# from the wheels' own metadata; carry wheels/ with the tree). There, each command within the 10 minutes a call
# may take: `make gpu-smoke` first (about 7 minutes; each step runs whatever the one before gave), then
# `make gpu-test PART=1/3` (2/3, 3/3: the suite on CUDA in three parts, whole test files each, 4 workers), then
# `make gpu-bench` and the tune sweeps.
GPU_PART ?= $(PART)
gpu-install:
	$(PIP) install -q --no-index --no-deps wheels/*.whl
	$(PIP) install -q --no-deps --no-build-isolation -e .

gpu-smoke: gpu-install
	-HFACCEL_TEST_DEVICE=cuda timeout 150 $(PYTHON) -m pytest -q -n 6 -ra --tb=short \
		tests/kernels/test_paged_attention.py tests/kernels/test_flash_attention.py tests/kernels/test_w4a16.py \
		tests/kernels/test_keyed_race.py tests/kernels/test_lora.py -k "not sm90 and not interpret"
	-HFACCEL_TEST_DEVICE=cuda timeout 240 $(PYTHON) -m pytest -q -n 4 -ra --tb=short --timeout 150 \
		tests/hf/test_decode.py tests/engine/test_async_scheduling.py \
		"tests/engine/test_engine.py::test_seeded_requests_keep_the_decode_graphs_and_draw_inside_them" \
		"tests/hf/test_exactness.py::test_greedy_generate_matches_transformers" \
		"tests/hf/test_families.py::test_triton_kernels_give_transformers_tokens" \
		"tests/engine/test_families_engine.py::test_exactness_with_preemption_and_chunked_prefill"
	-TORCH_LOGS=recompiles,graph_breaks timeout 150 $(PYTHON) -m hfaccel.tools.smoke --model llama-3.2-1b
	-timeout 170 $(PYTHON) -m hfaccel.tools.cli bench decode --model llama-3.2-1b --dtype float16 --batch 1 --batch 16 --profile

# The figures a lent GPU still owes, in order of value, one device call per round (each under 10 minutes; a 15-minute
# lease fits one round and its rerun): every step under its own timeout, printing as it goes, its JSON and log under
# $(OUT). Round 1: the families' tokens through captured steps on CUDA (hybrid state and device-fed positions move on
# once when a size is first captured), structured throughput (never measured), fp8 (issue 50), a mixture of experts
# at batch 1 (issue 47's mirror row: batch 1 against batch 2, the roofline counting the experts reached). Round 2:
# vision-language (issue 49), the fp8 KV cache in the engine, the fp8 tune for decode. Round 3: int4 and paged
# decode again after tuning. Round 4: multi-head latent attention (issue 47: the latent-space kernels on CUDA, head
# dim 576, and the compiled decode step; then DeepSeek-V2-Lite- and DeepSeek-V3-shaped decode at batch 1 and 16
# against transformers' fastest path: 16 and 128 query heads over the latents).
# Copy each table into docs/benchmarks.md (date, device, commit, command) and commit the JSON and tuned tables.
OUT ?= bench-results
ROUND ?= 1
CLI := timeout --kill-after=10
BENCH = $(PYTHON) -m hfaccel.tools.cli bench
gpu-round: gpu-install
	mkdir -p $(OUT)
	nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $(OUT)/gpu.txt
	-git rev-parse --short HEAD | tee -a $(OUT)/gpu.txt
	$(MAKE) --no-print-directory gpu-round-$(ROUND)

gpu-round-1:
	-HFACCEL_TEST_DEVICE=cuda $(CLI) 100 $(PYTHON) -m pytest -q -n 4 -ra --tb=short tests/runner/test_graphs.py \
		tests/hf/test_families.py::test_triton_kernels_give_transformers_tokens \
		tests/engine/test_failures.py::test_a_device_side_assert_loses_the_cuda_device_and_out_of_memory_does_not \
		2>&1 | tee $(OUT)/families.log
	-$(CLI) 140 $(BENCH) structured --model llama-3.2-1b --tokenizer wheels/smollm2-tokenizer \
		--output $(OUT)/structured.json 2>&1 | tee $(OUT)/structured.log
	-$(CLI) 200 $(BENCH) fp8 --dtype bfloat16 --output $(OUT)/fp8.json 2>&1 | tee $(OUT)/fp8.log
	-$(CLI) 120 $(BENCH) decode --model qwen3.5-35b-a3b --layers 4 --dtype bfloat16 --batch 1 --batch 2 \
		--new-tokens 32 --prompt-len 128 --output $(OUT)/decode-qwen35-moe.json 2>&1 | tee $(OUT)/decode-moe.log

gpu-round-2:
	-$(CLI) 280 $(BENCH) vlm --dtype bfloat16 --output $(OUT)/vlm.json 2>&1 | tee $(OUT)/vlm.log
	-$(CLI) 200 $(BENCH) engine --model llama-3.2-1b --kv-cache-dtype fp8 --output $(OUT)/engine-fp8kv.json \
		2>&1 | tee $(OUT)/engine-fp8kv.log
	-$(CLI) 100 $(PYTHON) -m hfaccel.tools.cli tune --op fp8 --model llama-3.1-8b --m 1 --m 16 --dtype bfloat16 \
		2>&1 | tee $(OUT)/tune-fp8.log; cp hfaccel/kernels/configs/*.json $(OUT)/

gpu-round-3:
	-$(CLI) 240 $(PYTHON) -m hfaccel.tools.cli tune --op w4a16 --model llama-3.1-8b --m 1 --m 16 --dtype float16 \
		2>&1 | tee $(OUT)/tune-w4a16.log; cp hfaccel/kernels/configs/*.json $(OUT)/
	-$(CLI) 150 $(BENCH) int4 --dtype float16 --batch 1 --new-tokens 64 --output $(OUT)/int4.json 2>&1 \
		| tee $(OUT)/int4.log
	-$(CLI) 120 $(BENCH) paged --dtype float16 --output $(OUT)/paged.json 2>&1 | tee $(OUT)/paged.log

gpu-round-4:
	-HFACCEL_TEST_DEVICE=cuda $(CLI) 120 $(PYTHON) -m pytest -q -n 4 -ra --tb=short tests/attention/test_latent.py \
		"tests/hf/test_families.py::test_latent_attention_serves_speculative_decoding_and_fp8_pools" \
		"tests/hf/test_families.py::test_latent_attention_decodes_compiled_in_the_latent_space" \
		2>&1 | tee $(OUT)/latent.log
	-$(CLI) 200 $(BENCH) decode --model deepseek-v2-lite --layers 4 --dtype bfloat16 --batch 1 --batch 16 \
		--new-tokens 32 --prompt-len 128 --output $(OUT)/decode-mla.json 2>&1 | tee $(OUT)/decode-mla.log
	-$(CLI) 140 $(BENCH) decode --model deepseek-v3 --layers 2 --dtype bfloat16 --batch 1 --batch 16 \
		--new-tokens 32 --prompt-len 128 --output $(OUT)/decode-mla-128-heads.json 2>&1 | tee $(OUT)/decode-mla-v3.log
	-$(CLI) 160 $(BENCH) decode --model deepseek-v32 --layers 2 --dtype bfloat16 --batch 1 --batch 8 \
		--new-tokens 16 --prompt-len 2560 --output $(OUT)/decode-dsa.json 2>&1 | tee $(OUT)/decode-dsa.log

gpu-test: gpu-install
	HFACCEL_TEST_DEVICE=cuda HFACCEL_TEST_PART=$(GPU_PART) $(PYTHON) -m pytest -n 4 -q -ra tests

gpu-bench:
	mkdir -p docs/bench
	$(PYTHON) -m hfaccel.tools.cli bench --output docs/bench/$$(date +%Y%m%d-%H%M)-$$(nvidia-smi --query-gpu=name --format=csv,noheader | tr ' ' '-').json
