#!/usr/bin/env bash
# On one H100/H200: the multi-seed training A/B of four sides in one go, in about 10 minutes
# (python -m torchtitan_megamoe.ab --seeds, ab/seeds.py):
#   stock     TorchTitan's own MoE
#   bf16      ours, precision bf16 (the baseline: every other side is compared against it)
#   fp8       ours, precision fp8 (FP8 weight copies made once per optimizer step)
#   fp8_bwd   ours, precision fp8_bwd
# each trained from AB_SEEDS seeds (11, 12, 13), AB_STEPS steps; a run of one side and seed
# serves every comparison it is part of (12 runs for the 3 comparisons). The report answers per
# comparison whether the final-window (AB_WINDOW steps) mean-loss difference is chance
# ("indistinguishable") or systematic ("different"): a paired t-test over the seeds.
#
#   bash scripts/gpu_ab_seeds.sh
#   AB_FLAVOR=30B-A3B-L6 AB_SEQ=8192 AB_JOBS=1 AB_SEEDS=1 AB_SEED_BASE=12 bash scripts/gpu_ab_seeds.sh
#
# Needs a CUDA torch, torchtitan==0.2.2 and this package. Optional, for machines without network
# access: .whl/ with the wheels listed in scripts/gpu_check.sh, installed into /tmp/site first.
# Config: train_configs/qwen3_30b_a3b_gpu_smoke.toml (30B-A3B layer shapes, bf16 params under
# autocast, fp32 reduce) with --activation_checkpoint.mode full --compile.enable, EP=1.
#
# Defaults, sized for one H200 and ~9 minutes (measured: a 2-layer 30B-A3B shape at 4096
# tokens/step runs ~47,000 tokens/s stock and ours, 0.09 s/step; FP8's first step takes ~30 s,
# Triton JIT; a run's start-up with torch.compile takes 30-60 s):
#   AB_FLAVOR=30B-A3B-L2  2 layers, ~1.9e9 parameters: ~31 GiB peak per run (38 GiB fp8 with the
#                         weight cache), so 3 runs fit on one GPU
#                         at once. 30B-A3B-L6 (~4.4e9 parameters: fp32 weights, grads and Adam
#                         state ~70 GB per run) allows one run at a time, and 12 of those (start-up
#                         + 100 steps at seq 8192, each step by estimate several times the L2
#                         one; not measured) do not fit in 10 minutes: run it one seed at a time (AB_SEEDS=1
#                         AB_SEED_BASE=11, 12, 13 with AB_JOBS=1) and combine the runs'
#                         $OUT/ab_seeds.tar.gz with
#                         `python -m torchtitan_megamoe.ab ... --analyze` (below).
#   AB_SEQ=4096           the measured shape; 8192 doubles the logits' memory and the step time
#   AB_STEPS=100          100 x 0.09 s = 9 s of steps per run alone: start-up dominates a run
#   AB_JOBS=3             3 runs at once: one run's start-up/compile overlaps the others' steps.
#                         12 runs x (~50 s start-up + 9 s steps) + 6 FP8 first steps x ~30 s
#                         ~ 900 s one at a time; with 3 at once all 12 ran in 195 s on an H200
#                         (later runs also hit Inductor's and Triton's on-disk caches); the
#                         deadline below bounds it either way
#   AB_SEEDS=3 AB_SEED_BASE=11 AB_WINDOW=20
# Other knobs: AB_TIMEOUT_S (per run, default 240), BUDGET_S (the whole script, default 560:
# ab gets --deadline-s = what is left minus 50 s for stopping runs and writing the report, so
# the report is always written; runs missing at the deadline are listed in it), AB_MIN_RUN_S
# (default 90: no run starts with less left before the deadline), AB_EXTRA_ARGS (appended to
# every run), CONFIG, WHEELS=0 (use the current env, not .whl), PYTHON (default python3),
# MEGAMOE_TUNE (default 1, the tuner on: every run trains what users run with the default
# settings; 0 opts out: each stage takes its untuned pick, the side measured fastest on the
# GPU, so no run's choice depends on timings taken while other runs share it).
# Tokens/s of runs that overlapped are reported as n/c (not comparable); losses and peak memory
# are per run and unaffected. For speed, use scripts/gpu_train_check.sh (one run at a time).
#
# Output ($OUT, or ./.out by hand): report.md (verdict per comparison, per-seed final-window
# means, the runs and which are missing), summary.json, seeds.png (windowed mean loss per side,
# seeds as thin lines; each side's relative difference to bf16), ab.out (the tool's output),
# ab_seeds.tar.gz (per seed: each run's log and TOML, report.md with per-step tables, ab.png,
# summary.json; no dump folders), env.log. Re-make the report from archives (one run's of the
# script, or several of one seed each, extracted into one dir) on any machine, with the knobs:
#   mkdir -p ab && tar -xzf ab_seeds.tar.gz -C ab && python -m torchtitan_megamoe.ab \
#     --config train_configs/qwen3_30b_a3b_gpu_smoke.toml --out ab --seeds 3 --seed-base 11 \
#     --window 20 --sides stock,bf16=megamoe,fp8=megamoe,fp8_bwd=megamoe \
#     --side-args 'bf16=--megamoe.precision bf16' \
#     --side-args 'fp8=--megamoe.precision fp8' \
#     --side-args 'fp8_bwd=--megamoe.precision fp8_bwd' --baseline bf16 --analyze \
#     [-- the runs' TorchTitan args, as in report.md, for the report's header and commands]
# Exit status: the tool's: 0 every comparison indistinguishable, 1 one is different, 2 a run
# failed or is missing.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"  # env, $OUT, repo root, PY, install_wheels, env_report
install_wheels || exit 2
offline_hf_env
dg_setup  # DeepGEMM where carried (.dgsite/ or .dgsdist/): the kernels its users run
export MEGAMOE_TUNE=${MEGAMOE_TUNE:-1}

CONFIG=${CONFIG:-train_configs/qwen3_30b_a3b_gpu_smoke.toml}
AB_FLAVOR=${AB_FLAVOR:-30B-A3B-L2}
AB_SEQ=${AB_SEQ:-4096}
AB_STEPS=${AB_STEPS:-100}
AB_JOBS=${AB_JOBS:-3}
AB_SEEDS=${AB_SEEDS:-3}
AB_SEED_BASE=${AB_SEED_BASE:-11}
AB_WINDOW=${AB_WINDOW:-20}
AB_TIMEOUT_S=${AB_TIMEOUT_S:-240}
AB_MIN_RUN_S=${AB_MIN_RUN_S:-90}
AB_EXTRA_ARGS=${AB_EXTRA_ARGS:-}
BUDGET_S=${BUDGET_S:-560}
WORK=${WORK:-/tmp/megamoe_ab_seeds}
rm -rf "$WORK"
mkdir -p "$WORK"

{
  env_report
  echo "config $CONFIG flavor $AB_FLAVOR seq $AB_SEQ steps $AB_STEPS seeds $AB_SEEDS from" \
    "$AB_SEED_BASE window $AB_WINDOW jobs $AB_JOBS tune $MEGAMOE_TUNE extra: $AB_EXTRA_ARGS"
} 2>&1 | tee "$OUT/env.log"

deadline=$((BUDGET_S - (SECONDS - START) - 50))
if [ "$deadline" -lt "$AB_MIN_RUN_S" ]; then
  echo "BUDGET_S=$BUDGET_S leaves ${deadline} s for the runs, under AB_MIN_RUN_S=$AB_MIN_RUN_S"
  exit 2
fi
echo "=== $((AB_SEEDS * 4)) runs, up to $AB_JOBS at a time, deadline ${deadline} s" \
  "($((SECONDS - START)) s elapsed)"
# shellcheck disable=SC2086
timeout -k 15 $((deadline + 70)) $PY -m torchtitan_megamoe.ab --config "$CONFIG" --nproc 1 \
  --out "$WORK/ab" --seeds "$AB_SEEDS" --seed-base "$AB_SEED_BASE" --window "$AB_WINDOW" \
  --sides stock,bf16=megamoe,fp8=megamoe,fp8_bwd=megamoe \
  --side-args 'bf16=--megamoe.precision bf16' \
  --side-args 'fp8=--megamoe.precision fp8' \
  --side-args 'fp8_bwd=--megamoe.precision fp8_bwd' \
  --baseline bf16 --rtol 1e-2 --atol 1e-2 --jobs "$AB_JOBS" --timeout "$AB_TIMEOUT_S" \
  --deadline-s "$deadline" --min-run-s "$AB_MIN_RUN_S" -- \
  --model.flavor "$AB_FLAVOR" --training.seq_len "$AB_SEQ" --training.steps "$AB_STEPS" \
  --parallelism.expert_parallel_degree 1 --activation_checkpoint.mode full --compile.enable \
  $AB_EXTRA_ARGS >"$OUT/ab.out" 2>&1
rc=$?
grep '^\[megamoe.ab\]' "$OUT/ab.out"
for f in report.md summary.json seeds.png; do
  [ -f "$WORK/ab/$f" ] && cp "$WORK/ab/$f" "$OUT/"
done
# Everything else in one archive: logs, TOMLs, per-seed reports (no dump folders, no caches).
(cd "$WORK/ab" 2>/dev/null && find . -maxdepth 2 -path './seed*/*' -type f \
  \( -name '*.log' -o -name '*.toml' -o -name '*.md' -o -name '*.json' -o -name '*.png' \) \
  -print0 | tar -czf "$OUT/ab_seeds.tar.gz" --null -T - report.md summary.json) 2>/dev/null
if [ -f "$OUT/report.md" ]; then
  # the overview (sides, runs and missing ones, the verdict table, per-seed means, tokens/s
  # note), then the runs table; the per-comparison sections are in report.md
  sed -n '1,/^## /p' "$OUT/report.md" | sed '$d'
  sed -n '/^## Runs/,$p' "$OUT/report.md"
else
  echo "no report (ab exit $rc); the tool's output:"
  tail -40 "$OUT/ab.out"
fi
echo "total $((SECONDS - START)) s; ab exit $rc; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
