"""EP=R on ONE device: ours with R loopback ranks in one process (ops/loopback.py), each rank
on its own stream, against ours at EP=1 on the same R*T tokens (``--ep R --loopback``).

A loopback step is every rank's layer, all on one device, so its time is R ranks' work: the
per-rank figure is that time / R, and loopback / EP=1 is the EP machinery's overhead (the
exchange's copies and barriers, R*C-row buffers, the phased plans). The ranks issue one after
another on the host (ops/loopback.py's baton), so small shapes show host time too.
"""

from __future__ import annotations

import torch

from torchtitan_megamoe.bench.shapes import SHAPES
from torchtitan_megamoe.ops.loopback_moe import loopback_moe, shard
from torchtitan_megamoe.timing import median_ms


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


def bench_shape_loopback(key: str, R: int, tokens: int, iters: int, warmup: int,
                         backward: bool, backend: str = "hopper") -> dict:
    """Times (ms, median of ``iters`` waited calls) of one loopback EP=R layer and of ours at
    EP=1 on the same R*tokens, forward and with ``backward`` forward + backward."""
    shape = SHAPES[key]
    if shape["experts"] % R:
        raise ValueError(f"{shape['experts']} experts do not split over EP={R}")
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    args, dy = _inputs(shape, R, tokens, dev)
    res = {"shape": shape["name"], "tokens": tokens, "ep": R, "loopback": True,
           "dim": shape["dim"], "hidden": shape["hidden"], "experts": shape["experts"],
           "top_k": shape["top_k"], "backend": backend}
    for name, ranks in (("loopback", R), ("ep1", 1)):
        shards = shard(ranks, *args)
        dys = list(torch.split(dy, tokens * R // ranks))
        res[f"{name}_fwd_ms"] = median_ms(
            lambda: loopback_moe(shards, backend=backend, precision="bf16"), iters, warmup)
        if backward:
            res[f"{name}_fwdbwd_ms"] = median_ms(
                lambda: loopback_moe(shards, dys, backend=backend, precision="bf16"), iters,
                warmup)
    for tag in ("fwd", "fwdbwd"):
        if f"loopback_{tag}_ms" in res:
            res[f"per_rank_{tag}_ms"] = res[f"loopback_{tag}_ms"] / R
            res[f"overhead_{tag}"] = res[f"loopback_{tag}_ms"] / res[f"ep1_{tag}_ms"]
    return res


def loopback_table(results: list[dict]) -> str:
    lines = ["| shape | EP (loopback) | tokens/rank | pass | R ranks ms | per rank ms | "
             "EP=1 on R*T ms | EP=R / EP=1 |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for tag in ("fwd", "fwdbwd"):
            if f"loopback_{tag}_ms" in r:
                lines.append(f"| {r['shape']} | {r['ep']} | {r['tokens']} | {tag} | "
                             f"{r[f'loopback_{tag}_ms']:.3f} | {r[f'per_rank_{tag}_ms']:.3f} | "
                             f"{r[f'ep1_{tag}_ms']:.3f} | {r[f'overhead_{tag}']:.2f}x |")
    return "\n".join(lines)
