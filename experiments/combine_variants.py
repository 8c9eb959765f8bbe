"""The combine and backward-combine Triton kernels (kernels/combine.py, kernels/bwd_combine.py)
at a Qwen3 shape, per tile config, on two routings: EP=1 (every slot of 16384 tokens has a
row) and one EP=8 peer region (16384 token places, the first ~2/3 live: tokens that chose at
least one of the rank's 16 experts, ~1.5 rows each; the rest left unwritten: ``live``).
CUDA-event medians of 20; every config's outputs must equal the default config's bit for bit
(the sums' order does not depend on the tile).

    python3 experiments/combine_variants.py [30b|235b]
"""

import sys

import torch

from torchtitan_megamoe.ops.hopper.kernels.bwd_combine import bwd_combine
from torchtitan_megamoe.ops.hopper.kernels.combine import combine
from torchtitan_megamoe.ops.hopper.plan import build_plan
from torchtitan_megamoe.ops.hopper.tiles import BLOCK_M
from torchtitan_megamoe.timing import median_ms

from routing import uniform_routing  # experiments/routing.py
from torchtitan_megamoe.bench.shapes import SHAPES

COMBINE = [(4, 512, 4), (8, 512, 4), (16, 512, 8), (16, 256, 4), (32, 256, 8), (8, 1024, 8),
           (32, 128, 4)]  # (block_t, block_d, num_warps), the default first
BWD = [(8, 256, 4), (16, 256, 4), (32, 256, 8), (16, 512, 8), (32, 128, 4), (4, 512, 4)]


def region(T: int, K: int, E: int, local: int, ep: bool):
    """(plan, live [1] int32 or None) of one region: EP=1's plan over all E experts, or an
    EP peer region's over experts [0, local), the tokens that chose one of them first (as the
    dispatch packs them), their other slots not local (id -1)."""
    ids = uniform_routing(E, K, T)
    if not ep:
        return build_plan(ids, E, BLOCK_M), None
    mine = (ids < local).any(1)
    ids = torch.cat([ids[mine], ids[~mine]])
    ids = torch.where(ids < local, ids, -1)
    ids[int(mine.sum()):] = -1
    live = mine.sum().to(torch.int32).reshape(1)
    return build_plan(ids, local, BLOCK_M), live


def main(shape_name: str = "30b") -> None:
    shape = SHAPES[shape_name]
    D, H, E, K, T = shape["dim"], shape["hidden"], shape["experts"], shape["top_k"], 16384
    torch.manual_seed(0)
    for name, ep in (("ep1", False), ("ep8 region", True)):
        plan, live = region(T, K, E, E // 8, ep)
        slot_row, n = plan.slot_row, int((plan.slot_row >= 0).sum())
        y = torch.randn(plan.max_rows, D, device="cuda").bfloat16()
        w = torch.rand(T, K, device="cuda")
        out = torch.zeros(T, D, device="cuda").bfloat16()
        n_live = int(live) if live is not None else T
        moved = (n * D + n_live * D) * 2  # bytes read and written (slot rows, weights aside)
        print(f"{shape_name} {name}: {n} rows, {n_live} live tokens, {moved / 1e6:.0f} MB moved",
              flush=True)
        ref = None
        for bt, bd, nw in COMBINE:
            fn = lambda: combine(y, w, slot_row, torch.bfloat16, bt, bd, out=out, live=live,
                                 num_warps=nw)
            fn()
            got = out[:n_live].clone()
            ref = got if ref is None else ref
            t = median_ms(fn, warmup=3, iters=20)
            print(f"  combine t{bt} d{bd} w{nw}: {t * 1e3:7.1f} us ({moved / t / 1e9:5.2f} TB/s)"
                  f"{'' if torch.equal(got, ref) else '  MISMATCH'}", flush=True)
        part = torch.randn(H // 256, plan.max_rows, device="cuda")
        ref = None
        for bt, bd, nw in BWD:
            fn = lambda: bwd_combine(y, part, plan, dx_dtype=torch.bfloat16,
                                     dtw_dtype=torch.float32, block_t=bt, block_d=bd,
                                     num_warps=nw, rows=True, live=live)
            dx, dtw = fn()
            got = (dx[:n_live].clone(), dtw[:n_live].clone())
            ref = got if ref is None else ref
            t = median_ms(fn, warmup=3, iters=20)
            same = all(torch.equal(a, b) for a, b in zip(got, ref))
            print(f"  bwd_combine t{bt} d{bd} w{nw}: {t * 1e3:7.1f} us "
                  f"({moved / t / 1e9:5.2f} TB/s){'' if same else '  MISMATCH'}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
