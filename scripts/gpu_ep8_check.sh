#!/usr/bin/env bash
# On a machine with 8 GPUs: the MoE layer at EP=8 and the full-step A/B at 8 GPUs.
#
#   bash scripts/gpu_ep8_check.sh
#
# Needs a CUDA torch, torchtitan==0.2.2 and this package. Optional, for machines without network
# access: .whl/ with the wheels listed in scripts/gpu_check.sh, installed into /tmp/site first.
# Parts, in this order (PARTS picks a subset, e.g. PARTS="ab235"):
#   bench  torchrun --nproc_per_node 8 -m torchtitan_megamoe.bench --ep 8: Qwen3-30B-A3B and
#          235B-A22B layer shapes, 16384 tokens per GPU (16 experts per GPU), forward and
#          forward + backward of stock TorchTitan's EP=8 layer (ExpertParallel) and ours on the
#          same weights and routing in the same run, plus ours at EP=1; --iters 10.
#   ab30   python -m torchtitan_megamoe.ab --nproc 8 on train_configs/qwen3_30b_a3b_ab_8gpu.toml
#   ab235  the same on train_configs/qwen3_235b_a22b_ab_8gpu.toml (235B-A22B-L14)
#          (both: stock and converter, same seed, AB_STEPS steps, losses within RTOL/ATOL).
# Budget: the whole script stays within BUDGET_S (default 550 s): the bench gets at
# most BENCH_TIMEOUT_S, then the A/B time left is split evenly over the A/B runs still to come
# (each at most RUN_TIMEOUT_S). A run that times out still has its logged steps compared and
# timed; it counts as failed. If the A/Bs time out before a few steady steps, run the parts
# separately (PARTS="bench ab30", then PARTS=ab235) or raise BUDGET_S and RUN_TIMEOUT_S.
# Env knobs: PARTS ("bench ab30 ab235"), NPROC (8), BENCH_ARGS (appended to the bench, e.g.
# "--shapes 30b --no-ep1"), BENCH_TIMEOUT_S (150), AB_STEPS (10, --training.steps), RTOL (1e-2),
# ATOL (1e-2), RUN_TIMEOUT_S (per torchrun of an A/B, 240), BUDGET_S (550), EXTRA_ARGS (appended
# to every A/B run), AB30_ARGS / AB235_ARGS (to one A/B, e.g. "--model.flavor 30B-A3B-L24"),
# MEGAMOE_TUNE (default 1: kernel tuner on, as in production), WHEELS=0 (use the current
# env, not .whl), PYTHON (python3), WORK (/tmp/megamoe_ep8_check).
# Output, in $OUT (./.out by hand), refreshed after every part so a cut-off run still leaves
# what finished: summary.md (the ratios and their targets), env.log, bench_ep<N>.json,
# ab30/report.md + ab30/ab.png, ab235/report.md + ab235/ab.png, ep8_check.tar.gz (bench log, A/B
# stdout, per A/B summary.json, both runs' logs and TOMLs).
# Exit status: 0 every part ran and the losses agree, 1 a loss mismatch, 2 a part failed, timed
# out or logged nothing. The speed targets do not set it; summary.md marks them MET / MISSED.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"  # env, $OUT, repo root, PY, install_wheels, run_timeout
install_wheels || exit 2
offline_hf_env
export MEGAMOE_TUNE=${MEGAMOE_TUNE:-1}

PARTS=${PARTS:-bench ab30 ab235}
NPROC=${NPROC:-8}
BENCH_ARGS=${BENCH_ARGS:-}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-150}
AB_STEPS=${AB_STEPS:-10}
RTOL=${RTOL:-1e-2}
ATOL=${ATOL:-1e-2}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-240}
BUDGET_S=${BUDGET_S:-550}
EXTRA_ARGS=${EXTRA_ARGS:-}
WORK=${WORK:-/tmp/megamoe_ep8_check}
ASSETS=outputs/assets/megamoe_tiny  # what both 8-GPU TOMLs read
rm -rf "$WORK" "$OUT/summary.md" "$OUT/bench_ep$NPROC.json" "$OUT/ab30" "$OUT/ab235" \
  "$OUT/ep8_check.tar.gz"
mkdir -p "$WORK/status"

{
  env_report
  echo "parts $PARTS nproc $NPROC steps $AB_STEPS rtol $RTOL atol $ATOL tune $MEGAMOE_TUNE"
  echo "bench args: $BENCH_ARGS; A/B extra: $EXTRA_ARGS | 30: ${AB30_ARGS:-} | 235: ${AB235_ARGS:-}"
} 2>&1 | tee "$OUT/env.log"

ab_config() {
  case $1 in
    ab30) echo "train_configs/qwen3_30b_a3b_ab_8gpu.toml" ;;
    ab235) echo "train_configs/qwen3_235b_a22b_ab_8gpu.toml" ;;
    *) return 1 ;;
  esac
}
for p in $PARTS; do
  [ "$p" = bench ] || ab_config "$p" >/dev/null \
    || { echo "unknown part '$p' in PARTS; use some of: bench ab30 ab235"; exit 2; }
done

# summary.md from whatever $WORK holds now, and the archive; run after every part.
collect() {
  $PY - "$WORK" "$OUT" "$NPROC" "$RTOL" "$ATOL" "$PARTS" <<'EOF' >"$WORK/summary.out" 2>&1
import glob, json, math, os, shutil, sys
from torchtitan_megamoe.ab import compare, parse_log_file as load, run_stats

work, out, nproc, rtol, atol, parts = sys.argv[1:7]
nproc, rtol, atol, parts = int(nproc), float(rtol), float(atol), parts.split()
FWD_X, BWD_X, STEP_X = 3.5, 1.5, 1.5  # targets: layer fwd, layer bwd, 30B full step


def status(part):
    try:
        with open(os.path.join(work, "status", part)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None  # not run (yet)


def fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def ratio(a, b):
    return a / b if a and b else None


def met(x, target):
    return "-" if x is None else ("MET" if x >= target else "MISSED")


lines = [f"# EP={nproc} check: stock TorchTitan vs megamoe", ""]
codes = {}
if "bench" in parts:
    rc = status("bench")
    results = []
    path = os.path.join(out, f"bench_ep{nproc}.json")
    if os.path.exists(path):
        with open(path) as f:
            results = json.load(f)["results"]
    elif os.path.exists(os.path.join(work, "bench.log")):
        # cut short: rank 0 printed each finished shape as one JSON line
        with open(os.path.join(work, "bench.log"), errors="replace") as f:
            results = [json.loads(l) for l in f if l.startswith('{"shape"')]
    codes["bench"] = 0 if rc == 0 and results else 2
    lines += [f"## MoE layer, EP={nproc}, same run (bench exit {rc})", "",
              "bwd = (fwd+bwd) - fwd, both medians of their own timed calls. Targets: fwd >= "
              f"{FWD_X}x, bwd >= {BWD_X}x stock (reference system: fwd 3.11x on 30B, bwd 1.24x "
              "on 235B).", "",
              "| shape | tokens/GPU | stock fwd ms | ours fwd ms | fwd x | stock bwd ms "
              "| ours bwd ms | bwd x | stock fwd+bwd ms | ours fwd+bwd ms | fwd+bwd x "
              "| ours EP=1 fwd / fwd+bwd ms | rel err vs stock | fwd target | bwd target |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
              "| ---: | ---: | --- | --- |"]
    for r in results:
        sf, of = r.get("stock_fwd_ms"), r.get("ours_fwd_ms")
        sfb, ofb = r.get("stock_fwdbwd_ms"), r.get("ours_fwdbwd_ms")
        sb = sfb - sf if sfb and sf else None
        ob = ofb - of if ofb and of else None
        fx, bx = ratio(sf, of), ratio(sb, ob)
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {fmt(sf, '.3f')} | {fmt(of, '.3f')} | "
            f"{fmt(fx, '.2f')} | {fmt(sb, '.3f')} | {fmt(ob, '.3f')} | {fmt(bx, '.2f')} | "
            f"{fmt(sfb, '.3f')} | {fmt(ofb, '.3f')} | {fmt(ratio(sfb, ofb), '.2f')} | "
            f"{fmt(r.get('ours_ep1_fwd_ms'), '.3f')} / {fmt(r.get('ours_ep1_fwdbwd_ms'), '.3f')} | "
            f"{fmt(r.get('rel_err_vs_stock'), '.1e')} | {met(fx, FWD_X)} | {met(bx, BWD_X)} |")
    lines.append("")
    lines += [f"- {r['shape']}: stock EP failed: {r['stock_error'][:300]}"
              for r in results if "stock_error" in r]
    if not results:
        lines.append("No result: see bench.log in ep8_check.tar.gz.")
    lines.append("")


def tail_tps(run):  # steady state: the last half of the logged steps (tuning, compiles done)
    t = [s.tps for s in run.steps[len(run.steps) // 2:]]
    return sum(t) / len(t) if t else None


ab_parts = [p for p in parts if p != "bench"]
notes = []
if ab_parts:
    lines += [f"## Full training step, {nproc} GPUs (torchtitan.train, stock vs converter)", "",
              f"Losses within |diff| <= {atol:g} + {rtol:g} * |loss| per step. tok/s per GPU: "
              "mean of step 2+ (as ab's report), and of the last half of the steps (after the "
              f"kernel tuner and compiles). Target: 30B full step >= {STEP_X}x stock tok/s.", "",
              "| A/B | config | verdict | steps stock / ours | max rel loss diff "
              "| tok/s step 2+ stock / ours | x | tok/s last half stock / ours | x "
              "| ms/step stock / ours | peak GiB stock / ours | target | exit codes |",
              "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- "
              "| --- |"]
for p in ab_parts:
    d = os.path.join(work, p)
    rc = status(p)
    st, cv = load(os.path.join(d, "stock.log")), load(os.path.join(d, "megamoe.log"))
    try:
        with open(os.path.join(d, "summary.json")) as f:
            s = json.load(f)
        cfg, run_codes = s.get("config", "?"), s.get("returncodes", {})
    except (OSError, ValueError):
        cfg, run_codes = "?", {}
    c = compare(st, cv, rtol, atol)
    a, b = run_stats(st), run_stats(cv)
    failed = rc is None or len(run_codes) < 2 or any(v != 0 for v in run_codes.values())
    if rc is None:
        verdict = "NOT RUN"
    elif not (st.steps and cv.steps):
        verdict = "NO-RUN"
    elif failed:  # e.g. timed out: the losses of the steps both logged still say something
        bad = [q for q in c.problems if q.startswith("step ")]
        verdict = "RUN-FAILED, " + ("FAIL" if bad else f"{len(c.steps)} common steps agree")
    else:
        verdict = "PASS" if c.ok else "FAIL"
    codes[p] = 0 if verdict == "PASS" else 1 if verdict == "FAIL" else 2
    x_mean = ratio(b["mean_tps"], a["mean_tps"])
    ts, tc = tail_tps(st), tail_tps(cv)
    x_tail = ratio(tc, ts)
    lines.append(
        f"| {p} | {os.path.basename(cfg)} | {verdict} | {len(st.steps)} / {len(cv.steps)} | "
        f"{fmt(c.max_rel_diff, '.1e')} | {fmt(a['mean_tps'], ',.0f')} / "
        f"{fmt(b['mean_tps'], ',.0f')} | {fmt(x_mean, '.2f')} | {fmt(ts, ',.0f')} / "
        f"{fmt(tc, ',.0f')} | {fmt(x_tail, '.2f')} | {fmt(a['mean_step_time_s'] * 1e3, '.0f')} / "
        f"{fmt(b['mean_step_time_s'] * 1e3, '.0f')} | {fmt(a['peak_memory_gib'], '.1f')} / "
        f"{fmt(b['peak_memory_gib'], '.1f')} | "
        f"{met(x_tail, STEP_X) if p == 'ab30' else '(none)'} | {run_codes or rc} |")
    notes += [f"- {p}: {q[:200]}" + ("..." if len(q) > 200 else "") for q in c.problems[:3]]
    # the A/B's own report and plot, one folder per A/B
    for name in ("report.md", "ab.png"):
        if os.path.exists(os.path.join(d, name)):
            os.makedirs(os.path.join(out, p), exist_ok=True)
            shutil.copy(os.path.join(d, name), os.path.join(out, p, name))
if ab_parts:
    lines += [""] + notes + ([""] if notes else [])
    walls = []
    for p in ab_parts:
        try:
            walls += [f"- {p}: {l.strip()[len('[megamoe.ab] '):]}"
                      for l in open(os.path.join(work, f"{p}.out"), errors="replace")
                      if l.startswith("[megamoe.ab]")]
        except OSError:
            pass
    lines += ["Run wall times (start-up, compile and all steps):", ""] + walls + [""]
done = [p for p in parts if status(p) is not None]
code = max(codes.values(), default=2) if len(done) == len(parts) else 2
lines.append(f"Exit status {code} (0 all ran and agree, 1 a loss mismatch, 2 a part failed or "
             f"did not run) from {codes}; parts run: {done} of {parts}")
text = "\n".join(lines) + "\n"
with open(os.path.join(out, "summary.md"), "w") as f:
    f.write(text)
print(text)
sys.exit(code)
EOF
  local src=$?
  cat "$WORK/summary.out"
  # Everything else in one archive (the dump folders hold nothing needed: no checkpoints).
  tar -czf "$OUT/ep8_check.tar.gz" -C "$WORK" --exclude='*/stock' --exclude='*/megamoe' \
    --exclude='*/hf_home' . 2>/dev/null
  return $src
}

n_ab=0
for p in $PARTS; do [ "$p" = bench ] || n_ab=$((n_ab + 1)); done
for p in $PARTS; do
  if [ "$p" = bench ]; then
    t=$(RUN_TIMEOUT_S=$BENCH_TIMEOUT_S run_timeout 1 0)
    echo "=== bench: EP=$NPROC, timeout $t s, $((SECONDS - START)) s elapsed"
    # ab's runner: on timeout it stops torchrun and every worker (no GPU left held for the A/Bs).
    # shellcheck disable=SC2086
    $PY - "$t" "$WORK/bench.log" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
      -m torchtitan_megamoe.bench --ep "$NPROC" --shapes 30b,235b --iters 10 \
      --json "$OUT/bench_ep$NPROC.json" $BENCH_ARGS <<'EOF'
import sys
from torchtitan_megamoe.ab import run_env, run_one
t, log, args = float(sys.argv[1]), sys.argv[2], sys.argv[3:]
sys.exit(run_one([sys.executable, *args], log, run_env("/tmp/megamoe_ep8_bench"), t))
EOF
    echo $? >"$WORK/status/bench"
    grep -v '^{' "$WORK/bench.log" | tail -25
    echo "bench exit $(cat "$WORK/status/bench")"
  else
    if [ ! -f "$WORK/assets_done" ]; then  # before the budget split: not inside a run's timeout
      $PY -m torchtitan_megamoe.assets --out "$ASSETS" && touch "$WORK/assets_done"
    fi
    cfg=$(ab_config "$p")
    case $p in ab30) own=${AB30_ARGS:-} ;; ab235) own=${AB235_ARGS:-} ;; esac
    t=$(run_timeout $((2 * n_ab)) 0)
    n_ab=$((n_ab - 1))
    echo "=== $p: $cfg, $AB_STEPS steps, timeout $t s per run, $((SECONDS - START)) s elapsed"
    # shellcheck disable=SC2086
    timeout -k 15 $((2 * t + 60)) $PY -m torchtitan_megamoe.ab --config "$cfg" --nproc "$NPROC" \
      --out "$WORK/$p" --rtol "$RTOL" --atol "$ATOL" --timeout "$t" -- \
      --training.steps "$AB_STEPS" $EXTRA_ARGS $own >"$WORK/$p.out" 2>&1
    echo $? >"$WORK/status/$p"
    grep '^\[megamoe.ab\]\|verdict\|max |loss\|Speed-up' "$WORK/$p.out"
    echo "$p: ab exit $(cat "$WORK/status/$p")"
  fi
  collect >/dev/null
done

collect
rc=$?
[ "$rc" != 0 ] && [ "$rc" != 1 ] && rc=2  # 3+: the summary itself failed (traceback above)
echo "total $((SECONDS - START)) s; exit $rc; files in $OUT: $(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"
exit $rc
