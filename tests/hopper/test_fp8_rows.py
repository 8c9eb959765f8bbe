"""The FP8 row passes around a plain grouped GEMM (kernels/fp8_quant.gather_rows,
swiglu_quant_rows; swiglu_bwd_rows with ``quant``) against float64 math, outputs poisoned first,
and, on a GPU with DeepGEMM installed, DeepGEMM's side of each FP8 GEMM against ours."""

import pytest
import torch
import torch.nn.functional as F

from moe_testing import plan_for, rel_err, routing
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import (
    FP8, gather_rows, quant_rows, swiglu_quant_rows,
)
from torchtitan_megamoe.ops.hopper.kernels.swiglu_bwd_rows import swiglu_bwd_rows
from torchtitan_megamoe.ops.reference import ACT, quantize_dequantize_fp8

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _dequant(q, s):
    return q.double() * s.double().repeat_interleave(128, dim=1)


@pytest.mark.parametrize("case,D", [("uneven", 256), ("one_expert", 256), ("all_dropped", 256),
                                    ("uneven", 640)])  # 640: no multiple of 512 or 256
def test_gather_rows_puts_token_rows_in_the_row_space(case, D):
    T, K, E = 37, 3, 5
    ids = routing(case, T, K, E, seed=3).to(DEV)
    plan = plan_for(ids, E, 128)
    x = torch.randn(T, D, device=DEV).bfloat16()
    q, s = quant_rows(x)
    rq, rs = gather_rows(q, s, plan)
    used = int(plan.num_rows_used)
    slot = plan.row_slot[:used].long()
    live = slot >= 0
    tok = slot.clamp(min=0) // K
    assert torch.equal(rq[:used][live].view(torch.uint8), q[tok[live]].view(torch.uint8))
    assert torch.equal(rs[:used][live], s[tok[live]])
    assert (rq[:used][~live].view(torch.uint8) == 0).all() and (rs[:used][~live] == 0).all()


def test_swiglu_quant_rows_vs_f64():
    T, K, E, H = 29, 2, 3, 256
    ids = routing("uneven", T, K, E, seed=4).to(DEV)
    plan = plan_for(ids, E, 128)
    R = plan.max_rows
    a = torch.randn(R, 2 * H, device=DEV).bfloat16()
    hq = torch.full((R, H), float("nan"), device=DEV).to(FP8)
    hs = torch.full((R, H // 128), float("nan"), device=DEV)
    swiglu_quant_rows(a, plan, hq, hs)
    used = int(plan.num_rows_used)
    h = F.silu(a[:used, :H].double()) * a[:used, H:].double()
    got = _dequant(hq[:used], hs[:used])
    assert torch.isfinite(got).all()
    # the recipe's own rounding of h: the kernel must land on it (ties aside)
    assert rel_err(got, quantize_dequantize_fp8(h, ACT)) < 2e-3
    assert 1e-3 < rel_err(got, h) < 6e-2  # e4m3 error, not none


@pytest.mark.parametrize("case", ["uneven", "one_expert"])
def test_swiglu_bwd_rows_quant_matches_its_bf16_da(case):
    T, K, E, H = 31, 3, 4, 256
    ids = routing(case, T, K, E, seed=5).to(DEV)
    plan = plan_for(ids, E, 128)
    R = plan.max_rows
    slot = plan.row_slot.long()
    dh = torch.randn(R, H, device=DEV).bfloat16().masked_fill((slot < 0)[:, None], 0.0)
    a = torch.randn(R, 2 * H, device=DEV).bfloat16()
    tw = torch.rand(T, K, device=DEV)
    da, hw, part, daq, das = swiglu_bwd_rows(dh, a, tw, plan, quant=True)
    ref, _, _ = swiglu_bwd_rows(dh, a, tw, plan)
    used = int(plan.num_rows_used)
    assert torch.equal(da[:used], ref[:used])  # quant adds outputs, changes none
    got = _dequant(daq[:used], das[:used])
    assert torch.isfinite(got).all()
    # quantized from the fp32 values (not from the bf16 da): the recipe's rounding of them
    a1, a3, d = a[:used, :H].double(), a[:used, H:].double(), dh[:used].double()
    s_ = slot[:used]
    w = torch.where(s_ >= 0, tw.reshape(-1)[s_.clamp(min=0)].double(), 0.0)[:, None]
    sig = torch.sigmoid(a1)
    want = torch.cat([w * d * a3 * (sig + a1 * sig * (1 - sig)), w * d * F.silu(a1)], 1)
    assert rel_err(got, quantize_dequantize_fp8(want, ACT)) < 3e-3
    assert 1e-3 < rel_err(got, want) < 6e-2
    pad = (slot[:used] < 0)
    assert (got[pad] == 0).all()


def _deepgemm_ready():
    if not CUDA:
        return False
    from torchtitan_megamoe.ops.hopper import deepgemm

    return deepgemm.available(torch.zeros(1, device="cuda"))


def test_deepgemm_joined_finds_the_halves_of_one_copy():
    """deepgemm.joined: w1's and w3's copies as the halves of one [E, 2H, D] copy give the
    whole (one GEMM 1 launch); separate buffers, or halves in the other order, give None."""
    from torchtitan_megamoe.ops.hopper import deepgemm

    E, H, D = 3, 256, 384
    q = torch.randn(E, 2 * H, D).to(FP8)
    s = torch.rand(E, 2 * H // 128, D // 128)
    w1q, w3q, w1s, w3s = q[:, :H], q[:, H:], s[:, :H // 128], s[:, H // 128:]
    whole = deepgemm.joined(w1q, w1s, w3q, w3s)
    assert whole is not None
    assert whole[0].data_ptr() == q.data_ptr() and whole[0].shape == q.shape
    assert torch.equal(whole[0].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(whole[1], s)
    assert deepgemm.joined(w3q, w3s, w1q, w1s) is None
    assert deepgemm.joined(w1q.contiguous(), w1s.contiguous(), w3q.contiguous(),
                           w3s.contiguous()) is None


@pytest.mark.gpu
@pytest.mark.skipif(not _deepgemm_ready(), reason="needs a Hopper GPU with DeepGEMM installed")
@pytest.mark.parametrize("case", ["random", "uneven", "one_expert"])
def test_deepgemm_side_matches_ours(case):
    """Each FP8 GEMM with the DeepGEMM side pinned vs our Triton side: the row GEMM on row-space
    A (GEMM 2, dgrad1), on token rows (dgrad2), and GEMM 1 with its SwiGLU pass; not offered
    for one group of experts."""
    from torchtitan_megamoe.ops.hopper.fp8_weights import forward_weights, w2_transposed
    from torchtitan_megamoe.ops.hopper.heuristics import FP8_CONFIGS
    from torchtitan_megamoe.ops.hopper.configs import DeepGemm
    from torchtitan_megamoe.ops.hopper.sides.fp8_gemm import (
        STAGES, Shape, fp8_gemm1_swiglu, fp8_gemm_rows,
    )
    from torchtitan_megamoe.ops.hopper.sides.table import available

    FP8_DEEPGEMM = DeepGemm()

    T, K, E, D, H = 1000, 4, 8, 512, 384
    ids = routing(case, T, K, E, seed=6).cuda()
    plan = plan_for(ids, E, 128)
    used = int(plan.num_rows_used)
    x = torch.randn(T, D, device="cuda").bfloat16()
    w1, w3 = (torch.randn(E, H, D, device="cuda") * D ** -0.5).bfloat16(), \
        (torch.randn(E, H, D, device="cuda") * D ** -0.5).bfloat16()
    w2 = (torch.randn(E, D, H, device="cuda") * H ** -0.5).bfloat16()
    xq, xs = quant_rows(x)
    wq = forward_weights(w1, w2, w3)
    g1, rows_cfg = FP8_CONFIGS["gemm1_swiglu"][0], FP8_CONFIGS["gemm_rows"][0]
    ours = fp8_gemm1_swiglu(xq, xs, wq.w1q, wq.w1s, wq.w3q, wq.w3s, plan, True, g1)
    dg = fp8_gemm1_swiglu(xq, xs, wq.w1q, wq.w1s, wq.w3q, wq.w3s, plan, True, FP8_DEEPGEMM)
    assert rel_err(dg[2][:used].double(), ours[2][:used].double()) < 1e-2  # a
    assert rel_err(_dequant(dg[0][:used], dg[1][:used]), _dequant(ours[0][:used], ours[1][:used])) < 3e-2
    # the module's copies (make_fp8_weights): with DeepGEMM, w1|w3 are halves of one copy and
    # GEMM 1 is one launch over both; ours copy the halves contiguous: the same results
    from torchtitan_megamoe.ops.hopper import deepgemm
    from torchtitan_megamoe.ops.hopper.fp8_weights import make_fp8_weights

    held = make_fp8_weights(w1, w2, w3).fwd
    assert deepgemm.joined(held.w1q, held.w1s, held.w3q, held.w3s) is not None
    for cfg, want in ((FP8_DEEPGEMM, dg), (g1, ours)):
        got = fp8_gemm1_swiglu(xq, xs, held.w1q, held.w1s, held.w3q, held.w3s, plan, True, cfg)
        assert rel_err(got[2][:used].double(), want[2][:used].double()) < 1e-3, cfg
    hq, hs = ours[0], ours[1]
    y_ours = fp8_gemm_rows(hq, hs, wq.w2q, wq.w2s, plan, torch.bfloat16, config=rows_cfg)
    y_dg = fp8_gemm_rows(hq, hs, wq.w2q, wq.w2s, plan, torch.bfloat16, config=FP8_DEEPGEMM)
    assert rel_err(y_dg[:used].double(), y_ours[:used].double()) < 1e-2
    gq, gs = quant_rows(torch.randn(T, D, device="cuda").bfloat16())
    w2t = w2_transposed(w2)
    dh_ours = fp8_gemm_rows(gq, gs, w2t.q, w2t.s, plan, torch.bfloat16, gather=True,
                            config=rows_cfg, stage="fp8_dgrad2")
    dh_dg = fp8_gemm_rows(gq, gs, w2t.q, w2t.s, plan, torch.bfloat16, gather=True,
                          config=FP8_DEEPGEMM, stage="fp8_dgrad2")
    live = plan.row_slot[:used] >= 0
    assert rel_err(dh_dg[:used][live].double(), dh_ours[:used][live].double()) < 1e-2
    # one group of experts: DeepGEMM overwrites the skipped experts' rows (with zeros), so it
    # must not be offered there (the backward's dgrad1 by groups shares one output)
    for group in (True, False):
        shape = Shape("gemm_rows", H, D, 128, out_bf16=True, gather=False, expert_group=group)
        offer = STAGES["fp8_dgrad1"].offer(shape, available(gq))
        assert (FP8_DEEPGEMM in offer.candidates) is not group


def test_quant_rows_skip_flag_leaves_its_outputs_unwritten(monkeypatch):
    """quant_rows(skip=) (the EP backward's recompute of a kept region): a true device flag
    writes nothing, a false one the rows of a call without it."""
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    q0, s0 = quant_rows(x)
    q1, s1 = quant_rows(x, skip=torch.tensor(False))
    assert torch.equal(q1.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s1, s0)
    full = torch.full  # outputs poisoned first: a skipped call must leave them as they were
    monkeypatch.setattr(torch, "empty", lambda shape, **k: full(shape, 7, dtype=k["dtype"]))
    q2, s2 = quant_rows(x, skip=torch.tensor(True))
    assert (s2 == 7).all() and (q2.float() == 7).all()
