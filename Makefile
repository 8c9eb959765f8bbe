# Two commands do all the set-up on a fresh CPU machine (see README.md):
#   make smoke      -- the main job: CPU smoke training with the megamoe converter (torchrun)
#   make test       -- the test suite (what CI runs through .ci/run)
#   make test-fast  -- the same without the slow training runs (pytest -m "not slow")
# All create .venv and install everything first (the package, and its [test,ab] extras).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megamoe-installed
ASSETS := outputs/assets/megamoe_tiny
CPU_ENV := MEGAMOE_CPU=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME=$(CURDIR)/outputs/hf_home
NPROC ?= 1
SMOKE_TOML := train_configs/qwen3_moe_tiny_cpu.toml

.PHONY: cuda-cache setup smoke test test-fast ab ab-ep2 ab-ep2-fp8 ab-fp8 bench gpu-check deepgemm clean

# torch is pinned to the CPU build that the machine image carries (a plain `torch` from PyPI
# would pull a multi-GB CUDA build onto a machine with no GPU). The tests need the A/B tool's
# extra (matplotlib) besides pytest; the library itself needs neither.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,ab]'
	touch $@

setup: $(STAMP)

$(ASSETS)/.megamoe_assets.json: $(STAMP)
	$(PY) -m torchtitan_megamoe.assets --out $(ASSETS)

# The main job: real TorchTitan training through stock torchrun with the converter on.
smoke: setup $(ASSETS)/.megamoe_assets.json
	$(CPU_ENV) $(VENV)/bin/torchrun --nproc_per_node $(NPROC) -m torchtitan.train \
		--job.config_file $(SMOKE_TOML)

# No MEGAMOE_CPU here: the tests that train set it in their own torchrun children; exported to
# pytest it would patch TorchTitan in the test process itself.
test: setup $(ASSETS)/.megamoe_assets.json
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -q -rs tests

test-fast: setup
	$(PY) -m pytest -q -rs tests -m "not slow"

# Stock vs converter on the tiny config: 1 rank, then 2 ranks with FSDP + EP=2 (gloo). The EP=2
# run forces round-robin routing: with learned routing, near-tied router scores flip between
# summation orders (stock EP=2 vs stock FSDP-only shows the same single-step jumps).
ab: setup
	$(PY) -m torchtitan_megamoe.ab --config $(SMOKE_TOML) --nproc 1 --out outputs/ab_1rank
# EP2_TOML=$(FP8_TOML) runs the FP8 recipe the same way.
EP2_TOML ?= $(SMOKE_TOML)
ab-ep2: setup
	$(PY) -m torchtitan_megamoe.ab --config $(EP2_TOML) --nproc 2 --out outputs/ab_ep2 \
		-- --parallelism.expert_parallel_degree 2 --debug.moe_force_load_balance
# FP8 at EP=2 against FP8 at EP=1 (FSDP over the same 2 ranks), both with the converter: the
# exchange's e4m3 dy is the only difference.
ab-ep2-fp8: setup
	$(PY) -m torchtitan_megamoe.ab --config $(FP8_TOML) --nproc 2 --out outputs/ab_ep2_fp8 \
		--sides ep2=megamoe,ep1=megamoe --a-args '--parallelism.expert_parallel_degree 2' \
		--rtol 1e-3 -- --debug.moe_force_load_balance
# FP8 on CPU: the reference backend's emulation of the FP8 recipe against bf16 precision, both
# with the converter, on the tiny flavor at the recipe's block size (dim = moe_inter_dim = 128).
FP8_TOML := train_configs/qwen3_moe_tiny_fp8_cpu.toml
ab-fp8: setup
	$(PY) -m torchtitan_megamoe.ab --config $(FP8_TOML) --nproc 1 --out outputs/ab_fp8 \
		--sides fp8=megamoe,bf16=megamoe --b-args '--megamoe.precision bf16' --rtol 1e-2

# GPU only (an H100/H200 with a CUDA torch in .venv): layer benchmark, and the one-stop GPU
# script. The check stops a CPU-only venv before the bench's imports and tuner start.
GPU_ONLY = import sys, torch; torch.cuda.is_available() or sys.exit( \
	"make bench needs an NVIDIA GPU (H100/H200) and a CUDA build of torch; this .venv has torch " \
	+ torch.__version__ + " and sees no CUDA device. On a CPU machine: make test, make ab.")
bench: setup
	$(PY) -c '$(GPU_ONLY)'
	$(PY) -m torchtitan_megamoe.bench
gpu-check:
	bash scripts/gpu_check.sh
# The optional DeepGEMM extra, built from source into .venv's python (else python3): a GPU
# machine's job (CUDA torch, nvcc >= 12.9, g++ >= 13); the script names whatever is missing.
# DEEPGEMM_ARGS passes --sdist PATH (offline), --target DIR or --check-only through.
deepgemm:
	PYTHON=$(if $(wildcard $(PY)),$(PY),$(PYTHON)) bash scripts/install_deepgemm.sh $(DEEPGEMM_ARGS)
# nvcc, no GPU needed: the sm90 kernels' tuner builds into .cuda_cache, which the GPU scripts use
# when it is in the repository root (e.g. copied along to a GPU machine): no nvcc time there.
cuda-cache: setup
	MEGAMOE_CUDA_CACHE=$(CURDIR)/.cuda_cache $(PY) -m torchtitan_megamoe.ops.hopper.cuda

clean:
	rm -rf outputs
