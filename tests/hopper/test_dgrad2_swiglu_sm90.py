"""csrc/dgrad2_swiglu.cu's bf16 mode (dgrad2_swiglu on the saved a1/a3 in one launch) on an
H200 (marked gpu; skipped without an sm_90 GPU and nvcc): da, hw and the d(topk_weights)
partials (and the gathered dy rows it can store) against float64 math on uneven routings with
the outputs poisoned (NaN) first, the real Qwen3-30B shape against the Triton kernel A, bitwise
reruns, and the saved-path backward with it forced against the reference backend."""

import pytest
import torch
import torch.nn.functional as F

from moe_testing import (SM90_GPU, forced_backward_matches_reference, nan_tensor, rel_err,
                         routings, skewed_ids)
from torchtitan_megamoe.ops.hopper.cuda.dgrad2_swiglu import dgrad2_swiglu_sm90
from torchtitan_megamoe.ops.hopper.kernels.grouped_mm import gather_rows
from torchtitan_megamoe.ops.hopper.kernels.dgrad2_swiglu import dgrad2_swiglu
from torchtitan_megamoe.ops.hopper.plan import build_plan
from torchtitan_megamoe.ops.hopper.configs import Sm90Fused

pytestmark = SM90_GPU
BM = 128



def _saved_a(plan, H, g):
    """[a1 | a3] as the forward saves it: random used rows, zero padding rows."""
    used = int(plan.num_rows_used)
    a = torch.zeros(plan.max_rows, 2 * H, device="cuda").bfloat16()
    a[:used] = torch.randn(used, 2 * H, device="cuda", generator=g).bfloat16()
    a[plan.row_slot < 0] = 0
    return a


def _f64(dy, a, tw, w2, plan):
    """float64 (da, hw, <dh, h>) of the used rows (zeros for padding rows)."""
    used = int(plan.num_rows_used)
    H = w2.shape[2]
    slot = plan.row_slot[:used].long()
    expert = plan.tile_expert.repeat_interleave(plan.block_m)[:used].long()
    real = slot >= 0
    tok = torch.where(real, slot // plan.top_k, 0)
    dyr = dy[tok].double() * real[:, None]
    w = torch.where(real, tw.reshape(-1)[slot.clamp(min=0)].double(), 0.0)
    dh = torch.zeros(used, H, dtype=torch.float64, device="cuda")
    for e in expert.unique().tolist():
        m = expert == e
        dh[m] = dyr[m] @ w2[e].double()
    a1, a3 = a[:used, :H].double(), a[:used, H:].double()
    sig = torch.sigmoid(a1)
    silu = F.silu(a1)
    h = silu * a3
    da1 = w[:, None] * dh * a3 * (sig + silu * (1 - sig))
    da3 = w[:, None] * dh * silu
    return torch.cat([da1, da3], 1), w[:, None] * h, (dh * h).sum(1)



@pytest.mark.parametrize("T,K,E,D,H", [(700, 4, 8, 256, 256), (333, 2, 5, 640, 512),
                                       (300, 2, 3, 128, 256)],
                         ids=["k_blocks_4", "k_blocks_10", "k_blocks_2"])
def test_vs_float64_on_uneven_routings(T, K, E, D, H):
    g = torch.Generator(device="cuda").manual_seed(0)
    w2 = (torch.randn(E, D, H, device="cuda", generator=g) / D**0.5).bfloat16()
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    tw = torch.rand(T, K, device="cuda", generator=g)
    for name, ids in routings(T, K, E):
        plan = build_plan(ids.cuda(), E, BM)
        n = ids.shape[0]
        a = _saved_a(plan, H, g)
        R = plan.max_rows
        out = (nan_tensor(R, 2 * H), nan_tensor(R, H), nan_tensor(H // 256, R, dtype=torch.float32))
        dy_rows = nan_tensor(R, D)
        da, hw, part = dgrad2_swiglu_sm90(dy[:n], a, tw[:n], w2, plan, out=out,
                                            dy_rows=dy_rows)
        torch.cuda.synchronize()
        used = int(plan.num_rows_used)
        # the gathered dy rows it stored: exactly gather_rows' copy (zeros on padding rows)
        assert torch.equal(dy_rows[:used], gather_rows(dy[:n], plan)[:used]), name
        assert torch.isnan(dy_rows[used:]).all(), "stored dy rows past the used ones"
        ref_da, ref_hw, ref_dot = _f64(dy[:n], a, tw[:n], w2, plan)
        for got, ref, what in ((da[:used], ref_da, "da"), (hw[:used], ref_hw, "hw"),
                               (part[:, :used].sum(0), ref_dot, "part")):
            assert not got.isnan().any(), (name, what, "left unwritten")
            assert rel_err(got, ref) <= 1e-2, (name, what, rel_err(got, ref))
        pad = plan.row_slot[:used] < 0
        assert torch.all(da[:used][pad] == 0) and torch.all(hw[:used][pad] == 0)
        assert torch.isnan(da[used:]).all(), "wrote rows past the used ones"


def test_real_30b_shape_matches_the_triton_kernel_a_and_reruns_bitwise():
    T, K, E, D, H = 16384, 8, 128, 2048, 768
    g = torch.Generator(device="cuda").manual_seed(1)
    w2 = (torch.randn(E, D, H, device="cuda", generator=g) / D**0.5).bfloat16()
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    ids = skewed_ids(T, K, E, generator=g)
    tw = torch.softmax(torch.randn(T, K, device="cuda", generator=g), -1)
    plan = build_plan(ids, E, BM)
    a = _saved_a(plan, H, g)
    da, hw, part = dgrad2_swiglu_sm90(dy, a, tw, w2, plan)
    tda, thw, tpart = dgrad2_swiglu(dy, a, tw, w2, plan, block_m=128, block_n=128,
                                      block_k=64, num_warps=8, num_stages=3, use_tma=True)
    used = int(plan.num_rows_used)
    assert rel_err(da[:used], tda[:used].double()) < 1e-2
    assert rel_err(hw[:used], thw[:used].double()) < 1e-2
    assert rel_err(part[:, :used].sum(0), tpart[:, :used].sum(0).double()) < 1e-2
    dy_rows = nan_tensor(plan.max_rows, D)
    da2, hw2, part2 = dgrad2_swiglu_sm90(dy, a, tw, w2, plan, dy_rows=dy_rows)
    assert torch.equal(dy_rows[:used], gather_rows(dy, plan)[:used])
    assert torch.equal(da2[:used], da[:used]) and torch.equal(hw2[:used], hw[:used])
    assert torch.equal(part2[:, :used], part[:, :used]), "reruns must be bitwise identical"


def test_saved_backward_with_the_fused_kernel_a_matches_the_reference(monkeypatch):
    forced_backward_matches_reference(
        monkeypatch, {"dgrad2_swiglu": Sm90Fused()}, seed=13, saved=True)
