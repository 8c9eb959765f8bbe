"""Kernel A (dgrad L2 + SwiGLU backward + d(topk_weights) partials) vs float64 closed forms."""

import pytest
import torch

from moe_testing import (
    POISON, SMALL, assert_close, same_bits, make_inputs, per_slot_f64, plan_for, routing,
)
from torchtitan_megamoe.ops.hopper.kernels.dgrad2_swiglu import dgrad2_swiglu
from torchtitan_megamoe.ops.hopper.sides.gemm1_swiglu import gemm1_swiglu

BN, BK = 16, 16


def saved_a(inp, plan, H):
    """The forward's saved pre-activations in the plan's row space, built from float64 math:
    [a1 | a3] rounded once to bf16 per real row, zeros on padding rows (as GEMM 1 stores them),
    NaN past the used rows (never read)."""
    ids = inp["topk_ids"]
    K = ids.shape[1]
    e = ids.clamp(min=0)
    x = inp["x"].double()
    a1 = torch.einsum("td,tkhd->tkh", x, inp["w1"].double()[e]).reshape(-1, H)
    a3 = torch.einsum("td,tkhd->tkh", x, inp["w3"].double()[e]).reshape(-1, H)
    a = torch.full((plan.max_rows, 2 * H), POISON, dtype=torch.bfloat16)
    used = int(plan.num_rows_used)
    a[:used] = 0
    row_slot = plan.row_slot[:used].long()
    real = torch.nonzero(row_slot >= 0).squeeze(1)
    a[real] = torch.cat([a1, a3], 1)[row_slot[real]].to(torch.bfloat16)
    assert K == ids.shape[1]
    return a


def _run(inp, plan, H, a, block_m=None, use_tma=False):
    R = plan.max_rows
    n_h = -(-H // BN)
    out = (
        torch.full((R, 2 * H), POISON, dtype=torch.bfloat16),
        torch.full((R, H), POISON, dtype=torch.bfloat16),
        torch.full((n_h, R), POISON, dtype=torch.float32),
    )
    return dgrad2_swiglu(
        inp["dy"], a, inp["topk_weights"], inp["w2"], plan,
        block_m=block_m, block_n=BN, block_k=BK, use_tma=use_tma, out=out,
    )


def _check(T, K, E, D, H, ids, seed=0, block_m=None, use_tma=False):
    inp = make_inputs(T, K, E, D, H, ids, seed=seed)
    plan = plan_for(inp["topk_ids"], E)
    da, hw, part = _run(inp, plan, H, saved_a(inp, plan, H), block_m, use_tma)
    ref = per_slot_f64(inp)
    used = int(plan.num_rows_used)
    row_slot = plan.row_slot[:used].long()
    real = row_slot >= 0
    slots = row_slot[real]
    assert_close(da[:used][real, :H], ref["da1"][slots], name="da1")
    assert_close(da[:used][real, H:], ref["da3"][slots], name="da3")
    assert_close(hw[:used][real], ref["hw"][slots], name="hw")
    # a1/a3 carry bf16 rounding (~4e-3 in the dot)
    assert_close(part[:, :used].sum(0)[real], ref["dtw"][slots], tol=1e-2, name="dtw")
    # Padding rows inside segments are read by the weight-gradient kernel's tiles: zeros.
    assert (da[:used][~real] == 0).all() and (hw[:used][~real] == 0).all()
    assert (part[:, :used][:, ~real] == 0).all()
    return da, hw, part


@pytest.mark.parametrize("case", ["uneven", "one_expert", "all_dropped"])
def test_dgrad_l2_swiglu_routings(case):
    T, K, E, D, H = SMALL["T"], SMALL["K"], SMALL["E"], SMALL["D"], SMALL["H"]
    ids = routing(case, T, K, E)
    _check(T, K, E, D, H, ids)


def test_dgrad_l2_swiglu_row_subtiles():
    """Row tiles smaller than the plan's tile (block_m=4 inside plan tiles of 8)."""
    T, K, E, D, H = SMALL["T"], SMALL["K"], SMALL["E"], SMALL["D"], SMALL["H"]
    _check(T, K, E, D, H, routing("uneven", T, K, E, seed=6), seed=6, block_m=4)


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
def test_dgrad_l2_swiglu_even_shapes(use_tma):
    """D and H multiples of the tiles: the unmasked (EVEN) path, and TMA weight loads."""
    T, K, E = SMALL["T"], SMALL["K"], SMALL["E"]
    _check(T, K, E, 32, 32, routing("uneven", T, K, E, seed=8), seed=8, use_tma=use_tma)


def test_dgrad_l2_swiglu_single_token():
    _check(1, 2, 3, 24, 20, torch.tensor([[2, 0]]), seed=3)


def test_dgrad_l2_swiglu_deterministic():
    T, K, E, D, H = SMALL["T"], SMALL["K"], SMALL["E"], SMALL["D"], SMALL["H"]
    ids = routing("uneven", T, K, E, seed=1)
    inp = make_inputs(T, K, E, D, H, ids, seed=1)
    plan = plan_for(inp["topk_ids"], E)
    used = int(plan.num_rows_used)
    a = saved_a(inp, plan, H)
    da, hw, part = _run(inp, plan, H, a, use_tma=True)
    da2, hw2, part2 = _run(inp, plan, H, a, use_tma=True)
    assert same_bits(da[:used], da2[:used]) and same_bits(hw[:used], hw2[:used])
    assert same_bits(part[:, :used], part2[:, :used])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dgrad_l2_swiglu_gpu_30b_shape():
    """One layer of the 30B shape (D=2048, H=768, E=128, K=8) at 4096 tokens, bf16, on GEMM 1's
    a."""
    T, K, E, D, H = 4096, 8, 128, 2048, 768
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    inp = make_inputs(T, K, E, D, H, ids, device="cuda")
    plan = plan_for(inp["topk_ids"], E, block_m=128)
    # a from the forward's GEMM 1 (as training saves or recomputes it): the spot checks below
    # then cover both kernels against float64 closed forms
    _, a = gemm1_swiglu(inp["x"], inp["w1"], inp["w3"], plan, save_a=True)
    da, hw, part = dgrad2_swiglu(inp["dy"], a, inp["topk_weights"], inp["w2"], plan)
    # Spot-check slots of a few tokens in float64 on the GPU (the closed form of every slot
    # would gather [T, K, H, D] weights).
    sig = torch.nn.functional.silu
    dtw, ref_dtw = [], []
    for t in range(0, T, 409):
        x64, dy64 = inp["x"][t].double(), inp["dy"][t].double()
        for k in range(K):
            e, w = int(ids[t, k]), inp["topk_weights"][t, k].double()
            r = int(plan.slot_row[t * K + k])
            a1 = inp["w1"][e].double() @ x64
            a3 = inp["w3"][e].double() @ x64
            dh = dy64 @ inp["w2"][e].double()
            s = torch.sigmoid(a1)
            ref_da1 = w * dh * a3 * s * (1 + a1 * (1 - s))
            ref_da3 = w * dh * sig(a1)
            assert_close(da[r, :H], ref_da1, name="da1")
            assert_close(da[r, H:], ref_da3, name="da3")
            assert_close(hw[r], w * sig(a1) * a3, name="hw")
            dtw.append(part[:, r].sum())
            ref_dtw.append((dh * sig(a1) * a3).sum())
    # h comes from the bf16-rounded a1/a3 (as stock autograd saves them), so a dot that cancels
    # to near zero has no relative accuracy of its own: judged on the scale of all sampled dots
    assert_close(torch.stack(dtw), torch.stack(ref_dtw), name="dtw")
