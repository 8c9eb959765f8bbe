"""EP=1: stock vs ours on one GPU, with the forward's and the backward's per-stage times."""

from __future__ import annotations

import time
import traceback

import torch

from torchtitan_megamoe.bench.profile import profile_kernels, timeline
from torchtitan_megamoe.bench.shapes import SHAPES, _rel_err, build_stock_moe
from torchtitan_megamoe.bench.stock import (FP8_TOKEN_GROUP_ALIGNMENT, BlockCompiledStock,
                                            CompiledStock, Unavailable, convert_torchao_fp8,
                                            graphs_compiled, note_for, token_group_alignment)
from torchtitan_megamoe.bench.tables import ours_name
from torchtitan_megamoe.ops.recipe import recipe_named
from torchtitan_megamoe.timing import back_to_back_ms, host_issue_ms, median_ms, peak_extra_mib
from torchtitan_megamoe.router import route


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_s(fn, calls: int = 1) -> float:
    """Wall seconds of ``calls`` calls of ``fn``, the device synchronized before and after
    (a first call: kernel JIT and tuner; a compiled layer's warm-up: its compilation)."""
    _sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync()
    return time.perf_counter() - t0


def first_call(res: dict, name: str, fn) -> None:
    """res[f"{name}_first_call_s"]: the wall time of ``fn``'s first call in this process at
    this shape (the JIT compiles not cached on disk and the tuner's timing runs included), or
    res[f"{name}_first_call_note"] when it raises."""
    try:
        res[f"{name}_first_call_s"] = wall_s(fn)
    except Exception as err:  # noqa: BLE001 - reported in the table
        res[f"{name}_first_call_note"] = note_for(err)


def time_layer(res: dict, name: str, fwd, step, fresh_step, iters: int, warmup: int,
               backward: bool, ref: torch.Tensor | None = None) -> None:
    """One layer's times under ``name``: ``_fwd_ms`` (median, each call waited for, under
    no_grad) and ``_fwd_b2b_ms``; with ``backward`` ``_fwdbwd_ms`` (grads accumulating),
    ``_fwdbwd_fresh_ms``, ``_fwdbwd_b2b_ms`` (fresh .grad) and ``_fwdbwd_peak_mib`` (one fresh
    step). With ``ref``, ``_rel_err_vs_stock`` of the forward's output. A pass that raises gets
    ``_{pass}_note`` instead (see stock.note_for); the other pass still runs."""
    try:
        with torch.no_grad():
            out = fwd()
            if ref is not None:
                res[f"{name}_rel_err_vs_stock"] = _rel_err(out, ref)
            del out
            res[f"{name}_fwd_ms"] = median_ms(fwd, iters, warmup)
            res[f"{name}_fwd_b2b_ms"] = back_to_back_ms(fwd, iters)
    except Exception as err:  # noqa: BLE001 - reported in the table
        res[f"{name}_fwd_note"] = note_for(err)
    if not backward:
        return
    try:
        fresh_step()
        res[f"{name}_fwdbwd_ms"] = median_ms(step, iters, warmup)
        res[f"{name}_fwdbwd_fresh_ms"] = median_ms(fresh_step, iters, warmup)
        res[f"{name}_fwdbwd_b2b_ms"] = back_to_back_ms(fresh_step, iters)
        res[f"{name}_fwdbwd_peak_mib"] = peak_extra_mib(fresh_step)
    except Exception as err:  # noqa: BLE001 - reported in the table
        res[f"{name}_fwdbwd_note"] = note_for(err)


def time_compiled(res: dict, name: str, moe, fwd, step, fresh_step, iters: int, warmup: int,
                  backward: bool, compile_backend: str, ref: torch.Tensor | None = None,
                  ep: bool = False) -> None:
    """time_layer of ``moe`` compiled as TorchTitan compiles it (stock.CompiledStock), after a
    warm-up of two calls per pass whose wall time is ``_{pass}_warmup_s`` (compilation);
    ``_recompiles``: graphs compiled while timing (0 unless a guard failed). A forward that
    does not compile raises (the caller notes the layer); a backward that does not gets
    ``_fwdbwd_note`` and the forward is still timed."""
    compiled = CompiledStock(moe, ep=ep, backend=compile_backend)
    with compiled.active():
        with torch.no_grad():
            res[f"{name}_fwd_warmup_s"] = wall_s(fwd, 2)
        if backward:
            try:
                res[f"{name}_fwdbwd_warmup_s"] = wall_s(fresh_step, 2)
            except Exception as err:  # noqa: BLE001 - reported in the table
                res[f"{name}_fwdbwd_note"] = note_for(err)
                backward = False
        graphs = graphs_compiled()
        time_layer(res, name, fwd, step, fresh_step, iters, warmup, backward, ref)
        if graphs >= 0:
            res[f"{name}_recompiles"] = graphs_compiled() - graphs


def time_block_compiled(res: dict, name: str, moe, x, xg, grad, fresh, iters: int,
                        warmup: int, backward: bool, compile_backend: str,
                        ref: torch.Tensor | None = None) -> BlockCompiledStock:
    """time_layer of the whole ``moe`` block under one torch.compile (stock.BlockCompiledStock:
    fullgraph, else graph breaks allowed). Its first call per pass is timed alone,
    ``_fwd_first_call_s`` (no grad) and ``_fwdbwd_first_call_s`` (fresh .grad): the
    compilation; ``_first_call_s`` is their sum (what compiling it costs before a step runs at
    full speed); ``_{pass}_warmup_s`` the first two calls, as time_compiled's. ``_mode``,
    ``_fullgraph_error``, ``_graphs``, ``_graph_breaks``, ``_break_reasons``: how it compiled
    (see BlockCompiledStock.describe); ``_recompiles``: graphs compiled while timing. A forward
    that does not compile raises (the caller notes the layer); a backward that does not gets
    ``_fwdbwd_note``."""
    block = BlockCompiledStock(moe, backend=compile_backend)

    def fwd():
        return block(x)

    def step():
        block(xg).backward(grad)

    fresh_step = fresh(step)
    with torch.no_grad():
        t1 = wall_s(fwd)
        res.update({f"{name}_{k}": v for k, v in block.describe().items()})
        res[f"{name}_fwd_first_call_s"] = t1
        res[f"{name}_fwd_warmup_s"] = t1 + wall_s(fwd)
    res[f"{name}_first_call_s"] = t1
    if backward:
        try:
            t2 = wall_s(fresh_step)
            res[f"{name}_fwdbwd_first_call_s"] = t2
            res[f"{name}_fwdbwd_warmup_s"] = t2 + wall_s(fresh_step)
            res[f"{name}_first_call_s"] = t1 + t2
        except Exception as err:  # noqa: BLE001 - reported in the table
            res[f"{name}_fwdbwd_note"] = note_for(err)
            backward = False
        # a fallback taken in the backward's first call (not in the forward's)
        res.update({f"{name}_{k}": v for k, v in block.describe().items()
                    if k in ("mode", "fullgraph_error")})
    graphs = graphs_compiled()
    time_layer(res, name, fwd, step, fresh_step, iters, warmup, backward, ref)
    if graphs >= 0:
        res[f"{name}_recompiles"] = graphs_compiled() - graphs
    return block


def _stage_times(x, ids, w, w1, w2, w3, iters, warmup):
    from torchtitan_megamoe.ops.hopper import stages as hopper

    stages, res = hopper.forward_stages(x, ids, w, w1, w2, w3)
    return {**{name: median_ms(st.run, iters, warmup) for name, st in stages.items()}, **res}


def bwd_stage_breakdown(key: str, tokens: int, iters: int) -> dict:
    """The hopper backward's per-stage times (bench/backward_stages.py) at one shape.

    Without CUDA it runs under Triton's interpreter with its small tiles (a smoke test of this
    wiring; use a tiny shape there).
    """
    from torchtitan_megamoe.bench import backward_stages as bwd_bench

    shape = SHAPES[key]
    dims = (shape["dim"], shape["hidden"], shape["experts"], shape["top_k"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return bwd_bench.bench_shape(key, tokens, iters, shape=dims, device=device)


def bench_shape(key: str, tokens: int, iters: int, warmup: int, backward: bool, backend: str,
                peak_tflops: float, profile: bool = False, *, precisions=("bf16",),
                compile_stock: bool = True, compile_backend: str = "inductor",
                torchao: bool = False, peak_fp8_tflops: float = 1339.0,
                stages: bool = True, block_compile_stock: bool = True) -> dict:
    """Stock vs ours at one shape. Ours in bf16 always runs (keys ``ours_*``); each other
    precision of ``precisions`` adds keys ``ours_{precision}_*`` (bench.ep1.ours_name), or their
    ``_note`` where the backend lacks it. Baselines: stock eager (``stock_*``), with
    ``compile_stock`` stock compiled as TorchTitan's --compile.enable does (``stock_compiled_*``),
    with ``block_compile_stock`` the whole stock block under one torch.compile, fullgraph where
    it traces (``stock_block_*``, time_block_compiled), with ``torchao`` stock + torchao's FP8 grouped GEMMs, compiled the same way
    (``stock_fp8_*``; it converts the module's experts, so it runs last). ``stages``: the
    hopper backend's forward stage times and backward stage breakdown (bf16)."""
    from torchtitan_megamoe import mega_moe

    shape = SHAPES[key]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    moe = build_stock_moe(shape, dev)
    T, D, H, K = tokens, shape["dim"], shape["hidden"], shape["top_k"]
    x = torch.randn(1, T, D, device=dev, dtype=torch.bfloat16)
    x2 = x.view(T, D)
    ex = moe.experts
    xg = x.detach().clone().requires_grad_(True)
    grad = torch.randn_like(x)
    extra = [p for p in dict.fromkeys(precisions) if p != "bf16"]

    # the FP8 copies of the weights, made once as a layer's module makes them once per
    # optimizer step (moe.MegaExperts); their bytes count in the FP8 rows' peak memory
    fp8_copies = {}

    def ours_layer(inp, precision="bf16"):
        scores, ids, _ = route(moe.router, inp.view(T, D), moe.expert_bias)
        out = mega_moe(inp.view(T, D), ids, scores, ex.w1, ex.w2, ex.w3, backend=backend,
                       precision=precision, fp8_weights=fp8_copies.get(precision))
        return out.view(1, T, D)

    def stock_step():
        moe(xg).backward(grad)

    def ours_step():
        ours_layer(xg).backward(grad)

    # The steps accumulate into existing .grad tensors (an extra pass over the weight
    # gradients each call); a training step's first backward writes them fresh instead.
    def fresh(step):
        def run():
            moe.zero_grad(set_to_none=True)
            xg.grad = None
            step()
        return run

    # ours' first call at this shape, before any other: kernel JIT (where not cached on disk)
    # and the tuner's timing runs; a fwd+bwd when the backward is benchmarked
    pre = {}
    if backward:
        first_call(pre, "ours", fresh(ours_step))
    else:
        first_call(pre, "ours", torch.no_grad()(lambda: ours_layer(x)))
    moe.zero_grad(set_to_none=True)

    with torch.no_grad():
        scores, ids, _ = moe.router(x2, moe.expert_bias)
        ref = moe(x).float()
        got = ours_layer(x).float()
        rel = float((got - ref).norm() / ref.norm())
        del got
        res = {
            "shape": shape["name"], "tokens": T, "dim": D, "hidden": H,
            "experts": shape["experts"], "top_k": K, "backend": backend,
            "precisions": ["bf16"] + extra, "peak_tflops": peak_tflops,
            "peak_fp8_tflops": peak_fp8_tflops,
            "rel_err_vs_stock": rel,
            "stock_fwd_ms": median_ms(lambda: moe(x), iters, warmup),
            "ours_fwd_ms": median_ms(lambda: ours_layer(x), iters, warmup),
            "ours_op_fwd_ms": median_ms(
                lambda: mega_moe(x2, ids, scores, ex.w1, ex.w2, ex.w3, backend=backend),
                iters, warmup,
            ),
            "router_ms": median_ms(lambda: moe.router(x2, moe.expert_bias), iters, warmup),
            "ours_router_ms": median_ms(lambda: route(moe.router, x2, moe.expert_bias), iters,
                                        warmup),
            # host time to issue one waited forward (the part of ours_fwd_ms the device may
            # spend idle, waiting for launches)
            "stock_fwd_host_ms": host_issue_ms(lambda: moe(x), iters, warmup),
            "ours_fwd_host_ms": host_issue_ms(lambda: ours_layer(x), iters, warmup),
            # calls back to back, as layers run in training when nothing syncs: GPU-bound, so
            # less moved by a slow host than the waited medians above
            "stock_fwd_b2b_ms": back_to_back_ms(lambda: moe(x), iters),
            "ours_fwd_b2b_ms": back_to_back_ms(lambda: ours_layer(x), iters),
        }
        if profile:
            timeline(f"{shape['name']} EP=1 ours fwd (no grad)", lambda: ours_layer(x), 0)
        if backend == "hopper" and stages:
            res["stages_ms"] = _stage_times(x2, ids, scores, ex.w1, ex.w2, ex.w3, iters, warmup)

    res.update(pre)
    flops_fwd = 6 * T * K * D * H
    res["flops_fwd"] = flops_fwd
    res["floor_fwd_ms"] = flops_fwd / (peak_tflops * 1e12) * 1e3
    if backward:
        res["stock_fwdbwd_ms"] = median_ms(stock_step, iters, warmup)
        try:
            ours_step()
            res["ours_fwdbwd_ms"] = median_ms(ours_step, iters, warmup)
        except NotImplementedError as err:
            res["ours_fwdbwd_ms"] = None
            res["ours_fwdbwd_note"] = note_for(err)
        res["floor_fwdbwd_ms"] = 3 * res["floor_fwd_ms"]

        res["stock_fwdbwd_fresh_ms"] = median_ms(fresh(stock_step), iters, warmup)
        res["stock_fwdbwd_b2b_ms"] = back_to_back_ms(fresh(stock_step), iters)
        res["stock_fwdbwd_peak_mib"] = peak_extra_mib(fresh(stock_step))
        if res.get("ours_fwdbwd_ms"):
            res["ours_fwdbwd_fresh_ms"] = median_ms(fresh(ours_step), iters, warmup)
            res["ours_fwdbwd_b2b_ms"] = back_to_back_ms(fresh(ours_step), iters)
            res["ours_fwdbwd_peak_mib"] = peak_extra_mib(fresh(ours_step))
        if profile:
            profile_kernels(f"{shape['name']} EP=1 ours fwd+bwd", ours_step, 0)
            timeline(f"{shape['name']} EP=1 ours fwd+bwd", fresh(ours_step), 0)
            profile_kernels(f"{shape['name']} EP=1 stock fwd+bwd", stock_step, 0)
        moe.zero_grad(set_to_none=True)

    # ours at the other precisions: each with its own first call (its kernels' JIT and tuner)
    for p in extra:
        name = ours_name(p)
        if backend == "hopper" and ex.w1.is_cuda:
            from torchtitan_megamoe.ops.hopper.fp8_weights import make_fp8_weights

            with torch.no_grad():
                fp8_copies[p] = make_fp8_weights(ex.w1, ex.w2, ex.w3,
                                                 forward=recipe_named(p).forward_copies)
            res[f"{name}_fp8_weights_mib"] = fp8_copies[p].nbytes() / 2**20

        def fwd(p=p):
            return ours_layer(x, p)

        def step(p=p):
            ours_layer(xg, p).backward(grad)

        if backward:
            first_call(res, name, fresh(step))
        else:
            first_call(res, name, torch.no_grad()(fwd))
        time_layer(res, name, fwd, step, fresh(step), iters, warmup, backward, ref)
        if f"{name}_fwdbwd_peak_mib" in res:  # the copies held across calls count too
            res[f"{name}_fwdbwd_peak_mib"] += res.get(f"{name}_fp8_weights_mib", 0.0)
        fp8_copies.pop(p, None)
        moe.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()

    # stock's module, the same weights, compiled as --compile.enable compiles it
    stock_fwd = lambda: moe(x)  # noqa: E731
    if compile_stock:
        try:
            time_compiled(res, "stock_compiled", moe, stock_fwd, stock_step, fresh(stock_step),
                          iters, warmup, backward, compile_backend, ref)
        except Exception as err:  # noqa: BLE001 - reported; the numbers above stay valid
            res["stock_compiled_note"] = note_for(err)
        moe.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    # the whole stock block under one torch.compile (a stronger baseline than TorchTitan's)
    if block_compile_stock:
        try:
            time_block_compiled(res, "stock_block", moe, x, xg, grad, fresh, iters, warmup,
                                backward, compile_backend, ref)
        except Exception as err:  # noqa: BLE001 - reported; the numbers above stay valid
            res["stock_block_note"] = note_for(err)
        moe.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    # stock + torchao's FP8 grouped GEMMs, compiled: converts the experts in place (last)
    if torchao:
        try:
            with token_group_alignment(FP8_TOKEN_GROUP_ALIGNMENT):
                convert_torchao_fp8(moe)
                if not compile_stock:
                    raise Unavailable("timed compiled only (TorchTitan's FP8 MoE path wants "
                                      "--compile.enable); drop --no-compile-stock")
                time_compiled(res, "stock_fp8", moe, stock_fwd, stock_step, fresh(stock_step),
                              iters, warmup, backward, compile_backend, ref)
        except Exception as err:  # noqa: BLE001 - reported; the numbers above stay valid
            res["stock_fp8_note"] = note_for(err)
        moe.zero_grad(set_to_none=True)
    if compile_stock or torchao or block_compile_stock:
        torch._dynamo.reset()
    from torchtitan_megamoe.ops.hopper import stages as hopper

    res["tuned"] = {
        f"{name}{list(k)}": [{"config": c, "ms": ms, "err": e} for c, ms, e in v]
        for (name, k), v in hopper.tuner_timings().items()
    }
    del moe
    torch.cuda.empty_cache()
    if backward and backend == "hopper" and stages and res.get("ours_fwdbwd_ms"):
        # A failure here must not cost the layer numbers above (one GPU run is expensive).
        try:
            res["bwd_stages"] = bwd_stage_breakdown(key, tokens, iters)
        except Exception as err:  # noqa: BLE001 - reported in the JSON and the table
            traceback.print_exc()
            res["bwd_stages_error"] = f"{type(err).__name__}: {err}"
        torch.cuda.empty_cache()
    return res
