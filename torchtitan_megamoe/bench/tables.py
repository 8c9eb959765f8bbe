"""The markdown tables the benchmark prints (and docs/PERF.md records)."""

from __future__ import annotations

from torchtitan_megamoe.ops.recipe import recipe_named

# bench/backward_stages.py's stage keys in backward order: (label, Triton side, grouped_mm side
# or None). The tuner picks a side per stage; "auto" below is what the layer runs.
BWD_STAGES = [
    ("gemm1_swiglu (forward, inference)", "gemm1_swiglu", None),
    ("gemm1_swiglu + store a1/a3 (forward, training)", "gemm1_swiglu_save_a", None),
    ("plan (built by the forward, reused)", "plan", None),
    ("dgrad2_swiglu on saved a1/a3", "dgrad2_swiglu", "dgrad2_swiglu_grouped_mm"),
    ("dgrad2_swiglu, sm90 dh GEMM + SwiGLU rows kernel (dy gather included)",
     "dgrad2_swiglu_sm90", None),
    ("dgrad2_swiglu, sm90 in one launch (dy rows stored for wgrad_dw2)",
     "dgrad2_swiglu_sm90_fused", None),
    ("wgrad_dw2", "wgrad_dw2", "wgrad_dw2_grouped_mm"),
    ("wgrad_dw2, sm90 kernel (dy gathered inside)", "wgrad_dw2_sm90", None),
    ("wgrad_dw2, sm90 kernel on gathered dy rows", "wgrad_dw2_sm90_pre_gathered", None),
    ("wgrad dw1", "wgrad_dw1", None),
    ("wgrad dw3", "wgrad_dw3", None),
    ("wgrad_dw13 (dw1 + dw3)", "wgrad_dw13", "wgrad_dw13_grouped_mm"),
    ("wgrad_dw13, sm90 kernel (x gathered inside)", "wgrad_dw13_sm90", None),
    ("wgrad_dw13, sm90 kernel on gathered x rows", "wgrad_dw13_sm90_pre_gathered", None),
    ("dgrad1", "dgrad1", "dgrad1_grouped_mm"),
    ("dgrad1, sm90 kernel (dx in row space)", "dgrad1_sm90", None),
    ("bwd_combine (dx, d topk_weights)", "bwd_combine", None),
    ("bwd_combine of row-space dx (after the sm90 dgrad1)", "bwd_combine_rows", None),
    ("backward total, one side forced", "total", "total_grouped_mm"),
    ("backward total, tuner's pick per stage", "total_auto", None),
    ("backward total, recompute path (no saved a: GEMM 1 again)", "total_recompute", None),
]
# stages timed only where the sm90 kernels run (an sm_90 GPU with nvcc); '-' elsewhere
SM90_ONLY_STAGES = {"dgrad2_swiglu_sm90", "dgrad2_swiglu_sm90_fused", "wgrad_dw2_sm90",
                    "wgrad_dw2_sm90_pre_gathered", "wgrad_dw13_sm90",
                    "wgrad_dw13_sm90_pre_gathered", "dgrad1_sm90", "bwd_combine_rows"}


def _tflops(flops: float, ms: float | None) -> str:
    return f"{flops / (ms * 1e-3) / 1e12:.0f}" if ms else "n/a"


BASELINES = (
    ("stock", "stock eager"),
    ("stock_compiled", "stock compiled"),
    ("stock_block", "stock block-compiled"),
    ("stock_fp8", "stock + torchao FP8 compiled"),
)
"""(result-key prefix, label) of the stock layers ours is timed against: TorchTitan's MoE block
eager, compiled as --compile.enable compiles it, the whole block under one torch.compile
(fullgraph where it traces: bench/stock.py BlockCompiledStock), and with torchao's rowwise FP8
grouped GEMMs (compiled), all bf16 in and out."""

VS_LABELS = {"stock": "vs eager", "stock_compiled": "vs compiled",
             "stock_block": "vs block-compiled", "stock_fp8": "vs torchao FP8"}
"""The table's ratio column of each baseline (ours' speedup over it)."""


def ours_name(precision: str) -> str:
    """Result-key prefix of ours at a precision (as bench/ep1.py writes them)."""
    return "ours" if precision == "bf16" else f"ours_{precision}"


def floor_ms(r: dict, tag: str, precision: str) -> float:
    """The compute floor of one pass: its GEMM flops at the dense rate of the precision its
    GEMMs run in (fp8: all FP8; fp8_bwd: forward bf16, backward FP8; bf16: all bf16); the
    backward is 2x the forward's flops."""
    flops = r["flops_fwd"]
    bf16 = r.get("peak_tflops", 765.0) * 1e9  # flops per ms
    fp8 = r.get("peak_fp8_tflops", 1339.0) * 1e9
    recipe = recipe_named(precision)
    fwd_rate = fp8 if recipe.fp8_forward else bf16
    if tag == "fwd":
        return flops / fwd_rate
    bwd_rate = fp8 if recipe.fp8_dgrad else bf16
    return flops / fwd_rate + 2 * flops / bwd_rate


def _cell_note(note: str, width: int = 140) -> str:
    note = " ".join(note.replace("|", "/").split())
    return note if len(note) <= width else note[: width - 3] + "..."


TIMINGS = {
    "waited": "{who}_{tag}_ms",
    "b2b": "{who}_{tag}_b2b_ms",
}
"""Which time a table row reads: each call waited for (median), or calls back to back (their
mean; fwdbwd with fresh .grad)."""


def layer_rows(r: dict, timing: str = "waited") -> list[dict]:
    """One dict per (pass, precision of ours) of one shape's result: ours' time, the baselines'
    times and ours' speedup over each (``x_<baseline>``), ours' TFLOP/s, its compute floor and
    the fraction of it reached, and (fwdbwd) the peak memory of one step and ours' first call.
    What the tables print and the JSON carries ("rows", "rows_b2b")."""
    key = TIMINGS[timing]
    rows = []
    for tag, mult in (("fwd", 1), ("fwdbwd", 3)):
        if all(r.get(key.format(who=who, tag=tag)) is None for who, _ in BASELINES) and \
                r.get(key.format(who="ours", tag=tag)) is None:
            continue  # pass not run
        base = {who: r.get(key.format(who=who, tag=tag)) for who, _ in BASELINES}
        for p in r.get("precisions", ["bf16"]):
            who = ours_name(p)
            ms = r.get(key.format(who=who, tag=tag))
            floor = floor_ms(r, tag, p)
            row = {"pass": tag, "precision": p, "ours_ms": ms}
            for b, _ in BASELINES:
                row[f"{b}_ms"] = base[b]
                row[f"x_{b}"] = base[b] / ms if base[b] and ms else None
            if r.get(f"stock_block_{tag}_first_call_s") is not None:
                # its compilation: the first call of this pass
                row["stock_block_first_call_s"] = r[f"stock_block_{tag}_first_call_s"]
            row["tflops"] = mult * r["flops_fwd"] / (ms * 1e9) if ms else None
            row["floor_ms"] = floor
            row["floor_frac"] = floor / ms if ms else None
            if tag == "fwdbwd":
                row["peak_mib"] = r.get(f"{who}_fwdbwd_peak_mib")
                row["first_call_s"] = r.get(f"{who}_first_call_s")
            note = r.get(f"{who}_{tag}_note")
            if note and ms is None:
                row["note"] = note if note.startswith(("not available", "failed")) \
                    else f"not available: {note}"
            rows.append(row)
    return rows


def _num(v, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def table(results: list[dict], timing: str = "waited") -> str:
    """The layer table: one row per shape, pass and precision of ours, with the stock
    baselines' times and ours' speedup over each; ``timing`` picks the waited medians or the
    back-to-back means (see TIMINGS). The waited table is followed by the lines of the other
    measures (fresh .grad, router alone, host issue time, the baselines' compile and memory)."""
    full = timing == "waited"
    head = ("| shape | pass | ours | ours ms | "
            + "".join(f"{label} ms | " for _, label in BASELINES)
            + "".join(f"{VS_LABELS[b]} | " for b, _ in BASELINES)
            + "ours TFLOP/s | floor ms | floor/ours |")
    if full:
        head += " peak MiB (fwd+bwd) | first call s |"
    lines = [head, "| --- " * (head.count("|") - 1) + "|"]
    for r in results:
        for row in layer_rows(r, timing):
            ms = row["ours_ms"]
            cells = [r["shape"], row["pass"], row["precision"],
                     _num(ms, ".3f") if ms is not None else _cell_note(row.get("note", "n/a"))]
            cells += [_num(row[f"{b}_ms"], ".3f") for b, _ in BASELINES]
            cells += [_num(row[f"x_{b}"], ".2f") + ("x" if row[f"x_{b}"] else "")
                      for b, _ in BASELINES]
            cells += [_num(row["tflops"], ".0f"), f"{row['floor_ms']:.2f}",
                      _num(row["floor_frac"], ".2f")]
            if full:
                cells += [_num(row.get("peak_mib"), ".0f"), _num(row.get("first_call_s"), ".1f")]
            lines.append("| " + " | ".join(cells) + " |")
    if not full:
        return "\n".join(lines)
    for r in results:
        st, o = r.get("stock_fwdbwd_fresh_ms"), r.get("ours_fwdbwd_fresh_ms")
        if st and o:
            lines.append(f"{r['shape']} fwd+bwd with fresh .grad (set to None before each "
                         f"step, as a training step's first backward): stock {st:.3f}, ours "
                         f"{o:.3f} ({st / o:.2f}x); peak memory above the inputs during "
                         f"the step: stock {r['stock_fwdbwd_peak_mib']:.0f} MiB, ours "
                         f"{r['ours_fwdbwd_peak_mib']:.0f} MiB")
    for r in results:
        if r.get("router_ms") and r.get("ours_router_ms"):
            lines.append(f"{r['shape']} router alone (gate, scores, top-k, counts): stock "
                         f"{r['router_ms']:.3f} ms, ours {r['ours_router_ms']:.3f} ms")
    for r in results:
        if r.get("stock_fwd_host_ms") and r.get("ours_fwd_host_ms"):
            lines.append(f"{r['shape']} fwd host issue time (device idle before the call, "
                         f"median): stock {r['stock_fwd_host_ms']:.3f} ms, ours "
                         f"{r['ours_fwd_host_ms']:.3f} ms")
    lines += baseline_lines(results)
    return "\n".join(lines)


def baseline_lines(results: list[dict]) -> list[str]:
    """Per shape: the compiled baselines' warm-up (compilation) time (the block-compiled one's
    also per first call, with its mode and graph breaks), their output's difference
    from stock eager, graphs compiled while timing, the peak memory of one fwd+bwd of every
    layer, ours' first-call notes, and every baseline or precision that did not run and why."""
    lines = []
    for r in results:
        parts = []
        for b, label in BASELINES[1:]:
            w = [f"{tag} {r[f'{b}_{tag}_warmup_s']:.1f} s" for tag in ("fwd", "fwdbwd")
                 if r.get(f"{b}_{tag}_warmup_s") is not None]
            if w:
                extra = []
                if b == "stock_block":
                    label += f" ({_block_how(r)})"
                    first = [f"{tag} {r[f'{b}_{tag}_first_call_s']:.1f} s"
                             for tag in ("fwd", "fwdbwd")
                             if r.get(f"{b}_{tag}_first_call_s") is not None]
                    if first:
                        extra.append("first call alone " + ", ".join(first))
                if r.get(f"{b}_rel_err_vs_stock") is not None:
                    extra.append(f"output {r[f'{b}_rel_err_vs_stock']:.1e} from stock eager")
                if r.get(f"{b}_recompiles"):
                    extra.append(f"RECOMPILED {r[f'{b}_recompiles']} graphs while timed")
                parts.append(f"{label}: first 2 calls (compilation) " + ", ".join(w)
                             + (f" ({'; '.join(extra)})" if extra else ""))
        if parts:
            lines.append(f"{r['shape']} " + "; ".join(parts))
        peaks = []
        for who, label in BASELINES + tuple(
                (ours_name(p), f"ours {p}") for p in r.get("precisions", ["bf16"])):
            v = r.get(f"{who}_fwdbwd_peak_mib")
            if v is not None:
                peaks.append(f"{label} {v:.0f}")
        if peaks:
            lines.append(f"{r['shape']} peak memory of one fwd+bwd above the inputs (fresh "
                         "grads, MiB; the FP8 rows include the weights' FP8 copies held "
                         "across calls): " + ", ".join(peaks))
        notes = []
        for b, label in BASELINES[1:]:
            for suffix, what in (("note", ""), ("fwd_note", " fwd"), ("fwdbwd_note", " fwd+bwd")):
                if r.get(f"{b}_{suffix}"):
                    notes.append(f"{label}{what}: {_cell_note(r[f'{b}_{suffix}'], 400)}")
        for p in r.get("precisions", ["bf16"]):
            if r.get(f"{ours_name(p)}_first_call_note"):
                notes.append(f"ours {p} first call: "
                             f"{_cell_note(r[f'{ours_name(p)}_first_call_note'], 400)}")
        if r.get("stock_block_fullgraph_error"):
            notes.append("stock block-compiled: fullgraph=True did not trace, so it ran "
                         "compiled with graph breaks: "
                         + _cell_note(r["stock_block_fullgraph_error"], 400))
        if r.get("stock_block_break_reasons"):
            notes.append("stock block-compiled graph breaks: " + "; ".join(
                f"{n}x {_cell_note(why, 120)}"
                for why, n in r["stock_block_break_reasons"].items()))
        lines += [f"{r['shape']} {n}" for n in notes]
    return lines


def _block_how(r: dict) -> str:
    """How the block-compiled baseline compiled: fullgraph or with graph breaks, and how many
    graphs its first forward compiled."""
    mode = r.get("stock_block_mode", "?")
    how = "fullgraph" if mode == "fullgraph" else "torch.compile default, graph breaks allowed"
    if r.get("stock_block_graphs") is not None:
        how += (f", {r['stock_block_graphs']} graph(s) and {r['stock_block_graph_breaks']} "
                "graph break(s) in the forward")
    return how


ACCURACY_ROWS = (
    ("ours_bf16", "ours bf16"),
    ("ours_fp8", "ours fp8"),
    ("ours_fp8_bwd", "ours fp8_bwd"),
    ("stock", "stock bf16 (eager)"),
    ("stock_torchao_fp8", "stock + torchao FP8 (eager)"),
)
ACCURACY_COLS = ("out", "dx", "dw1", "dw2", "dw3", "dtopk_weights")


def accuracy_table(results: list[dict]) -> str:
    """Relative errors against float64 on the same inputs (bench/accuracy.py), one row per
    layer and shape; '' when no result has them."""
    rs = [r for r in results if "accuracy" in r or "accuracy_error" in r]
    if not rs:
        return ""
    lines = ["op-level relative error against float64, same inputs (||got - ref|| / ||ref||; "
             "stock routes inside its layer: its dx carries the router's gradient, so only its "
             "output and weight gradients compare):",
             "| shape | layer | out | dx | dw1 | dw2 | dw3 | d topk_weights | note |",
             "| --- " * 9 + "|"]
    for r in rs:
        if "accuracy_error" in r:
            lines.append(f"| {r['shape']} | all | " + "n/a | " * 6
                         + _cell_note(r["accuracy_error"]) + " |")
            continue
        acc = r["accuracy"]
        for key, label in ACCURACY_ROWS:
            e = acc.get(key)
            if e is None:
                continue
            cells = ["-" if e.get(c) is None else f"{e[c]:.2e}" for c in ACCURACY_COLS]
            note = e.get("note") or e.get("grad_note") or ""
            lines.append(f"| {r['shape']} | {label} | " + " | ".join(cells)
                         + f" | {_cell_note(note)} |")
    return "\n".join(lines)


def _b2b_line(results: list[dict], head: str) -> str:
    """One line of the back-to-back times (``{who}_{tag}_b2b_ms``) of every result: stock, stock
    compiled where timed, ours, ours' ratio to each and, where measured, ours at EP=1; '' when no
    result has them."""
    b2b = []
    for r in results:
        for tag in ("fwd", "fwdbwd"):
            o, st, sc, e1 = (r.get(f"{who}_{tag}_b2b_ms")
                             for who in ("ours", "stock", "stock_compiled", "ours_ep1"))
            if o:
                b2b.append(f"{r['shape']} {tag}: stock {st or float('nan'):.3f}"
                           + (f", stock compiled {sc:.3f}" if sc else "")
                           + f", ours {o:.3f}"
                           + (f" ({st / o:.2f}x" if st else "")
                           + (f", {sc / o:.2f}x compiled" if st and sc else "")
                           + (")" if st else "")
                           + (f", ours EP=1 {e1:.3f} (EP=N/EP=1 {o / e1:.2f}x)" if e1 else ""))
    return head + "; ".join(b2b) if b2b else ""


def bwd_table(results: list[dict]) -> str:
    """Backward stages: per shape, the Triton side's and the grouped_mm side's "ms (TFLOP/s)";
    '' when no result has a breakdown."""
    cols = [r for r in results if "bwd_stages" in r or "bwd_stages_error" in r]
    if not cols:
        return ""

    def cell(b, key):
        ms = b.get(f"{key}_ms") if key else None
        if ms is None:
            return "-"
        tf = b.get(f"{key}_tflops")
        return f"{ms:.3f}" + (f" ({tf:.0f})" if tf else "")

    head = "| backward stage, ms (TFLOP/s) | " + " | ".join(
        f"{r['shape']} Triton | {r['shape']} grouped_mm" for r in cols) + " |"
    lines = [head, "| --- |" + " --- | --- |" * len(cols)]
    for label, tri, cub in BWD_STAGES:
        cells = []
        for r in cols:
            b = r.get("bwd_stages")
            if b is None:
                cells.append("error | " + r["bwd_stages_error"].replace("|", "/")[:80])
            else:
                cells.append(f"{cell(b, tri)} | {cell(b, cub)}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    cells = []
    for r in cols:  # the layer's own backward share (other routing), to cross-check the totals
        fb, f = r.get("ours_fwdbwd_ms"), r.get("ours_fwd_ms")
        cells.append((f"{fb - f:.3f}" if fb and f else "n/a") + " | -")
    lines.append("| layer: ours fwd+bwd - fwd (its own routing) | " + " | ".join(cells) + " |")
    picks = [f"{r['shape']}: {r['bwd_stages']['auto_picks']}" for r in cols
             if r.get("bwd_stages", {}).get("auto_picks")]
    return "\n".join(lines + [f"tuner's side per stage, {p}" for p in picks])


def ep_table(results: list[dict]) -> str:
    lines = [
        "| shape | EP | pass | stock ms | stock compiled ms | ours ms | speedup | vs compiled "
        "| stock TFLOP/s | ours TFLOP/s | floor/ours | ours EP=1 ms | EP=N / EP=1 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for tag, mult in (("fwd", 1), ("fwdbwd", 3)):
            ours = r.get(f"ours_{tag}_ms")
            if ours is None:
                continue
            flops = mult * r["flops_fwd"]
            stock = r.get(f"stock_{tag}_ms")
            comp = r.get(f"stock_compiled_{tag}_ms")
            ep1 = r.get(f"ours_ep1_{tag}_ms")
            lines.append(
                f"| {r['shape']} | {r['ep']} | {tag} | "
                + (f"{stock:.3f}" if stock else "n/a") + " | "
                + (f"{comp:.3f}" if comp else "n/a") + f" | {ours:.3f} | "
                + (f"{stock / ours:.2f}x" if stock else "n/a") + " | "
                + (f"{comp / ours:.2f}x" if comp else "n/a")
                + f" | {_tflops(flops, stock)} | {_tflops(flops, ours)} | "
                + f"{r[f'floor_{tag}_ms'] / ours:.2f} | "
                + (f"{ep1:.3f} | {ours / ep1:.2f}x" if ep1 else "n/a | n/a") + " |")
    errs = [f"{r['shape']}: {r['stock_error']}" for r in results if "stock_error" in r]
    b2b = _b2b_line(results, "calls back to back (no wait per call; ms per call): ")
    if b2b:
        lines.append(b2b)
    peaks = []
    for r in results:
        for tag in ("fwd", "fwdbwd"):
            o, st, sc = (r.get(f"{who}_{tag}_peak_mib")
                         for who in ("ours", "stock", "stock_compiled"))
            if o is not None and st is not None:
                peaks.append(f"{r['shape']} {tag}: stock {st:.0f}"
                             + (f", stock compiled {sc:.0f}" if sc is not None else "")
                             + f", ours {o:.0f}")
    if peaks:
        lines.append("peak memory above the inputs during one call (MiB; caching allocator, "
                     "rank 0): " + "; ".join(peaks))
    mem = [f"{r['shape']}: {r['exchange_mib']:.0f} MiB" for r in results if "exchange_mib" in r]
    notes = [f"stock EP failed: {e}" for e in errs]
    for r in results:
        w = [f"{tag} {r[f'stock_compiled_{tag}_warmup_s']:.1f} s" for tag in ("fwd", "fwdbwd")
             if r.get(f"stock_compiled_{tag}_warmup_s") is not None]
        if w:
            notes.append(f"{r['shape']} stock compiled (EP on): first 2 calls (compilation) "
                         + ", ".join(w) + (f"; RECOMPILED {r['stock_compiled_recompiles']} "
                                           "graphs while timed"
                                           if r.get("stock_compiled_recompiles") else ""))
        if r.get("stock_compiled_note"):
            notes.append(f"{r['shape']} stock compiled: {_cell_note(r['stock_compiled_note'], 400)}")
    if mem:
        notes.append("EP exchange buffers per rank (outside the caching allocator): "
                     + ", ".join(mem))
    return "\n".join(lines + notes)


def _impl(cfg: dict) -> str:
    """A tuner candidate's short name: its side (sm90, sm90_fused, cublas, deepgemm, triton)."""
    return cfg.get("impl") or "triton"


def tuner_lines(results: list[dict]) -> str:
    """One line per tuned kernel (the forward GEMMs' keys; the backward's are in the stage
    table): the picked side and time, the best other side, and every candidate the output
    check rejected (see ops/hopper/tune.py)."""
    lines = []
    seen = set()
    for r in results:
        for key, cands in r.get("tuned", {}).items():
            if key in seen or not cands:
                continue
            seen.add(key)
            ok = sorted((c for c in cands if c["ms"] != float("inf")), key=lambda c: c["ms"])
            rejected = [c for c in cands if "wrong result" in (c.get("err") or "")]
            if not ok:
                lines.append(f"tuner {key}: every candidate failed")
                continue
            best = ok[0]
            other = next((c for c in ok if _impl(c["config"]) != _impl(best["config"])), None)
            line = f"tuner {key}: {_impl(best['config'])} {best['ms']:.3f} ms"
            if other:
                line += f" (best {_impl(other['config'])}: {other['ms']:.3f})"
            if rejected:
                line += "; REJECTED by the output check: " + ", ".join(
                    f"{_impl(c['config'])} ({c['err']})" for c in rejected)
            lines.append(line)
    return "\n".join(lines)
