#!/usr/bin/env bash
# On a machine with 2 GPUs (NPROC=1: one): train stock TorchTitan and the megamoe converter on the same
# config and seed (torchrun -m torchtitan.train, via python -m torchtitan_megamoe.ab) in two
# parallel setups, and compare losses, tokens/s and peak memory.
#
#   bash scripts/gpu_train_check.sh
#
# Needs a CUDA torch, torchtitan==0.2.2 and this package. Optional, for machines without network
# access: .whl/ with the wheels listed in scripts/gpu_check.sh, installed into /tmp/site first.
# Setups (both on train_configs/qwen3_30b_a3b_gpu_smoke.toml: 30B-A3B layer shapes, 2 layers,
# 4096 tokens per GPU, 20 steps, bf16 params, fp32 reduce):
#   a: FSDP + EP=2 + per-op selective AC + --compile.enable   (the production combination)
#   b: FSDP only (EP=1) + full AC
#   t: CONFIG as written (its own parallelism, AC and compile settings), e.g. a reduced-depth
#      A/B config of train_configs/
#   c: (a) with [megamoe] save_activations = "keep" (a's default under per-op SAC is "never":
#      GEMM 1 runs again in the backward, as stock's per-op SAC recomputes its experts); the
#      memory/speed trade of keeping GEMM 1's pre-activations
# If the stock run of (a) fails (torch 2.13 on CPU trips its SAC recompute check with stock
# EP + per-op SAC), a stock run of (a) with full AC is trained instead as the reference of the
# converter's (a) run (AC does not change the math), so (a) stays informative.
#
# Both runs of a setup get PYTORCH_ALLOC_CONF=expandable_segments:True, as TorchTitan's
# run_train.sh sets it, unless the caller sets PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF
# (torchtitan_megamoe/ab/runner.py; the peak memory compared depends on it).
# Tolerance: losses must agree within RTOL (1e-2) relative at every step; see summary.md.
# Env knobs: SETUPS ("a b"), RTOL, ATOL, RUN_TIMEOUT_S (per torchrun, default 150),
# MIN_RUN_S (default 45: a setup whose runs would get less is skipped, exit 2),
# BUDGET_S (whole script, default 540: later runs get shorter timeouts; LATER_S, default 80, is
# kept back per setup still to come), EXTRA_ARGS (appended to
# every run, e.g. a tiny CPU flavor), CONFIG, NPROC, WHEELS=0 (use the current env, not .whl),
# PYTHON (default python3), MEGAMOE_TUNE (default 0: each stage's untuned pick, the side
# measured fastest, no per-shape timing or extra compiles; 1 times every candidate),
# PROFILE_STEP (e.g. 8, from 4 to --training.steps: ab's --profile-step, both runs of each
# setup trace that step with TorchTitan's profiler, and $OUT/profile_<setup>.md sets rank 0's
# kernel time by category of the two runs side by side, torchtitan_megamoe/ab/trace.py),
# MEMORY_SNAPSHOT=1 (with PROFILE_STEP: what is alive at that step's memory peak in each run,
# torchtitan_megamoe/ab/memory.py, in the same profile_<setup>.md; slows every step).
# Output ($OUT, or ./.out by hand): summary.md, train_check.tar.gz (per setup: report.md,
# ab.png, summary.json, both logs and TOMLs), env.log.
# Exit status: 0 every setup agrees, 1 a setup disagrees, 2 a run failed or logged no steps (for
# (a) whose stock run failed: the verdict of the full-AC stock reference).
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"  # env, $OUT, repo root, PY, install_wheels, run_timeout
install_wheels || exit 2
offline_hf_env
dg_setup  # DeepGEMM where carried (.dgsite/ or .dgsdist/): the kernels its users run
export MEGAMOE_TUNE=${MEGAMOE_TUNE:-0}

CONFIG=${CONFIG:-train_configs/qwen3_30b_a3b_gpu_smoke.toml}
NPROC=${NPROC:-2}
RTOL=${RTOL:-1e-2}
ATOL=${ATOL:-1e-5}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-150}
BUDGET_S=${BUDGET_S:-540}
SETUPS=${SETUPS:-a b}
EXTRA_ARGS=${EXTRA_ARGS:-}
WORK=${WORK:-/tmp/megamoe_train_check}
rm -rf "$WORK"
mkdir -p "$WORK"

{
  env_report
  echo "config $CONFIG nproc $NPROC rtol $RTOL atol $ATOL tune $MEGAMOE_TUNE extra: $EXTRA_ARGS"
} 2>&1 | tee "$OUT/env.log"

setup_args() {
  case $1 in
    a) echo "--parallelism.expert_parallel_degree 2 --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op --compile.enable" ;;
    b) echo "--parallelism.expert_parallel_degree 1 --activation_checkpoint.mode full" ;;
    c) echo "$(setup_args a) --megamoe.save_activations keep" ;;
    t) echo "" ;;
    *) echo "unknown setup $1" >&2; return 1 ;;
  esac
}

# Per-run timeouts: run_timeout (_device_env.sh) with LATER_S (default 80) kept back per setup
# still to come.
LATER_S=${LATER_S:-80}
MIN_RUN_S=${MIN_RUN_S:-45}

count_setups() { echo $#; }
remaining=$(count_setups $SETUPS)
rc=0
bad_setup=0
for s in $SETUPS; do
  args=$(setup_args "$s") || { bad_setup=1; continue; }
  remaining=$((remaining - 1))
  t=$(run_timeout 2 "$remaining")
  if [ "$t" -lt "$MIN_RUN_S" ]; then
    # a run needs ~45 s (start-up, compile or tuning, 20 steps; 25 s runs were seen to
    # cut setup b short): skip rather than spend GPU time on runs that cannot finish
    echo "[megamoe.ab] skipped: BUDGET_S=$BUDGET_S leaves ${t} s per run, under" \
      "MIN_RUN_S=$MIN_RUN_S; raise BUDGET_S or run fewer SETUPS" | tee "$WORK/ab_$s.out"
    bad_setup=1
    continue
  fi
  prof_args=""
  [ -n "${PROFILE_STEP:-}" ] && prof_args="--profile-step $PROFILE_STEP"
  [ -n "${PROFILE_STEP:-}" ] && [ "${MEMORY_SNAPSHOT:-0}" = 1 ] && prof_args="$prof_args --memory-snapshot"
  echo "=== setup $s: $args $EXTRA_ARGS $prof_args (timeout ${t} s per run, $((SECONDS - START)) s elapsed)"
  # shellcheck disable=SC2086
  timeout -k 15 $((2 * t + 60)) $PY -m torchtitan_megamoe.ab --config "$CONFIG" --nproc "$NPROC" \
    --out "$WORK/$s" --rtol "$RTOL" --atol "$ATOL" --timeout "$t" $prof_args -- $args $EXTRA_ARGS \
    >"$WORK/ab_$s.out" 2>&1
  src=$?
  if [ -n "${PROFILE_STEP:-}" ] && [ -f "$WORK/$s/profile.md" ]; then
    cp "$WORK/$s/profile.md" "$OUT/profile_$s.md"
    head -18 "$OUT/profile_$s.md"
  fi
  grep '^\[megamoe.ab\]\|verdict\|max |loss' "$WORK/ab_$s.out"
  echo "setup $s: ab exit $src"
  # Stock failed (no step logged): train stock with full AC as the reference for the converter.
  if [ "$s" = a ] && [ -f "$WORK/a/stock.log" ] && ! grep -q 'step: *1 ' "$WORK/a/stock.log"; then
    t=$(run_timeout 1 "$remaining")
    echo "=== setup a: stock logged no step; stock with full AC as the reference (timeout ${t} s)"
    tail -5 "$WORK/a/stock.log"
    mkdir -p "$WORK/a_stock_fullac"
    # ab's runner: on timeout it stops torchrun and every worker it started.
    # shellcheck disable=SC2086
    $PY - "$t" "$WORK" "$NPROC" $args $EXTRA_ARGS --activation_checkpoint.mode full <<'EOF'
import os, sys, time
from torchtitan_megamoe.ab import run_env, run_one, torchrun_command
t, work, nproc, extra = float(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]
d = os.path.join(work, "a_stock_fullac")
cmd = torchrun_command(os.path.join(work, "a", "stock.toml"), nproc, os.path.join(d, "dump"), extra)
print(" ".join(cmd))
t0 = time.monotonic()
code = run_one(cmd, os.path.join(d, "stock.log"), run_env(d), t)
with open(os.path.join(work, "ab_a.out"), "a") as f:  # the summary lists run times from here
    f.write(f"[megamoe.ab] stock with full AC: exit {code} in {time.monotonic() - t0:.1f} s, "
            f"log {d}/stock.log\n")
sys.exit(code)
EOF
    echo "setup a, stock with full AC: exit $?"
  fi
done

# Summary: one table, per-step losses, the tolerance's reasoning; into $OUT/summary.md.
$PY - "$WORK" "$RTOL" "$ATOL" "$SETUPS" <<'EOF' | tee "$OUT/summary.md"
import json, math, os, sys
from torchtitan_megamoe.ab import compare, parse_log_file as load, run_stats

work, rtol, atol, setups = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4].split()
sys.excepthook = lambda *e: (__import__("traceback").print_exception(*e), sys.exit(3))
desc = {
    "a": "FSDP + EP=2 + per-op SAC + compile",
    "b": "FSDP (EP=1) + full AC",
    "c": "(a) with save_activations=keep",
    "t": "the config as written",
    "a*": "(a), stock with full AC as reference",
}

def fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

rows, details, walls, codes_by_setup = [], [], [], {}
for s in setups:
    try:
        with open(os.path.join(work, f"ab_{s}.out")) as f:
            walls += [f"- setup {s}: {l.strip()[len('[megamoe.ab] '):]}" for l in f
                      if l.startswith("[megamoe.ab]")]
    except OSError:
        pass
    d = os.path.join(work, s)
    if s not in desc:
        continue
    pairs = [(s, load(os.path.join(d, "stock.log")), load(os.path.join(d, "megamoe.log")))]
    alt = os.path.join(work, "a_stock_fullac", "stock.log")
    if s == "a" and os.path.exists(alt):
        pairs.append(("a*", load(alt), pairs[0][2]))
    try:
        with open(os.path.join(d, "summary.json")) as f:
            codes = json.load(f)["returncodes"]
    except (OSError, ValueError, KeyError):
        codes = {}
    alt_code = None
    for w in walls:
        if w.startswith(f"- setup {s}: stock with full AC: exit "):
            alt_code = int(w.split("exit ")[1].split()[0])
    for name, st, cv in pairs:
        run_codes = dict(codes, stock=alt_code) if name == "a*" else codes
        run_failed = len(run_codes) < 2 or any(v != 0 for v in run_codes.values())
        c = compare(st, cv, rtol, atol)
        a, b = run_stats(st), run_stats(cv)
        sa, sb = st.by_step(), cv.by_step()
        g1 = (abs(sa[1].grad_norm - sb[1].grad_norm) / max(abs(sa[1].grad_norm), 1e-12)
              if 1 in sa and 1 in sb else None)
        if not (st.steps and cv.steps):
            verdict = "NO-RUN"
        elif run_failed:  # e.g. timed out: the steps both logged are compared, still a failure
            verdict = "RUN-FAILED" + ("" if c.ok else ", FAIL")
        else:
            verdict = "PASS" if c.ok else "FAIL"
        code = 0 if verdict == "PASS" else 1 if verdict == "FAIL" else 2
        if name == "a" and not st.steps and len(pairs) > 1:
            code = None  # judged by a*: stock could not run this setup, ours is compared there
        if code is not None:
            codes_by_setup[name] = code
        rows.append(
            f"| {name} | {desc[name]} | {verdict} | {len(c.steps)} | {fmt(c.max_abs_diff, '.2e')} "
            f"| {fmt(c.max_rel_diff, '.2e')} | {fmt(c.abs_diff[0] if c.abs_diff else None, '.1e')} "
            f"| {fmt(g1, '.1e')} | {fmt(a['mean_tps'], ',.0f')} / {fmt(b['mean_tps'], ',.0f')} "
            f"| {fmt(a['mean_step_time_s'] * 1e3, '.0f')} / {fmt(b['mean_step_time_s'] * 1e3, '.0f')} "
            f"| {fmt(a['peak_memory_gib'], '.2f')} / {fmt(b['peak_memory_gib'], '.2f')} |"
        )
        lines = [f"### setup {name}: {desc[name]}", ""]
        lines.append(f"exit codes {run_codes or '(ab did not finish)'}; report {d}/report.md")
        lines += [f"- {p}" for p in c.problems[:6]] + [""]
        lines += ["| step | loss stock | loss megamoe | abs diff | gnorm stock | gnorm megamoe |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for k in sorted(set(sa) | set(sb)):
            x, y = sa.get(k), sb.get(k)
            lines.append(
                f"| {k} | {fmt(x and x.loss, '.5f')} | {fmt(y and y.loss, '.5f')} | "
                f"{fmt(x and y and abs(x.loss - y.loss), '.1e')} | "
                f"{fmt(x and x.grad_norm, '.4f')} | {fmt(y and y.grad_norm, '.4f')} |"
            )
        details += lines + [""]

print("# GPU training check: stock TorchTitan vs megamoe converter\n")
print(f"Tolerance: |loss diff| <= {atol:g} + {rtol:g} * |loss| at every step (bf16 noise: the two "
      "runs round bf16 at different points, e.g. the expert intermediates, so step 1's loss "
      "differs by ~1e-3 relative; bf16 router scores tie often among 128 experts and a flipped "
      "top-8 choice changes a token's output; AdamW normalises updates, which amplifies tiny "
      "gradient differences of small-gradient weights, so the gap grows over steps. A wrong "
      "gradient or stale expert shard moves the loss by far more within a few steps.) "
      "Step-1 loss diff = forward only (same weights); step-1 grad-norm rel diff = backward.\n")
print("| setup | what | verdict | steps | max abs diff | max rel diff | step-1 loss diff "
      "| step-1 gnorm rel diff | tok/s/GPU stock / ours | ms/step stock / ours "
      "| peak reserved GiB stock / ours |")
print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
print("\n".join(rows))
print()
print("Run wall times (start-up, compile and all steps):\n")
print("\n".join(walls))
print()
print("\n".join(details))
status = max(codes_by_setup.values(), default=2)
print(f"Exit status {status} (0 all agree, 1 a loss mismatch, 2 a run failed) from {codes_by_setup}")
sys.exit(status)
EOF
src=${PIPESTATUS[0]}
# 3: the summary itself failed (traceback above); anything but 0/1 counts as a failed run.
[ "$src" != 0 ] && [ "$src" != 1 ] && src=2
rc=$src
[ "$bad_setup" = 1 ] && rc=2

# Everything else in one archive (the dump folders hold nothing needed: no checkpoints).
tar -czf "$OUT/train_check.tar.gz" -C "$WORK" --exclude='*/dump' --exclude='*/stock' \
  --exclude='*/megamoe' --exclude='*/hf_home' . 2>/dev/null
echo "total $((SECONDS - START)) s; exit $rc; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
