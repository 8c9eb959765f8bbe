#!/usr/bin/env bash
# The A/B of a kernel change in ONE GPU run: writes commit REV's package, csrc/ and experiments/
# into .baseline/ (git-ignored) and compiles its kernels into .cuda_cache beside the working
# tree's (the cache is keyed by the sources, so both stay), so a run times both trees:
#
#   bash scripts/baseline_tree.sh HEAD~1     # here, with nvcc (no GPU needed)
#   # on the GPU machine, carrying .baseline and .cuda_cache, after the usual set-up:
#   PYTHONPATH=$PWD/.baseline:/tmp/site python3 .baseline/experiments/fp8_stages.py --no-op
#   PYTHONPATH=$PWD:/tmp/site python3 experiments/fp8_stages.py --no-op
#
# Alternate the two runs (or repeat them) when the change is small: one median per tree
# drifts by several percent between neighbouring runs.
set -euo pipefail
rev=${1:?usage: scripts/baseline_tree.sh REV}
cd "$(dirname "$0")/.."
rm -rf .baseline
mkdir -p .baseline
git archive "$rev" torchtitan_megamoe csrc experiments | tar -x -C .baseline
git rev-parse --short "$rev" > .baseline/REV
PY=${PY:-.venv/bin/python}
(cd .baseline && MEGAMOE_CUDA_CACHE="$PWD/../.cuda_cache" PYTHONPATH="$PWD" \
  "../$PY" -m torchtitan_megamoe.ops.hopper.cuda > /dev/null)
echo ".baseline: $(cat .baseline/REV) ($(du -sh .baseline | cut -f1)), its kernels in .cuda_cache"
