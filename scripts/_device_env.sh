# Sourced (not run) by the scripts/gpu_*.sh checks: the environment they share.
#
#   source "$(dirname "$0")/_device_env.sh"
#
# On sourcing: NVLink multicast off (NCCL NVLS, symmetric-memory multicast, NVSHMEM NVLS: not every
# H100/H200 host supports it and nothing here needs it), unbuffered Python, OUT (default ./.out)
# made absolute and created, the repository root as the working directory, START (= $SECONDS)
# for budgets, PY (${PYTHON:-python3}).
# Functions:
#   install_wheels     optional, for machines without network access: .whl/*.whl (if present)
#                      into /tmp/site on PYTHONPATH (WHEELS=0 or no .whl: use the current env);
#                      returns non-zero if pip fails, the caller picks its exit status
#   offline_hf_env     Hugging Face caches to scratch, every offline switch on (no network needed)
#   env_report         GPUs, clocks, versions, C compiler, commit (callers tee it into env.log)
#   run_timeout R L    seconds each of the next R runs may take within BUDGET_S (see below)
#   dg_setup, dg_version, dg_pack_jit   the optional DeepGEMM extra (scripts/_deepgemm_env.sh)

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# a .cuda_cache in the repository root (`make cuda-cache`: nvcc, no GPU needed) holds the sm90
# kernels already compiled: no nvcc run on the GPU machine (same source and nvcc version only)
[ -d "$(dirname "${BASH_SOURCE[0]}")/../.cuda_cache" ] && \
  export MEGAMOE_CUDA_CACHE=${MEGAMOE_CUDA_CACHE:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.cuda_cache}
export PYTHONUNBUFFERED=1
START=$SECONDS
OUT_GIVEN=${OUT:+1}  # before OUT is defaulted: the DeepGEMM archives go only to a given $OUT
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PY=${PYTHON:-python3}

install_wheels() {
  if [ "${WHEELS:-1}" = 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || { echo "wheel install failed"; return 1; }
    export PYTHONPATH="$PWD:/tmp/site"
  else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
}

# The GPU machine needs no network: the dataset's Arrow cache goes to scratch, nothing goes online.
offline_hf_env() {
  export HF_HOME=${HF_HOME:-/tmp/megamoe_hf_home}
  export HF_DATASETS_CACHE=$HF_HOME/datasets HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
  export TRANSFORMERS_OFFLINE=1
}

env_report() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv 2>/dev/null || echo "no nvidia-smi"
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
  $PY -c 'import importlib.metadata as m; print("torchtitan", m.version("torchtitan"))' 2>/dev/null \
    || echo "torchtitan not installed"
  command -v cc gcc || echo "no C compiler (Inductor/Triton need one)"
  git log -1 --format='commit %H %s' 2>/dev/null || true
  # A copied working tree's .git can lag the files it runs: the sources' hash names the code
  # itself; `bash scripts/source_hash.sh` on a checkout of a commit prints the same.
  echo "sources $(bash scripts/source_hash.sh)"
  local v
  v=$(dg_version)
  echo "DeepGEMM: ${v:-not importable}${v:+ (DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-} LD_PRELOAD=${LD_PRELOAD:-})}"
}

# Seconds each of the next `runs` runs may take: RUN_TIMEOUT_S, less when the remaining budget
# (BUDGET_S since sourcing, minus LATER_S for each of `later` parts still to come, ~25 s for the
# summary and ~20 s per run for stopping a timed-out torchrun) cannot cover that; at least 20.
run_timeout() {
  local runs=$1 later=$2
  local left=$((BUDGET_S - (SECONDS - START) - 25 - later * ${LATER_S:-0}))
  local t=$((left / runs - 20))
  [ "$t" -gt "$RUN_TIMEOUT_S" ] && t=$RUN_TIMEOUT_S
  [ "$t" -lt 20 ] && t=20
  echo "$t"
}

# shellcheck source=scripts/_deepgemm_env.sh
source scripts/_deepgemm_env.sh
