"""EP > 1: stock TorchTitan's ExpertParallel layer vs ours on the same expert shards and
routing, with our EP=1 time in the same run (one process per GPU under torchrun)."""

from __future__ import annotations

import time
import traceback

import torch

from torchtitan_megamoe.bench.profile import profile_kernels, timeline
from torchtitan_megamoe.bench.shapes import SHAPES, _rel_err, build_stock_moe, shard_stock_experts
from torchtitan_megamoe.bench.stock import CompiledStock, graphs_compiled, note_for
from torchtitan_megamoe.timing import back_to_back_ms, median_ms, peak_extra_mib
from torchtitan_megamoe.router import route


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_pair(fwd, step, iters, warmup, backward, res=None, name=None):
    """(forward ms, forward + backward ms or None) of one layer, each call waited for. With
    ``res`` and ``name``, also res[f"{name}_fwd_b2b_ms"] (and fwdbwd): calls back to back."""
    with torch.no_grad():
        fwd_ms = median_ms(fwd, iters, warmup)
        if res is not None:
            res[f"{name}_fwd_b2b_ms"] = back_to_back_ms(fwd, iters)
            res[f"{name}_fwd_peak_mib"] = peak_extra_mib(fwd)
    step_ms = median_ms(step, iters, warmup) if backward else None
    if res is not None and backward:
        res[f"{name}_fwdbwd_b2b_ms"] = back_to_back_ms(step, iters)
        res[f"{name}_fwdbwd_peak_mib"] = peak_extra_mib(step)
    return fwd_ms, step_ms


def bench_shape_ep(key: str, tokens: int, iters: int, warmup: int, backward: bool,
                   peak_tflops: float, mesh, backend: str = "hopper", ep1: bool = True,
                   profile: bool = False, compile_stock: bool = True,
                   compile_backend: str = "inductor") -> dict:
    """Stock TorchTitan EP vs ours, experts split over ``mesh`` (1-D, named "ep").

    Every rank must call this (it communicates). Order: ours at EP=1 (full weights, no
    communication), ours at EP=N, then stock after sharding its experts, so that a failure of the
    stock wiring still leaves ours' numbers; last, with ``compile_stock``, the same stock EP layer
    compiled as TorchTitan's --compile.enable compiles it with EP on (``stock_compiled_*``; see
    bench/stock.py: router and reorderer compiled, the grouped GEMMs compiled with the received
    rows marked dynamic, dispatch and combine eager).
    """
    import torch.distributed as dist

    from torchtitan_megamoe import mega_moe

    shape = SHAPES[key]
    group = mesh.get_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    if shape["experts"] % world:
        raise ValueError(f"{shape['experts']} experts do not split over EP={world}; "
                         "pick an EP degree that divides the expert count")
    torch.manual_seed(0)  # same router and experts on every rank; each keeps its expert slice
    moe = build_stock_moe(shape, dev)
    T, D, H, K = tokens, shape["dim"], shape["hidden"], shape["top_k"]
    E_local = shape["experts"] // world
    mine = slice(rank * E_local, (rank + 1) * E_local)
    torch.manual_seed(1 + rank)
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    xg = x.detach().clone().requires_grad_(True)
    flops_fwd = 6 * T * K * D * H
    res = {
        "shape": shape["name"], "tokens": T, "ep": world, "dim": D, "hidden": H,
        "experts": shape["experts"], "top_k": K, "backend": backend,
        "flops_fwd": flops_fwd, "floor_fwd_ms": flops_fwd / (peak_tflops * 1e12) * 1e3,
    }
    if backward:
        res["floor_fwdbwd_ms"] = 3 * res["floor_fwd_ms"]

    def ours_layer(inp, w1, w2, w3, grp, be=backend):
        scores, ids, _ = route(moe.router, inp, moe.expert_bias)
        return mega_moe(inp, ids, scores, w1, w2, w3, group=grp, backend=be)

    ex = moe.experts
    if ep1:
        full = (ex.w1, ex.w2, ex.w3)
        res["ours_ep1_fwd_ms"], res["ours_ep1_fwdbwd_ms"] = _time_pair(
            lambda: ours_layer(x, *full, None),
            lambda: ours_layer(xg, *full, None).backward(grad),
            iters, warmup, backward, res, "ours_ep1")
        moe.zero_grad(set_to_none=True)

    mine_w = [getattr(ex, n).detach()[mine].clone().requires_grad_(backward)
              for n in ("w1", "w2", "w3")]
    with torch.no_grad():
        ours_out = ours_layer(x, *mine_w, group)
        errs = [_rel_err(ours_out, ours_layer(x, *mine_w, group, "reference"))]
    res["ours_fwd_ms"], res["ours_fwdbwd_ms"] = _time_pair(
        lambda: ours_layer(x, *mine_w, group),
        lambda: ours_layer(xg, *mine_w, group).backward(grad),
        iters, warmup, backward, res, "ours")
    res["exchange_mib"] = exchange_mib(group, D)
    if profile:
        from torchtitan_megamoe.ops import hopper
        from torchtitan_megamoe.ops.options import MegaMoEOptions

        with torch.no_grad():
            scores, ids, _ = route(moe.router, x, moe.expert_bias)
            profile_kernels(f"{shape['name']} EP={world} ours fwd",
                            lambda: ours_layer(x, *mine_w, group), rank,
                            host_fn=lambda: hopper.forward(
                                x, ids, scores, *mine_w, group, MegaMoEOptions(backend="hopper")))
            timeline(f"{shape['name']} EP={world} ours fwd",
                     lambda: ours_layer(x, *mine_w, group), rank)
        if backward:
            profile_kernels(f"{shape['name']} EP={world} ours fwd+bwd",
                            lambda: ours_layer(xg, *mine_w, group).backward(grad), rank)
    torch.cuda.empty_cache()

    try:
        shard_stock_experts(moe, mesh)
        local = [getattr(ex, n).to_local() for n in ("w1", "w2", "w3")]
        res["same_expert_weights"] = all(torch.equal(a, b) for a, b in zip(local, mine_w))
        with torch.no_grad():
            errs.append(_rel_err(ours_out, moe(x.view(1, T, D)).view(T, D)))
        res["stock_fwd_ms"], res["stock_fwdbwd_ms"] = _time_pair(
            lambda: moe(x.view(1, T, D)),
            lambda: moe(xg.view(1, T, D)).backward(grad.view(1, T, D)),
            iters, warmup, backward, res, "stock")
    except Exception as err:  # noqa: BLE001 - reported; ours' numbers above stay valid
        traceback.print_exc()
        res["stock_error"] = f"{type(err).__name__}: {err}"
    if compile_stock and "stock_error" not in res:
        # (a compile error is the same on every rank, so all ranks leave at the same point)
        try:
            moe.zero_grad(set_to_none=True)
            compiled = CompiledStock(moe, ep=True, backend=compile_backend)
            with compiled.active():
                fwd = lambda: moe(x.view(1, T, D))  # noqa: E731
                step = lambda: moe(xg.view(1, T, D)).backward(grad.view(1, T, D))  # noqa: E731
                with torch.no_grad():
                    t0 = time.perf_counter()
                    fwd(), fwd()
                    _sync()
                    res["stock_compiled_fwd_warmup_s"] = time.perf_counter() - t0
                if backward:
                    t0 = time.perf_counter()
                    step(), step()
                    _sync()
                    res["stock_compiled_fwdbwd_warmup_s"] = time.perf_counter() - t0
                graphs = graphs_compiled()
                res["stock_compiled_fwd_ms"], res["stock_compiled_fwdbwd_ms"] = _time_pair(
                    fwd, step, iters, warmup, backward, res, "stock_compiled")
                if graphs >= 0:
                    res["stock_compiled_recompiles"] = graphs_compiled() - graphs
        except Exception as err:  # noqa: BLE001 - reported; the numbers above stay valid
            res["stock_compiled_note"] = note_for(err)
        torch._dynamo.reset()
        moe.zero_grad(set_to_none=True)
    # worst rank's errors (every rank runs the same number of these collectives, error or not)
    # (-1: not measured on that rank; a NaN error stays NaN)
    err_t = torch.tensor(errs + [-1.0] * (2 - len(errs)), device=dev, dtype=torch.float64)
    dist.all_reduce(err_t, op=dist.ReduceOp.MAX, group=group)
    res["rel_err_vs_reference"] = float(err_t[0])
    if not err_t[1] < 0:
        res["rel_err_vs_stock"] = float(err_t[1])
    del moe, mine_w
    torch.cuda.empty_cache()
    return res


def exchange_mib(group, dim: int) -> float:
    """Symmetric (or staging) memory of the group's EP exchange for this dim: outside the
    caching allocator, so max_memory_allocated does not see it."""
    from torchtitan_megamoe.ops.hopper import stages as hopper

    return hopper.exchange_bytes(group, dim) / 2**20
