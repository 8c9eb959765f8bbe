#!/usr/bin/env bash
# The one-GPU training step of two checkouts of this repository, interleaved on one GPU (old,
# new, then new, old, ...: a GPU that slows over the call weighs on both alike): the step-level
# "no slowdown" check of a change, beside scripts/bench_compare.sh's layer rows.
#
#   bash scripts/step_compare.sh OLD_DIR NEW_DIR [REPEATS]
#
# OLD_DIR / NEW_DIR: repository roots (e.g. `git worktree add /tmp/old <commit>`). Each run is
# `python -m torchtitan_megamoe.ab` (the A/B tool, one run per side, one at a time) with that
# root first on PYTHONPATH, on CONFIG with STEP_ARGS (default: 30B-A3B-L6, seq 8192, 20 steps,
# full AC, compile, EP=1) for the sides STEP_SIDES (default: ours bf16 and fp8; each label names our precision, stock
# is TorchTitan's own). DeepGEMM is set
# up as in every GPU script (scripts/_deepgemm_env.sh). Results: the table of
# `tools/bench_compare.py --steps` (mean step ms over steps >= 3, median over the repeats,
# new/old per side) on stdout and in $OUT/step_compare.txt; the runs' reports in $OUT.
# Knobs: CONFIG, STEP_ARGS, STEP_SIDES, STEP_TIMEOUT_S (per A/B call, default 300), WORK
# (default /tmp/megamoe_step_compare), MEGAMOE_TUNE (default 1: what users run).
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
install_wheels || exit 1
offline_hf_env
dg_setup
export MEGAMOE_TUNE=${MEGAMOE_TUNE:-1}
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); repeats=${3:-2}
CONFIG=${CONFIG:-train_configs/qwen3_30b_a3b_gpu_smoke.toml}
STEP_ARGS=${STEP_ARGS:---model.flavor 30B-A3B-L6 --training.seq_len 8192 --training.steps 20 --parallelism.expert_parallel_degree 1 --activation_checkpoint.mode full --compile.enable}
STEP_SIDES=${STEP_SIDES:-bf16=megamoe,fp8=megamoe}
WORK=${WORK:-/tmp/megamoe_step_compare}
rm -rf "$WORK" && mkdir -p "$WORK"
side_args=()
for s in ${STEP_SIDES//,/ }; do
  label=${s%%=*}
  [ "$label" != stock ] && side_args+=(--side-args "$label=--megamoe.precision $label")
done
base_path=$PYTHONPATH
for i in $(seq 1 "$repeats"); do
  order="old new"; [ $((i % 2)) = 0 ] && order="new old"
  for side in $order; do
    dir=$old; [ "$side" = new ] && dir=$new
    # shellcheck disable=SC2086
    PYTHONPATH="$dir:$base_path" timeout "${STEP_TIMEOUT_S:-300}" python3 -m torchtitan_megamoe.ab \
      --config "$CONFIG" --nproc 1 --out "$WORK/step_${side}_$i" --sides "$STEP_SIDES" \
      "${side_args[@]}" --rtol 5e-2 --atol 1e-2 -- $STEP_ARGS > "$WORK/step_${side}_$i.out" 2>&1
    echo "run $i $side exit $?"
    cp "$WORK/step_${side}_$i/report.md" "$OUT/step_${side}_$i.md" 2>/dev/null
  done
done
python3 "$new/tools/bench_compare.py" "$WORK" --steps | tee "$OUT/step_compare.txt"
