# Two commands do all the set-up on a fresh CPU machine (see README.md):
#   make smoke   -- the main job: CPU smoke training with the megamoe converter (torchrun)
#   make test    -- the test suite (what CI runs through .ci/run)
# Both create .venv and install everything first.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megamoe-installed
ASSETS := outputs/assets/megamoe_tiny
CPU_ENV := MEGAMOE_CPU=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME=$(CURDIR)/outputs/hf_home
NPROC ?= 1
SMOKE_TOML := train_configs/qwen3_moe_tiny_cpu.toml

.PHONY: cuda-cache setup smoke test test-fast ab ab-ep2 bench gpu-check clean

# torch is pinned to the CPU build that the machine image carries (a plain `torch` from PyPI
# would pull a multi-GB CUDA build onto a machine with no GPU).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
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
ab-ep2: setup
	$(PY) -m torchtitan_megamoe.ab --config $(SMOKE_TOML) --nproc 2 --out outputs/ab_ep2 \
		-- --parallelism.expert_parallel_degree 2 --debug.moe_force_load_balance

# GPU only (an H100/H200 with a CUDA torch): layer benchmark, and the one-stop GPU script.
bench:
	$(PYTHON) -m torchtitan_megamoe.bench
gpu-check:
	bash scripts/gpu_check.sh
# nvcc, no GPU needed: the sm90 kernels' tuner builds into .cuda_cache, which the GPU scripts use
# when it is in the repository root (e.g. copied along to a GPU machine): no nvcc time there.
cuda-cache: setup
	MEGAMOE_CUDA_CACHE=$(CURDIR)/.cuda_cache $(PY) -m torchtitan_megamoe.ops.hopper.cuda

clean:
	rm -rf outputs
