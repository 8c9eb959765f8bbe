#!/usr/bin/env bash
# Where the warps of one GEMM 1 variant stall, per SASS instruction (Nsight Compute's PC
# sampling), next to the Triton kernel's: which wait the consumer warps sit in (full barrier =
# starved by the producer, WARPGROUP.DEPBAR = tensor-core bound, ...).
#
#   SHAPE=235b VARIANTS="triton_persistent sm90_g8" bash experiments/ncu_stalls.sh
#   SCRIPT=experiments/dgrad_variants.py KERNEL=<regex of the kernel's name> VARIANTS="default" \
#     bash experiments/ncu_stalls.sh   # dgrad2_swiglu instead: any script with an NCU=1 mode
#
# Writes $OUT/<variant>.ncu-rep and prints, per variant, the stall reasons summed over the
# kernel and the 25 SASS lines with the most stall samples (experiments/ncu_stalls_summary.py).
source "$(dirname "$0")/../scripts/_device_env.sh"
install_wheels || exit 1
SHAPE=${SHAPE:-235b}
for v in ${VARIANTS:-triton_persistent sm90_g8}; do
  VARIANTS=$v NCU=1 timeout 240 ncu --clock-control none --kernel-name-base demangled \
    --kernel-name "regex:${KERNEL:-gemm1}" --launch-skip 1 --launch-count 1 --import-source no \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters \
    -f -o "$OUT/$SHAPE-$v" python3 "${SCRIPT:-experiments/ncu_gemm1.py}" "$SHAPE" > "/tmp/$SHAPE-$v.ncu.log" 2>&1 \
    || { tail -20 "/tmp/$SHAPE-$v.ncu.log"; continue; }
  ncu -i "$OUT/$SHAPE-$v.ncu-rep" --page source --csv --print-source sass > "$OUT/$SHAPE-$v.sass.csv" 2>&1
  ncu -i "$OUT/$SHAPE-$v.ncu-rep" --page details --section WarpStateStats --section SpeedOfLight \
    > "$OUT/$SHAPE-$v.details.txt" 2>&1
  echo "=== $SHAPE $v"
  grep -E "Duration|Throughput|Stall|Warp Cycles|Issued" "$OUT/$SHAPE-$v.details.txt" | head -20
  python3 experiments/ncu_stalls_summary.py "$OUT/$SHAPE-$v.sass.csv"
done
