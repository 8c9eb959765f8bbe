"""The markdown tables the benchmark prints (and docs/PERF.md records)."""

from __future__ import annotations

# bench/backward_stages.py's stage keys in backward order: (label, Triton kernel, _grouped_mm
# counterpart or None). The tuner picks a side per stage; "auto" below is what the layer runs.
BWD_STAGES = [
    ("fwd: GEMM 1 + SwiGLU (inference)", "fwd_gemm1", None),
    ("fwd: GEMM 1 + SwiGLU + store a1/a3 (training)", "fwd_gemm1_save_a", None),
    ("plan (built by the forward, reused)", "plan", None),
    ("A: dgrad L2 + SwiGLU on saved a1/a3", "A_dgrad_l2_swiglu", "A_dgrad_l2_swiglu_cublas"),
    ("A: sm90 dh GEMM + SwiGLU rows kernel (dy gather included)", "A_dgrad_l2_swiglu_sm90", None),
    ("A: sm90 in one launch (dy rows stored for dw2)", "A_dgrad_l2_swiglu_sm90_fused", None),
    ("wgrad dw2", "B_dw2", "B_dw2_cublas"),
    ("wgrad dw2, sm90 kernel (dy gathered inside)", "B_dw2_sm90", None),
    ("wgrad dw2, sm90 kernel on gathered dy rows", "B_dw2_sm90_pre", None),
    ("wgrad dw1", "B_dw1", None),
    ("wgrad dw3", "B_dw3", None),
    ("wgrad dw1 + dw3", "B_dw13", "B_dw13_cublas"),
    ("wgrad dw1 + dw3, sm90 kernel (x gathered inside)", "B_dw13_sm90", None),
    ("wgrad dw1 + dw3, sm90 kernel on gathered x rows", "B_dw13_sm90_pre", None),
    ("C: dgrad L1", "C_dgrad_l1", "C_dgrad_l1_cublas"),
    ("C: dgrad L1, sm90 kernel (dx in row space)", "C_dgrad_l1_sm90", None),
    ("combine (dx, d topk_weights)", "combine", None),
    ("combine of row-space dx (after the sm90 C)", "combine_rows", None),
    ("backward total, one side forced", "total", "total_cublas"),
    ("backward total, tuner's pick per stage", "total_auto", None),
    ("backward total, recompute path (no saved a: GEMM 1 again)", "total_recompute", None),
]
# stages timed only where the sm90 kernels run (an sm_90 GPU with nvcc); '-' elsewhere
SM90_ONLY_STAGES = {"A_dgrad_l2_swiglu_sm90", "A_dgrad_l2_swiglu_sm90_fused", "B_dw2_sm90",
                    "B_dw2_sm90_pre", "B_dw13_sm90", "B_dw13_sm90_pre", "C_dgrad_l1_sm90",
                    "combine_rows"}


def _tflops(flops: float, ms: float | None) -> str:
    return f"{flops / (ms * 1e-3) / 1e12:.0f}" if ms else "n/a"


def _b2b_line(results: list[dict], head: str) -> str:
    """One line of the back-to-back times (``{who}_{tag}_b2b_ms``) of every result: stock, ours,
    their ratio and, where measured, ours at EP=1; '' when no result has them."""
    b2b = []
    for r in results:
        for tag in ("fwd", "fwdbwd"):
            o, st, e1 = (r.get(f"{who}_{tag}_b2b_ms") for who in ("ours", "stock", "ours_ep1"))
            if o:
                b2b.append(f"{r['shape']} {tag}: stock {st or float('nan'):.3f}, ours {o:.3f}"
                           + (f" ({st / o:.2f}x)" if st else "")
                           + (f", ours EP=1 {e1:.3f} (EP=N/EP=1 {o / e1:.2f}x)" if e1 else ""))
    return head + "; ".join(b2b) if b2b else ""


def table(results: list[dict]) -> str:
    lines = [
        "| shape | pass | stock ms | ours ms | speedup | ours TFLOP/s | floor ms | floor/ours |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for tag, mult in (("fwd", 1), ("fwdbwd", 3)):
            stock, ours = r.get(f"stock_{tag}_ms"), r.get(f"ours_{tag}_ms")
            if stock is None:
                continue
            floor = r[f"floor_{tag}_ms"]
            if ours:
                tflops = _tflops(mult * r["flops_fwd"], ours)
                cells = (f"{ours:.3f} | {stock / ours:.2f}x | {tflops} | {floor:.2f} | "
                         f"{floor / ours:.2f}")
            else:
                cells = f"n/a | n/a | n/a | {floor:.2f} | n/a"
            lines.append(f"| {r['shape']} | {tag} | {stock:.3f} | {cells} |")
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
    b2b = _b2b_line(results, "calls back to back (no wait per call, GPU-bound; ms per call; "
                             "fwdbwd with fresh .grad): ")
    if b2b:
        lines.append(b2b)
    for r in results:
        if r.get("stock_fwd_host_ms") and r.get("ours_fwd_host_ms"):
            lines.append(f"{r['shape']} fwd host issue time (device idle before the call, "
                         f"median): stock {r['stock_fwd_host_ms']:.3f} ms, ours "
                         f"{r['ours_fwd_host_ms']:.3f} ms")
    return "\n".join(lines)


def bwd_table(results: list[dict]) -> str:
    """Backward stages: per shape, the Triton kernel's and the _grouped_mm side's "ms (TFLOP/s)";
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
        f"{r['shape']} Triton | {r['shape']} _grouped_mm" for r in cols) + " |"
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
        "| shape | EP | pass | stock ms | ours ms | speedup | stock TFLOP/s | ours TFLOP/s "
        "| floor/ours | ours EP=1 ms | EP=N / EP=1 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for tag, mult in (("fwd", 1), ("fwdbwd", 3)):
            ours = r.get(f"ours_{tag}_ms")
            if ours is None:
                continue
            flops = mult * r["flops_fwd"]
            stock = r.get(f"stock_{tag}_ms")
            ep1 = r.get(f"ours_ep1_{tag}_ms")
            lines.append(
                f"| {r['shape']} | {r['ep']} | {tag} | "
                + (f"{stock:.3f}" if stock else "n/a") + f" | {ours:.3f} | "
                + (f"{stock / ours:.2f}x" if stock else "n/a")
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
            o, st = (r.get(f"{who}_{tag}_peak_mib") for who in ("ours", "stock"))
            if o is not None and st is not None:
                peaks.append(f"{r['shape']} {tag}: stock {st:.0f}, ours {o:.0f}")
    if peaks:
        lines.append("peak memory above the inputs during one call (MiB; caching allocator, "
                     "rank 0): " + "; ".join(peaks))
    mem = [f"{r['shape']}: {r['exchange_mib']:.0f} MiB" for r in results if "exchange_mib" in r]
    notes = [f"stock EP failed: {e}" for e in errs]
    if mem:
        notes.append("EP exchange buffers per rank (outside the caching allocator): "
                     + ", ".join(mem))
    return "\n".join(lines + notes)


def _impl(cfg: dict) -> str:
    """A tuner candidate's short name: sm90 (+ its knobs), cublas, or triton."""
    impl = cfg.get("IMPL") or cfg.get("impl") or "triton"
    extra = [k for k in ("pre_gathered",) if cfg.get(k)]
    return "+".join([impl] + extra)


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
