"""csrc/grouped_gemm_sm90.cu's MEGAMOE_SM90_TMA_GATHER=1 build (the gathered token rows loaded
by one TMA per row instead of cp.async) on an H200 (marked gpu; skipped without an sm_90 GPU
and nvcc): in every mode that gathers (GEMM 1, kernel A, dw2, dw1|dw3) its outputs must equal
the cp.async build's bitwise (same operands in shared memory, same MMA order), on uneven
routings (empty experts, every token to one expert, dropped slots: padding rows read out of
bounds, i.e. zeros) with the outputs poisoned (NaN) first, the token tensor a strided view (the
map's row stride), and at the Qwen3-30B shape against float64."""

import pytest
import torch

from moe_math import make_weights, routings
from sm90_checks import SM90_GPU, nan_tensor, rel_err
from torchtitan_megamoe.ops.cuda.dgrad_swiglu import dgrad_l2_swiglu_sm90
from torchtitan_megamoe.ops.cuda.gemm1_swiglu import gemm1_swiglu_sm90
from torchtitan_megamoe.ops.cuda.sm90 import BULK_STORE
from torchtitan_megamoe.ops.cuda.wgrad import wgrad_dw13_sm90, wgrad_dw2_sm90
from torchtitan_megamoe.ops.triton.bwd_wgrad import longest_first
from torchtitan_megamoe.ops.triton.plan import build_plan

pytestmark = SM90_GPU
BM = 128
TMA_GATHER = ("MEGAMOE_SM90_TMA_GATHER=1",)


def _strided(T, D, g):
    """[T, D] bf16 random rows, a view of a wider tensor (row stride D + 64)."""
    return torch.randn(T, D + 64, device="cuda", generator=g).bfloat16()[:, :D]


def _all_modes(x, dy, w1, w3, w2, a, da, hw, tw, plan, base, cluster):
    """Every gathering mode's outputs with the build `base` (+ TMA_GATHER or not)."""
    R, H = plan.max_rows, w1.shape[1]
    E, D = w1.shape[0], w1.shape[2]
    h, a_out = nan_tensor(R, H), nan_tensor(R, 2 * H)
    gemm1_swiglu_sm90(x, w1, w3, plan, h, a_out, cluster=cluster, defines=base)
    out = (nan_tensor(R, 2 * H), nan_tensor(R, H), nan_tensor(H // 256, R, dtype=torch.float32))
    dy_rows = nan_tensor(R, D)
    # kernel A and the weight gradients store through shared memory in every build
    bulk = BULK_STORE + tuple(d for d in base if d not in BULK_STORE)
    dgrad_l2_swiglu_sm90(dy, a, tw, w2, plan, out=out, dy_rows=dy_rows, defines=bulk)
    order = longest_first(plan)
    dw2 = wgrad_dw2_sm90(dy, hw, plan, nan_tensor(E, D, H), order, bulk)
    dw1, dw3 = wgrad_dw13_sm90(da, x, plan, nan_tensor(E, H, D), nan_tensor(E, H, D), order,
                               bulk)
    torch.cuda.synchronize()
    used = int(plan.num_rows_used)
    return {"h": h[:used], "a": a_out[:used], "da": out[0][:used], "hw": out[1][:used],
            "part": out[2][:, :used], "dy_rows": dy_rows[:used], "dw2": dw2, "dw1": dw1,
            "dw3": dw3}


def _inputs(T, K, E, D, H, plan, g):
    R = plan.max_rows
    pad = plan.row_slot < 0
    w1, w2, w3 = make_weights(E, D, H, device="cuda")  # w2 [E, D, H]
    a = torch.randn(R, 2 * H, device="cuda", generator=g).bfloat16()
    da = torch.randn(R, 2 * H, device="cuda", generator=g).bfloat16()
    hw = torch.randn(R, H, device="cuda", generator=g).bfloat16()
    a[pad], da[pad], hw[pad] = 0, 0, 0
    tw = torch.rand(T, K, device="cuda", generator=g)
    return w1, w3, w2, a, da, hw, tw


def _same(got, want, name):
    for key, ref in want.items():
        assert not got[key].isnan().any(), (name, key, "left unwritten")
        assert torch.equal(got[key], ref), (name, key, "TMA_GATHER changed the output",
                                            rel_err(got[key].float(), ref.float()))


@pytest.mark.parametrize("cluster", [1, 2], ids=["cta", "cluster2"])
@pytest.mark.parametrize("base", [BULK_STORE, ()], ids=["bulk_store", "register_store"])
@pytest.mark.parametrize("T,K,E,D,H", [(700, 4, 8, 256, 256), (333, 2, 5, 768, 512)],
                         ids=["k_blocks_4", "k_blocks_12"])
def test_bitwise_equal_to_the_cp_async_gather_on_uneven_routings(T, K, E, D, H, base, cluster):
    g = torch.Generator(device="cuda").manual_seed(0)
    x, dy = _strided(T, D, g), _strided(T, D, g)
    for name, ids in routings(T, K, E):
        plan = build_plan(ids.cuda(), E, BM)
        n = ids.shape[0]
        w1, w3, w2, a, da, hw, tw = _inputs(n, K, E, D, H, plan, g)
        want = _all_modes(x[:n], dy[:n], w1, w3, w2, a, da, hw, tw, plan, base, cluster)
        got = _all_modes(x[:n], dy[:n], w1, w3, w2, a, da, hw, tw, plan, base + TMA_GATHER,
                         cluster)
        _same(got, want, name)


def test_real_30b_shape_against_float64():
    T, K, E, D, H = 4096, 8, 128, 2048, 768
    g = torch.Generator(device="cuda").manual_seed(1)
    x, dy = _strided(T, D, g), _strided(T, D, g)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)])
    plan = build_plan(ids, E, BM)
    w1, w3, w2, a, da, hw, tw = _inputs(T, K, E, D, H, plan, g)
    got = _all_modes(x, dy, w1, w3, w2, a, da, hw, tw, plan, BULK_STORE + TMA_GATHER, 1)
    want = _all_modes(x, dy, w1, w3, w2, a, da, hw, tw, plan, BULK_STORE, 1)
    _same(got, want, "30b")
    # and against float64: GEMM 1's pre-activations and dw1 over the real rows
    used = int(plan.num_rows_used)
    slot = plan.row_slot[:used].long()
    expert = plan.tile_expert.repeat_interleave(plan.block_m)[:used].long()
    real = slot >= 0
    xr = x[torch.where(real, slot // K, 0)].double() * real[:, None]
    a1 = torch.zeros(used, H, dtype=torch.float64, device="cuda")
    dw1 = torch.zeros(E, H, D, dtype=torch.float64, device="cuda")
    for e in expert.unique().tolist():
        m = expert == e
        a1[m] = xr[m] @ w1[e].double().T
        dw1[e] = da[:used][m, :H].double().T @ xr[m]
    assert rel_err(got["a"][:, :H], a1) <= 1e-2
    assert rel_err(got["dw1"], dw1) <= 1e-2
