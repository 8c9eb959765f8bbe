#!/usr/bin/env bash
# On an H100/H200 machine: run the GPU tests and the layer benchmark (stock vs ours).
#
#   bash scripts/gpu_check.sh
#
# Needs a CUDA torch, torchtitan==0.2.2 and this package. Optional, for a machine without
# network access: .whl/ with torchtitan==0.2.2 and the pure-Python deps a bare torch image lacks
# (tyro, docstring-parser, typeguard, torchdata, datasets, dill, multiprocess), installed into
# /tmp/site first; make them on a machine with network access with:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl torchtitan==0.2.2 tyro==1.0.17 \
#     docstring-parser==0.18.0 typeguard==4.6.1 torchdata==0.11.0 \
#     datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# Also optional: `make cuda-cache` (~30 s, nvcc, no GPU needed) compiles the sm90 kernels into
# .cuda_cache, which this script then loads instead of running nvcc.
# Env knobs: BENCH_ARGS (extra args of python -m torchtitan_megamoe.bench), PYTEST_ARGS (default "-m gpu tests"),
# SKIP_TESTS=1, SKIP_BENCH=1, WHEELS=0 (use the current env, not .whl), BENCH_NPROC=2 (EP=2
# bench under torchrun, 2 GPUs),
# BENCH_NPROCS="1 2" (both benches in one run), BENCH_TIMEOUT_S (per bench, default 360),
# PYTEST_TIMEOUT_S (default 300), SKIP_DEEPGEMM=1 (no DeepGEMM set-up, MEGAMOE_DEEPGEMM=0),
# DEEPGEMM_TIMEOUT_S (its build, default 360), DEEPGEMM_SITE (where it builds, default
# /tmp/dgsite), DG_JIT_CACHE_DIR (its kernels, default /tmp/dgjit). Logs and bench.json go to
# $OUT (or ./.out when run by hand).
# DeepGEMM, the optional extra, from ignored folders of the checkout carried along: .dgsite/ (an
# install from an earlier run, used as is), else .dgsdist/deepinfer_gemm-2.8.2.tar.gz (built with
# scripts/install_deepgemm.sh into DEEPGEMM_SITE, ~2.5 min), and .dgjit/ (its JIT-compiled kernels).
# When $OUT is given, the build comes back as $OUT/dgsite.tgz and the kernels as $OUT/dgjit.tgz:
#   mkdir -p .dgsite .dgjit && cp dgsite.tgz .dgsite/ && tar -xzf dgjit.tgz -C .dgjit
# (.dgsite/dgsite.tgz is unpacked into DEEPGEMM_SITE: the unpacked build is ~60 MB)
# What the bench prints: at EP=1, stock vs ours per shape plus the backward's per-stage table
# (bench/backward_stages.py, run inside the bench: no separate run); at EP=2, stock
# TorchTitan's ExpertParallel layer vs ours in the same run, with our EP=1 time for the ratio
# (BENCH_ARGS=--no-ep1 skips that). EP=2 check on 2 GPUs, ~3-4 min:
#   PYTEST_ARGS='-m multigpu tests/hopper' BENCH_NPROC=2 bash scripts/gpu_check.sh
set -uo pipefail
OUT_GIVEN=${OUT:+1}  # before _device_env.sh defaults it: the DeepGEMM archives go only to a given $OUT
source "$(dirname "$0")/_device_env.sh"  # env, $OUT, repo root, install_wheels, env_report
install_wheels || exit 1

DG_SDIST=.dgsdist/deepinfer_gemm-2.8.2.tar.gz DG_SITE=${DEEPGEMM_SITE:-/tmp/dgsite}
dg_version() { (cd / && $PY -c 'import deep_gemm; print(deep_gemm.__version__, deep_gemm.__file__)') 2>/dev/null; }
dg_use() {  # $1: an install folder; its env file sets PYTHONPATH, LD_PRELOAD, CUDA_HOME
  local pp=${PYTHONPATH:-} pre=${LD_PRELOAD-unset}
  if [ -f "$1/deepgemm_env.sh" ]; then
    # shellcheck disable=SC1091
    source "$1/deepgemm_env.sh"
  else
    PYTHONPATH="$(cd "$1" && pwd):$PYTHONPATH"
    export PYTHONPATH
  fi
  [ -n "$(dg_version)" ] && return 0
  export PYTHONPATH=$pp
  if [ "$pre" = unset ]; then unset LD_PRELOAD; else export LD_PRELOAD=$pre; fi
  return 1
}
dg_pack() {  # $1 folder, $2 archive name under $OUT, then what in the folder to pack
  local dir=$1 name=$2 size
  shift 2
  [ -n "$OUT_GIVEN" ] || return 0
  tar -C "$dir" --exclude=__pycache__ --exclude='*.pyc' -czf "$OUT/$name" "$@" || { rm -f "$OUT/$name"; return 0; }
  size=$(stat -c %s "$OUT/$name")
  if [ "$size" -ge $((16 << 20)) ]; then
    rm -f "$OUT/$name"
    echo "DeepGEMM: $name would be $((size >> 20)) MiB, over 16 MiB: not kept"
  else
    echo "DeepGEMM: $dir packed into $OUT/$name ($((size >> 10)) KiB)"
  fi
}
dg_setup() {
  if [ "${SKIP_DEEPGEMM:-0}" = 1 ]; then
    export MEGAMOE_DEEPGEMM=${MEGAMOE_DEEPGEMM:-0}
    echo "DeepGEMM: skipped (SKIP_DEEPGEMM=1), MEGAMOE_DEEPGEMM=$MEGAMOE_DEEPGEMM"
    return
  fi
  # a scratch copy: carried folders may be read-only, and the JIT writes beside its entries
  export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/dgjit}
  mkdir -p "$DG_JIT_CACHE_DIR"
  [ -d .dgjit ] && cp -r .dgjit/. "$DG_JIT_CACHE_DIR"/ && chmod -R u+w "$DG_JIT_CACHE_DIR"
  if [ -f .dgsite/dgsite.tgz ]; then  # the build packed (a folder would be too big to carry)
    rm -rf "$DG_SITE" && mkdir -p "$DG_SITE" && tar -xzf .dgsite/dgsite.tgz -C "$DG_SITE"
    dg_use "$DG_SITE" && return
    echo "DeepGEMM: .dgsite/dgsite.tgz does not import here (built for another torch or python?)"
  elif [ -d .dgsite ]; then
    dg_use .dgsite && return
    echo "DeepGEMM: .dgsite/ does not import here (built for another torch or python?)"
  fi
  [ -f "$DG_SITE/deepgemm_env.sh" ] && dg_use "$DG_SITE" && return  # an earlier run on this machine
  [ -f "$DG_SDIST" ] || return 0
  echo "DeepGEMM: building $DG_SDIST into $DG_SITE (log: $OUT/deepgemm_build.log)"
  if PYTHON=$PY timeout "${DEEPGEMM_TIMEOUT_S:-360}" bash scripts/install_deepgemm.sh \
       --target "$DG_SITE" --sdist "$DG_SDIST" > "$OUT/deepgemm_build.log" 2>&1 && dg_use "$DG_SITE"; then
    grep '^export LD_PRELOAD' "$OUT/deepgemm_build.log"
    dg_pack "$DG_SITE" dgsite.tgz .
  else
    echo "DeepGEMM: build failed, running without it; the log's end:"
    tail -15 "$OUT/deepgemm_build.log"
  fi
}
dg_setup  # not in a pipe: its exports must reach the runs below

{
  env_report
  v=$(dg_version)
  echo "DeepGEMM: ${v:-not importable}${v:+ (DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-} LD_PRELOAD=${LD_PRELOAD:-})}"
} 2>&1 | tee "$OUT/env.log"

rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # PYTEST_ARGS is split as a shell line, so quoted parts stay one argument
  # (PYTEST_ARGS="-m gpu tests/hopper -k 'uneven or phased'")
  eval "pytest_args=(${PYTEST_ARGS:--m gpu tests})"
  timeout "${PYTEST_TIMEOUT_S:-300}" python3 -m pytest -q -rs --durations=12 --continue-on-collection-errors "${pytest_args[@]}" \
    2>&1 | tee "$OUT/pytest.log" | tail -40
  rc=${PIPESTATUS[0]}
  echo "pytest exit: $rc"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  for n in ${BENCH_NPROCS:-${BENCH_NPROC:-1}}; do
    if [ "$n" -gt 1 ]; then
      launch=(python3 -m torch.distributed.run --nproc_per_node "$n" -m torchtitan_megamoe.bench --ep "$n")
    else
      launch=(python3 -m torchtitan_megamoe.bench)
    fi
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT_S:-360}" "${launch[@]}" --json "$OUT/bench_ep$n.json" ${BENCH_ARGS:-} \
      2>&1 | tee "$OUT/bench_ep$n.log" | grep -v '^{'
    brc=${PIPESTATUS[0]}
    echo "bench ep=$n exit: $brc"
    [ "$brc" != 0 ] && rc=$brc
  done
fi
# the kernels DeepGEMM's JIT compiled (whatever ran above used), for .dgjit/ next time
[ "${SKIP_DEEPGEMM:-0}" != 1 ] && [ -d "$DG_JIT_CACHE_DIR/cache" ] && dg_pack "$DG_JIT_CACHE_DIR" dgjit.tgz cache
exit $rc
