"""EP=R on ONE device: ours with R loopback ranks in one process (ops/loopback.py), each rank
on its own stream, against ours at EP=1 on the same R*T tokens (``--ep R --loopback``).

A loopback step is every rank's layer, all on one device, so its time is R ranks' work. The
ranks issue one after another on the host (ops/loopback.py's baton): one process issues what R
processes would, so a waited call is host-bound where a real rank's would not be. Hence three
times per pass: waited (CUDA events), the host's issue time, and the device's busy time (the
union of every kernel's interval, timing.gpu_busy_ms). GPU busy / R is a rank's compute, GPU
busy EP=R / EP=1 on the same R*T tokens the EP machinery's overhead (the exchange's copies, a plan
per region, smaller GEMMs), host issue / R a rank's host cost. Beside it, GPU busy EP=R / (R x
ours at EP=1 on one rank's T tokens): the same without the part any EP=R pays, a rank's GEMMs
at 1/R of EP=1's rows per expert.

Memory. The peak above the inputs of one loopback forward + backward, divided by R (every rank's
exchange buffers and transients live at once in the one process), against ours at EP=1 on one
rank's T tokens with all experts: ``per_rank_peak_mib`` / ``ep1_peak_mib`` (0 without CUDA).

Bytes. One more forward + backward runs with the exchange's meter on (ep_dispatch.TRAFFIC): the
bytes each rank stored into its peers' buffers per transfer, counted from the device-side row
counts, mean over the ranks, token rows and metadata (local ids, weights, counts) apart; beside
them the uniform-routing model of the token rows (``model_bytes``: rows per token to the other
ranks owning one of its experts, times the row's bytes).
"""

from __future__ import annotations

import os
from math import comb

import torch

from torchtitan_megamoe import settings
from torchtitan_megamoe.bench.profile import profile_kernels
from torchtitan_megamoe.bench.shapes import SHAPES
from torchtitan_megamoe.ops.hopper.ep_dispatch import TRAFFIC
from torchtitan_megamoe.ops.loopback_moe import loopback_moe, shard
from torchtitan_megamoe.ops.recipe import SCALE_BLOCK, recipe_named
from torchtitan_megamoe.timing import (
    gpu_busy_ms, graphed_ms, host_issue_ms, median_ms, peak_extra_mib,
)

TRANSFERS = ("dispatch", "combine", "dispatch dy", "dispatch x", "return dx")
"""A layer's transfers per training step: the forward's x and partial rows, the backward's dy, x
(sent again: the forward keeps no received rows) and dx partial rows (with d(topk_weights))."""


def remote_ranks_per_token(R: int, E: int, K: int) -> float:
    """Expected number of OTHER ranks owning at least one of a token's K distinct experts, drawn
    uniformly from E experts split evenly over R ranks."""
    el = E // R
    return (R - 1) * (1 - comb(E - el, K) / comb(E, K))


def model_bytes(R: int, T: int, D: int, E: int, K: int, precision: str) -> dict:
    """Bytes one rank sends its peers per transfer at uniform routing (the payload rows: the
    metadata's 16 + 4K bytes per row and the counts come on top)."""
    recipe = recipe_named(precision)
    rows = T * remote_ranks_per_token(R, E, K)
    bf16, fp8 = 2 * D, D + 4 * (D // SCALE_BLOCK)
    return {"dispatch": rows * (fp8 if recipe.fp8_forward else bf16),
            "combine": rows * bf16,
            "dispatch dy": rows * (fp8 if recipe.fp8_dgrad else bf16),
            "dispatch x": rows * bf16,
            "return dx": rows * (bf16 + 4 * K)}


def counted_bytes(call, R: int) -> dict:
    """{transfer: bytes} one rank sends its peers in ``call`` (every one of the R ranks' layer),
    mean over the ranks, counted by the exchange's meter; transfers that did not run are
    absent."""
    TRAFFIC.take()
    TRAFFIC.on = True
    try:
        call()
        per_rank = TRAFFIC.take()
    finally:
        TRAFFIC.on = False
    ran = {t for r in per_rank.values() for t in r}
    return {t: sum(r.get(t, 0) for r in per_rank.values()) / R
            for t in (*TRANSFERS, *(f"{t} meta" for t in TRANSFERS)) if t in ran}


def _inputs(shape, R: int, T: int, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    D, H, E, K = shape["dim"], shape["hidden"], shape["experts"], shape["top_k"]

    def draw(*size, scale=1.0):
        return (torch.randn(*size, device=dev, generator=g) * scale).bfloat16()

    x, dy = draw(R * T, D), draw(R * T, D)
    w1, w3, w2 = draw(E, H, D, scale=D**-0.5), draw(E, H, D, scale=D**-0.5), draw(E, D, H,
                                                                                   scale=H**-0.5)
    # uniform top-k: K distinct experts per token
    ids = torch.rand(R * T, E, device=dev, generator=g).topk(K, dim=1).indices
    tw = torch.softmax(torch.randn(R * T, K, device=dev, generator=g), -1)
    return (x, ids, tw, w1, w2, w3), dy


def exposed_ms(call, R: int, iters: int, warmup: int, link_gbs: float,
               graph: bool = False) -> dict:
    """{transfer: ms} per rank that pacing only that transfer to a ``link_gbs`` link adds to
    ``call``, a loopback forward + backward of R ranks: the part of it the compute beside it
    does not hide. The exchange reads the pacing when ``call`` creates it. With
    ``graph`` each variant is timed as one CUDA graph (no host issue in the way; waited calls
    where a capture fails)."""
    saved = {k: os.environ.get(k) for k in (settings.LOOPBACK_LINK_GBS, settings.LOOPBACK_PACED)}

    def timed(paced: str | None) -> float:
        os.environ[settings.LOOPBACK_LINK_GBS] = str(link_gbs if paced else 0)
        os.environ[settings.LOOPBACK_PACED] = paced or ""
        ms = graphed_ms(call, iters, warmup)[0] if graph else None
        return ms if ms is not None else median_ms(call, iters, warmup)

    try:
        base = timed(None)
        return {t: (timed(t) - base) / R for t in TRANSFERS}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def host_profile(title: str, call, rows: int = 30) -> None:
    """Prints where one rank thread's host time goes in one ``call`` (cProfile, by own time):
    what a rank's process would spend issuing, with the other rank threads contending for the
    interpreter as they run. One thread only: since Python 3.12 one profiler at a time runs."""
    import cProfile
    import io
    import pstats
    import threading

    from torchtitan_megamoe.ops import loopback_moe as lm

    step, prof, first = lm._rank_step, cProfile.Profile(), threading.Lock()

    def profiled(*a, **k):
        if not first.acquire(blocking=False):  # held for good by the first rank thread
            return step(*a, **k)
        prof.enable()
        try:
            return step(*a, **k)
        finally:
            prof.disable()

    lm._rank_step = profiled
    try:
        call()
    finally:
        lm._rank_step = step
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(rows)
    print(f"--- host, one rank thread ({title}, by own time):", flush=True)
    print("\n".join(text.getvalue().splitlines()[-rows - 2:]), flush=True)


def bench_shape_loopback(key: str, R: int, tokens: int, iters: int, warmup: int,
                         backward: bool, backend: str = "hopper", precision: str = "bf16",
                         exposed_gbs: float = 0.0, profile: bool = False,
                         graph: bool = False) -> dict:
    """Times (ms, median of ``iters`` waited calls) of one loopback EP=R layer and of ours at
    EP=1 on the same R*tokens, forward and with ``backward`` forward + backward, in
    ``precision``; and the bytes per transfer, counted and modelled; with ``exposed_gbs``
    (and ``backward``) also what each transfer exposes on a link of that many GB/s; with
    ``profile`` the top GPU kernels of both, last pass; with ``graph`` (and ``backward``) both
    forward + backward captured in one CUDA graph and replayed (timing.graphed_ms)."""
    shape = SHAPES[key]
    if shape["experts"] % R:
        raise ValueError(f"{shape['experts']} experts do not split over EP={R}")
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    args, dy = _inputs(shape, R, tokens, dev)
    res = {"shape": shape["name"], "tokens": tokens, "ep": R, "loopback": True,
           "dim": shape["dim"], "hidden": shape["hidden"], "experts": shape["experts"],
           "top_k": shape["top_k"], "backend": backend, "precision": precision}
    def layer(shards, dys):  # one call of every rank's layer (forward + backward with dys)
        return lambda: loopback_moe(shards, dys, backend=backend, precision=precision)

    graphed = {}  # name -> its forward + backward, for the CUDA graph timed last
    for name, ranks in (("loopback", R), ("ep1", 1)):
        shards = shard(ranks, *args)
        dys = list(torch.split(dy, tokens * R // ranks))
        calls = {"fwd": layer(shards, None)}
        if backward:
            calls["fwdbwd"] = graphed[name] = layer(shards, dys)
        for tag, call in calls.items():
            res[f"{name}_{tag}_ms"] = median_ms(call, iters, warmup)
            res[f"{name}_{tag}_host_ms"] = host_issue_ms(call, iters)
            res[f"{name}_{tag}_busy_ms"], res[f"{name}_{tag}_kernels"] = gpu_busy_ms(call)
        if profile and torch.cuda.is_available():
            profile_kernels(f"{shape['name']} {precision} EP={ranks} ({name}) {tag}", call, 0,
                            calls=2, rows=30, host_profile=False)
            host_profile(f"{shape['name']} {precision} EP={ranks} ({name}) {tag}", call)
        if name == "loopback":
            # the last pass's call: forward + backward where it runs
            res["bytes"] = counted_bytes(call, R)
            if exposed_gbs and backward:
                res["exposed_ms"] = exposed_ms(call, R, iters, warmup, exposed_gbs, graph)
            res["per_rank_peak_mib"] = peak_extra_mib(call) / R
    one = shard(1, *(a[:tokens] if i < 3 else a for i, a in enumerate(args)))
    rank_call = layer(one, [dy[:tokens]] if backward else None)
    res["ep1_peak_mib"] = peak_extra_mib(rank_call)
    # R times ours at EP=1 on one rank's T tokens: R ranks' GEMMs at a rank's rows per expert
    # with no exchange, which an EP=R node pays at any machinery (EP=1 on R*T runs R times the
    # rows per expert: fuller waves, longer weight-gradient sums)
    last = "fwdbwd" if backward else "fwd"
    res[f"ep1_rank_{last}_busy_ms"] = R * gpu_busy_ms(rank_call)[0]
    if backward:
        graphed["ep1_rank"] = rank_call
    if graph and torch.cuda.is_available():
        # last: a capture that fails cannot cost the numbers above
        for name, call in graphed.items():
            res[f"{name}_fwdbwd_graph_ms"], err = graphed_ms(call, iters)
            if err:
                res[f"{name}_graph_error"] = err
        if res.get("ep1_rank_fwdbwd_graph_ms") is not None:
            res["ep1_rank_fwdbwd_graph_ms"] *= R
    res["model_bytes"] = model_bytes(R, tokens, shape["dim"], shape["experts"], shape["top_k"],
                                     precision)
    for tag in ("fwd", "fwdbwd"):
        if f"loopback_{tag}_ms" in res:
            res[f"per_rank_{tag}_ms"] = res[f"loopback_{tag}_ms"] / R
            res[f"per_rank_{tag}_busy_ms"] = res[f"loopback_{tag}_busy_ms"] / R
            res[f"per_rank_{tag}_host_ms"] = res[f"loopback_{tag}_host_ms"] / R
            res[f"overhead_{tag}"] = res[f"loopback_{tag}_ms"] / res[f"ep1_{tag}_ms"]
            if res[f"ep1_{tag}_busy_ms"]:
                res[f"overhead_busy_{tag}"] = (res[f"loopback_{tag}_busy_ms"]
                                               / res[f"ep1_{tag}_busy_ms"])
            if res.get(f"ep1_rank_{tag}_busy_ms"):
                res[f"overhead_rank_busy_{tag}"] = (res[f"loopback_{tag}_busy_ms"]
                                                    / res[f"ep1_rank_{tag}_busy_ms"])
    return res


def loopback_table(results: list[dict]) -> str:
    """Per shape, precision and pass: the waited time of all R ranks (events: host-bound where
    the one process issues slower than the device runs), the host's issue time, the device's
    busy time (GPU time), each beside ours at EP=1 on the R*T tokens; GPU time EP=R / EP=1 is
    the EP machinery's overhead."""
    lines = ["| shape | precision | EP (loopback) | tokens/rank | pass | R ranks ms (waited) | "
             "host issue ms | GPU busy ms | EP=1 on R*T: waited / busy ms | GPU busy EP=R / "
             "EP=1 | R x EP=1 on T: busy ms (EP=R / it) | kernels EP=R / EP=1 | peak MiB per "
             "rank / EP=1 on T |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for tag in ("fwd", "fwdbwd"):
            if f"loopback_{tag}_ms" not in r:
                continue
            busy = r.get(f"overhead_busy_{tag}")
            lines.append(f"| {r['shape']} | {r['precision']} | {r['ep']} | {r['tokens']} | "
                         f"{tag} | {r[f'loopback_{tag}_ms']:.3f} | "
                         f"{r[f'loopback_{tag}_host_ms']:.3f} | "
                         f"{r[f'loopback_{tag}_busy_ms']:.3f} | {r[f'ep1_{tag}_ms']:.3f} / "
                         f"{r[f'ep1_{tag}_busy_ms']:.3f} | "
                         f"{'-' if busy is None else f'{busy:.2f}x'} | {_per_rank(r, tag)} | "
                         f"{r[f'loopback_{tag}_kernels']:.0f} / {r[f'ep1_{tag}_kernels']:.0f} | "
                         f"{_peaks(r)} |")
    for r in results:  # --graph: both captured in one CUDA graph, no host in the way
        if "loopback_fwdbwd_graph_ms" not in r:
            continue
        mine, one = r["loopback_fwdbwd_graph_ms"], r.get("ep1_fwdbwd_graph_ms")
        ranks = r.get("ep1_rank_fwdbwd_graph_ms")
        ratio = f" = {mine / one:.2f}x" if mine and one else ""
        rratio = f" = {mine / ranks:.2f}x" if mine and ranks else ""
        errs = "; ".join(r[k] for k in ("loopback_graph_error", "ep1_graph_error",
                                        "ep1_rank_graph_error") if k in r)
        lines.append(f"- {r['shape']} {r['precision']} EP={r['ep']}, fwd+bwd as one CUDA graph: "
                     f"{_ms(mine)} ms / EP=1 {_ms(one)} ms{ratio}; / {r['ep']} x EP=1 on "
                     f"{r['tokens']} tokens {_ms(ranks)} ms{rratio}"
                     + (f" ({errs})" if errs else ""))
    return "\n".join(lines)


def _per_rank(r: dict, tag: str) -> str:
    ms, ratio = r.get(f"ep1_rank_{tag}_busy_ms"), r.get(f"overhead_rank_busy_{tag}")
    return "-" if not ms else f"{ms:.3f} ({ratio:.2f}x)"


def _ms(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _peaks(r: dict) -> str:
    mine, one = r.get("per_rank_peak_mib", 0.0), r.get("ep1_peak_mib", 0.0)
    return f"{mine:,.0f} / {one:,.0f}" + (f" ({mine / one:.2f}x)" if one else "")


def bytes_table(results: list[dict]) -> str:
    """Per rank and transfer: counted MB of token rows and of metadata, the model's MB of token
    rows, counted rows / model, and (``--exposed``) the ms it exposes on the paced link."""
    lines = ["| shape | precision | EP | transfer | counted rows MB/rank | + metadata MB | model "
             "MB/rank | counted / model | exposed ms/rank |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for t in TRANSFERS:
            if t not in r["bytes"]:
                continue
            got, want = r["bytes"][t], r["model_bytes"][t]
            meta = r["bytes"].get(f"{t} meta", 0)
            exp = r.get("exposed_ms", {}).get(t)
            lines.append(f"| {r['shape']} | {r['precision']} | {r['ep']} | {t} | "
                         f"{got / 1e6:.1f} | {meta / 1e6:.1f} | {want / 1e6:.1f} | "
                         f"{got / want:.3f} | {'-' if exp is None else f'{exp:.3f}'} |")
    return "\n".join(lines)
