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
# Env knobs: BENCH_ARGS (extra args of python -m torchtitan_megamoe.bench), BENCH_VARIANTS (the bench
# again per NAME:VAR=VALUE entry, e.g. "fused:MEGAMOE_FP8_FUSED_DGRAD2=1"), PYTEST_ARGS (default "-m gpu tests"),
# SKIP_TESTS=1, SKIP_BENCH=1, WHEELS=0 (use the current env, not .whl), BENCH_NPROC=2 (EP=2
# bench under torchrun, 2 GPUs),
# BENCH_NPROCS="1 2" (both benches in one run), BENCH_TIMEOUT_S (per bench, default 360),
# LOOPBACK_EP=R (EP=R as R loopback ranks on this one GPU: waited, host, GPU busy and CUDA-graph times, EP=1 ratio, counted bytes per
# transfer, in bf16, fp8 and fp8_bwd), LOOPBACK_SPECS (shape:tokens per rank, default
# "30b:16384 235b:4096"), LOOPBACK_PRECISIONS (default bf16,fp8,fp8_bwd), LOOPBACK_LINK_GBS=G (pace the loopback transfers to a G GB/s link, e.g. 326),
# LOOPBACK_EXPOSED_GBS (each transfer's exposed time on such a link, default 326; 0: skip),
# LOOPBACK_ARGS (extra args of those runs, e.g. --profile: top kernels, one rank thread's host profile),
# LOOPBACK_VARIANTS (each spec again per NAME:VAR=VALUE entry, e.g. "untuned:MEGAMOE_TUNE=0"),
# STEP_AB=N (the one-GPU training step, stock vs ours bf16 and fp8 at 30B-A3B-L6, seq 8192, step N
# traced; STEP_AB_SIDES, default stock,bf16=megamoe,fp8=megamoe (a side LABEL=megamoe with LABEL
# bf16, fp8 or fp8_bwd runs that precision); STEP_AB_ARGS e.g. --memory-snapshot; STEP_TIMEOUT_S,
# default 300; STEP_AB_TRACES=0: no raw traces in $OUT, the report's profile tables only),
# PYTEST_TIMEOUT_S (default 300), SKIP_DEEPGEMM=1 (no DeepGEMM set-up, MEGAMOE_DEEPGEMM=0),
# DEEPGEMM_TIMEOUT_S (its build, default 360), DEEPGEMM_SITE (where it builds, default
# /tmp/dgsite), DG_JIT_CACHE_DIR (its kernels, default /tmp/dgjit). Logs and bench.json go to
# $OUT (or ./.out when run by hand).
# DeepGEMM, the optional extra: scripts/_deepgemm_env.sh says which carried folders it comes
# from and how to keep what a run builds for the next one.
# What the bench prints: at EP=1, stock vs ours per shape plus the backward's per-stage table
# (bench/backward_stages.py, run inside the bench: no separate run); at EP=2, stock
# TorchTitan's ExpertParallel layer vs ours in the same run, with our EP=1 time for the ratio
# (BENCH_ARGS=--no-ep1 skips that). EP=2 check on 2 GPUs, ~3-4 min:
#   PYTEST_ARGS='-m multigpu tests/hopper' BENCH_NPROC=2 bash scripts/gpu_check.sh
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"  # env, $OUT, repo root, install_wheels, env_report, dg_*
install_wheels || exit 1

dg_setup  # not in a pipe: its exports must reach the runs below

env_report 2>&1 | tee "$OUT/env.log"

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
    # once as set, then once more per BENCH_VARIANTS entry (NAME:VAR=VALUE, as LOOPBACK_VARIANTS)
    for variant in "" ${BENCH_VARIANTS:-}; do
      name=${variant:+_${variant%%:*}}
      # shellcheck disable=SC2086
      env ${variant#*:} timeout "${BENCH_TIMEOUT_S:-360}" "${launch[@]}" --json "$OUT/bench_ep$n$name.json" \
        ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_ep$n$name.log" | grep -v '^{'
      brc=${PIPESTATUS[0]}
      echo "bench ep=$n$name exit: $brc"
      [ "$brc" != 0 ] && rc=$brc
    done
  done
fi
if [ -n "${LOOPBACK_EP:-}" ]; then
  model_json=()
  for spec in ${LOOPBACK_SPECS:-30b:16384 235b:4096}; do
    shape=${spec%%:*}
    model_json+=("$OUT/loopback_ep${LOOPBACK_EP}_$shape.json")
    # each spec once as set, then once more per LOOPBACK_VARIANTS entry (NAME:VAR=VALUE, the
    # run under that variable, e.g. "untuned:MEGAMOE_TUNE=0"), outputs suffixed _NAME
    for variant in "" ${LOOPBACK_VARIANTS:-}; do
      name=${variant:+_${variant%%:*}}
      # shellcheck disable=SC2086
      env ${variant#*:} timeout "${BENCH_TIMEOUT_S:-360}" python3 -m torchtitan_megamoe.bench --ep "$LOOPBACK_EP" \
        --loopback --shapes "$shape" --tokens "${spec##*:}" --precisions "${LOOPBACK_PRECISIONS:-bf16,fp8,fp8_bwd}" \
        --iters 5 --warmup 2 --link-gbs "${LOOPBACK_LINK_GBS:-0}" --graph \
        --exposed "${LOOPBACK_EXPOSED_GBS:-326}" ${LOOPBACK_ARGS:-} \
        --json "$OUT/loopback_ep${LOOPBACK_EP}_$shape$name.json" \
        2>&1 | tee "$OUT/loopback_ep${LOOPBACK_EP}_$shape$name.log" | grep -v '^{'
      brc=${PIPESTATUS[0]}
      echo "loopback bench ep=$LOOPBACK_EP $shape$name exit: $brc"
      [ "$brc" != 0 ] && rc=$brc
    done
  done
  # the modelled 8-GPU node from those runs (bench/ep_model.py)
  python3 -m torchtitan_megamoe.bench.ep_model --json "${model_json[@]}" \
    2>&1 | tee "$OUT/ep_model.log"
fi
if [ -n "${STEP_AB:-}" ]; then
  # the one-GPU training step, stock against ours bf16 and fp8 (python -m torchtitan_megamoe.ab):
  # 30B-A3B-L6, seq 8192, full AC, compile; step STEP_AB traced (kernel time by category)
  offline_hf_env
  step_sides=${STEP_AB_SIDES:-stock,bf16=megamoe,fp8=megamoe}
  step_side_args=()  # each ours-side labelled by its precision runs that precision
  for p in bf16 fp8 fp8_bwd; do
    case ",$step_sides," in *",$p=megamoe,"*) step_side_args+=(--side-args "$p=--megamoe.precision $p") ;; esac
  done
  # shellcheck disable=SC2086
  timeout "${STEP_TIMEOUT_S:-300}" python3 -m torchtitan_megamoe.ab \
    --config train_configs/qwen3_30b_a3b_gpu_smoke.toml --nproc 1 --out /tmp/megamoe_step_ab \
    --sides "$step_sides" "${step_side_args[@]}" --baseline stock --rtol 5e-2 --atol 1e-2 \
    --profile-step "$STEP_AB" ${STEP_AB_ARGS:-} -- --model.flavor 30B-A3B-L6 \
    --training.seq_len 8192 --training.steps 20 --parallelism.expert_parallel_degree 1 \
    --activation_checkpoint.mode full --compile.enable > "$OUT/step_ab.log" 2>&1
  src=$?
  echo "step A/B exit: $src"
  cp /tmp/megamoe_step_ab/report.md "$OUT/step_ab.md" 2>/dev/null && sed -n 1,40p "$OUT/step_ab.md"
  # the traced step's raw traces, for ab.trace or a trace viewer (gzip: ~1/10 the size); the
  # report above holds their tables already: STEP_AB_TRACES=0 leaves them out (fewer files)
  [ "${STEP_AB_TRACES:-1}" = 1 ] && for side in $(echo "$step_sides" | tr ',' '\n' | sed 's/=.*//'); do
    gzip -c "/tmp/megamoe_step_ab/$side/profile_traces/iteration_$STEP_AB/rank0_trace.json" \
      > "$OUT/step_trace_$side.json.gz" 2>/dev/null || rm -f "$OUT/step_trace_$side.json.gz"
  done
  [ "$src" != 0 ] && rc=$src
fi
# the kernels DeepGEMM's JIT compiled (whatever ran above used), for .dgjit/ next time
dg_pack_jit
exit $rc
