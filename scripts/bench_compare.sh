#!/usr/bin/env bash
# The layer bench of two checkouts of this repository, run alternately in one process tree on
# one GPU: the "no slowdown" check of a change (none of our rows may be more than 2% slower).
#
#   bash scripts/bench_compare.sh OLD_DIR NEW_DIR [REPEATS]
#
# OLD_DIR / NEW_DIR: repository roots (e.g. `git worktree add /tmp/old <commit>`). Each run is
# `python -m torchtitan_megamoe.bench` with that root first on PYTHONPATH; BENCH_ARGS overrides
# the bench arguments. Results: $OUT/cmp_{old,new}_{i}.json, and the table of
# tools/bench_compare.py (median over the repeats, new/old per row of ours).
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
install_wheels || exit 1
dg_setup  # DeepGEMM where carried (.dgsite/ or .dgsdist/): the kernels its users run
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); repeats=${3:-3}
args=${BENCH_ARGS:---shapes 30b,235b --precisions bf16,fp8,fp8_bwd --baselines eager --no-stages}
base_path=$PYTHONPATH
for i in $(seq 1 "$repeats"); do
  for side in old new; do
    dir=$old; [ "$side" = new ] && dir=$new
    # shellcheck disable=SC2086
    PYTHONPATH="$dir:$base_path" timeout "${BENCH_TIMEOUT_S:-300}" python3 -m torchtitan_megamoe.bench \
      $args --json "$OUT/cmp_${side}_$i.json" > "$OUT/cmp_${side}_$i.log" 2>&1
    echo "run $i $side exit $?"
  done
done
python3 "$new/tools/bench_compare.py" "$OUT"
