"""csrc/wgrad.cu's bf16 modes (the backward's dw2 and dw1|dw3 with the token rows
gathered inside the kernel) on an H200 (marked gpu; skipped without an sm_90 GPU and nvcc):
against float64 sums over each expert's rows on uneven routings (empty experts get zeros, a
single token, dropped slots), the outputs poisoned (NaN) first and the row-space operand's
padding rows random (they must add nothing), and equal to running every padding row (the
kernel skips the all-padding K steps after plan.count's real rows); the real Qwen3-30B shape
against the _grouped_mm side, bitwise reruns, and the backward with the sm90 weight gradients
forced against the reference backend."""

import pytest
import torch

from moe_testing import (SM90_GPU, forced_backward_matches_reference, nan_tensor, rel_err,
                         routings, skewed_ids)
from torchtitan_megamoe.ops.hopper.cuda.wgrad import (wgrad_dw13_regions_sm90, wgrad_dw13_sm90,
                                                      wgrad_dw2_sm90)
from torchtitan_megamoe.ops.hopper.kernels.grouped_mm import gather_rows, grouped_wgrad
from torchtitan_megamoe.ops.hopper.kernels.wgrad import longest_first
from torchtitan_megamoe.ops.hopper.plan import build_plan
from torchtitan_megamoe.ops.hopper.configs import Sm90

pytestmark = SM90_GPU
BM = 128



def _ref(tokens, rows, plan, E, gathered_first):
    """float64 [E, M, N]: sum over expert e's real rows r of (tokens[tok(r)]^T rows[r]) or
    (rows[r]^T tokens[tok(r)])."""
    used = int(plan.num_rows_used)
    slot = plan.row_slot[:used].long()
    expert = plan.tile_expert.repeat_interleave(plan.block_m)[:used].long()
    real = slot >= 0
    tok = slot[real] // plan.top_k
    t, r, e = tokens[tok].double(), rows[:used][real].double(), expert[real]
    a, b = (t, r) if gathered_first else (r, t)
    out = torch.zeros(E, a.shape[1], b.shape[1], dtype=torch.float64, device="cuda")
    for ex in e.unique().tolist():
        m = e == ex
        out[ex] = a[m].T @ b[m]
    return out



SHAPES = [(700, 4, 8, 256, 256), (333, 2, 5, 512, 256)]


def _cases(T, K, E, D, H, seed):
    """Per uneven routing: (name, plan, dy, x, hw, da, the float64 dw2 and [dw1 | dw3]); the
    row-space operands' padding rows are random too (they must add nothing)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    for name, ids in routings(T, K, E):
        plan = build_plan(ids.cuda(), E, BM)
        R, n = plan.max_rows, ids.shape[0]
        hw = torch.randn(R, H, device="cuda", generator=g).bfloat16()
        da = torch.randn(R, 2 * H, device="cuda", generator=g).bfloat16()
        yield (name, plan, dy[:n], x[:n], hw, da, _ref(dy[:n], hw, plan, E, True),
               _ref(x[:n], da, plan, E, False))


@pytest.mark.parametrize("pre", [False, True], ids=["gather_inside", "pre_gathered"])
@pytest.mark.parametrize("ordered", [True, False], ids=["longest_first", "natural"])
@pytest.mark.parametrize("T,K,E,D,H", SHAPES)
def test_vs_float64_on_uneven_routings(T, K, E, D, H, ordered, pre):
    for name, plan, dy, x, hw, da, ref2, ref13 in _cases(T, K, E, D, H, seed=0):
        order = longest_first(plan) if ordered else None
        dy_in, x_in = dy, x
        if pre:  # the token rows gathered into the row space first (zero padding rows)
            dy_in, x_in = gather_rows(dy_in, plan), gather_rows(x_in, plan)
        dw2 = wgrad_dw2_sm90(dy_in, hw, plan, nan_tensor(E, D, H), order, pre_gathered=pre)
        dw1, dw3 = wgrad_dw13_sm90(da, x_in, plan, nan_tensor(E, H, D), nan_tensor(E, H, D), order,
                                   pre_gathered=pre)
        torch.cuda.synchronize()
        empty = plan.count == 0
        for got, ref, what in ((dw2, ref2, "dw2"), (dw1, ref13[:, :H], "dw1"),
                               (dw3, ref13[:, H:], "dw3")):
            assert not got.isnan().any(), (name, what, "tiles left unwritten")
            assert torch.all(got[empty] == 0), (name, what, "an empty expert's gradient is 0")
            assert rel_err(got, ref) <= 1e-2, (name, what, rel_err(got, ref))
        # the K loop stops after the last step holding a real row (plan.count); running every
        # row of the padded segments instead only adds zeros: the same gradients
        full = type(plan)(**{**plan.__dict__, "count": plan.seg_start.diff().contiguous()})
        dw2_full = wgrad_dw2_sm90(dy_in, hw, full, nan_tensor(E, D, H), order, pre_gathered=pre)
        assert torch.equal(dw2_full, dw2), (name, "skipping padding steps changed dw2")
        dw1_full, dw3_full = wgrad_dw13_sm90(da, x_in, full, nan_tensor(E, H, D),
                                             nan_tensor(E, H, D), order, pre_gathered=pre)
        assert torch.equal(dw1_full, dw1) and torch.equal(dw3_full, dw3), name


@pytest.mark.parametrize("T,K,E,D,H", SHAPES)
def test_fp32_gradients_are_the_unrounded_accumulators(T, K, E, D, H):
    """fp32 outputs (the gradients of fp32 parameters): written straight from the accumulators,
    every element (NaN-poisoned first), empty experts 0, within fp32 summation error of float64,
    and rounded to bf16 bitwise the bf16 outputs of the same launch form."""
    for name, plan, dy, x, hw, da, ref2, ref13 in _cases(T, K, E, D, H, seed=1):
        order = longest_first(plan)
        dy_rows, x_rows = gather_rows(dy, plan), gather_rows(x, plan)
        f32 = dict(dtype=torch.float32)
        dw2 = wgrad_dw2_sm90(dy_rows, hw, plan, nan_tensor(E, D, H, **f32), order, True)
        dw1, dw3 = wgrad_dw13_sm90(da, x_rows, plan, nan_tensor(E, H, D, **f32),
                                   nan_tensor(E, H, D, **f32), order, pre_gathered=True)
        b2 = wgrad_dw2_sm90(dy_rows, hw, plan, nan_tensor(E, D, H), order, True)
        b1, b3 = wgrad_dw13_sm90(da, x_rows, plan, nan_tensor(E, H, D), nan_tensor(E, H, D),
                                 order, pre_gathered=True)
        empty = plan.count == 0
        for got, bf, ref, what in ((dw2, b2, ref2, "dw2"), (dw1, b1, ref13[:, :H], "dw1"),
                                   (dw3, b3, ref13[:, H:], "dw3")):
            assert got.dtype == torch.float32 and not got.isnan().any(), (name, what)
            assert torch.all(got[empty] == 0), (name, what)
            assert rel_err(got, ref) <= 1e-5, (name, what, rel_err(got, ref))
            assert torch.equal(got.bfloat16(), bf), (name, what, "not the bf16 outputs' values")


@pytest.mark.parametrize("T,K,E,D,H", SHAPES[:1])
def test_accumulate_adds_to_fp32_gradients_bitwise(T, K, E, D, H):
    """accumulate (the EP backward's sums over regions): out + the gradient from the epilogue,
    the bits of a fresh launch followed by an add pass; bf16 outputs refuse it."""
    for name, plan, dy, x, hw, da, _ref2, _ref13 in _cases(T, K, E, D, H, seed=2):
        order = longest_first(plan)
        dy_rows, x_rows = gather_rows(dy, plan), gather_rows(x, plan)
        f32 = dict(dtype=torch.float32, device=dy.device)
        before = [torch.randn(E, D, H, **f32), torch.randn(E, H, D, **f32),
                  torch.randn(E, H, D, **f32)]
        fresh2 = wgrad_dw2_sm90(dy_rows, hw, plan, torch.empty(E, D, H, **f32), order, True)
        fresh1, fresh3 = wgrad_dw13_sm90(da, x_rows, plan, torch.empty(E, H, D, **f32),
                                         torch.empty(E, H, D, **f32), order, pre_gathered=True)
        got2 = wgrad_dw2_sm90(dy_rows, hw, plan, before[0].clone(), order, True,
                              accumulate=True)
        got1, got3 = wgrad_dw13_sm90(da, x_rows, plan, before[1].clone(), before[2].clone(),
                                     order, pre_gathered=True, accumulate=True)
        for got, b, f, what in ((got2, before[0], fresh2, "dw2"), (got1, before[1], fresh1, "dw1"),
                                (got3, before[2], fresh3, "dw3")):
            assert torch.equal(got, b + f), (name, what)
        with pytest.raises(ValueError, match="fp32"):
            wgrad_dw2_sm90(dy_rows, hw, plan, nan_tensor(E, D, H), order, True, accumulate=True)


def test_regions_walk_several_plans_in_one_sum():
    """wgrad_dw13_regions_sm90 (the EP backward's dw1|dw3 over its kept regions): three plans'
    rows at offsets in one pair of stores (gaps of NaN rows between them that no step may
    read), one plan left out (counts 0) for some experts; against float64 sums over the plans'
    real rows, written whole (NaN-poisoned fp32 outputs) or added to, and the accumulate form
    leaves an expert without rows untouched (its units are skipped); x as rows of the row
    space, or as token rows the kernel gathers by a row_slot over the stores' rows (the plans'
    slots offset to their tokens in one x)."""
    T, K, E, D, H = 500, 4, 8, 256, 256
    g = torch.Generator(device="cuda").manual_seed(3)
    plans, xs = [], []
    for _name, ids in routings(T, K, E, seed=4):
        plans.append(build_plan(ids.cuda(), E, BM))
        xs.append(torch.randn(ids.shape[0], D, device="cuda", generator=g).bfloat16())
        if len(plans) == 3:
            break
    gap = BM  # rows between the plans' views
    starts, rows = [], 0
    for p in plans:
        starts.append(rows)
        rows += p.max_rows + gap
    da_store = torch.full((rows, 2 * H), float("nan"), device="cuda").bfloat16()
    x_store = torch.full((rows, D), float("nan"), device="cuda").bfloat16()
    ref = torch.zeros(E, 2 * H, D, dtype=torch.float64, device="cuda")
    use = torch.ones(3, E, dtype=torch.bool, device="cuda")
    use[1, ::2] = False  # plan 1 adds nothing to the even experts
    for i, (p, x) in enumerate(zip(plans, xs)):
        view = slice(starts[i], starts[i] + p.max_rows)
        da = torch.randn(p.max_rows, 2 * H, device="cuda", generator=g).bfloat16()
        da[p.row_slot < 0] = 0  # GEMM-written padding rows hold zeros
        da_store[view] = da
        x_store[view] = gather_rows(x, p)
        x_store[view][int(p.num_rows_used):] = float("nan")  # past the used rows: never read
        ref += _ref(x, da, p, E, False) * use[i][:, None, None]
    seg = torch.stack([p.seg_start + s for p, s in zip(plans, starts)]).int().contiguous()
    cnt = (torch.stack([p.count for p in plans]) * use).int().contiguous()
    cnt[:, 5] = 0  # expert 5: no rows in any plan
    ref[5] = 0
    f32 = dict(dtype=torch.float32)
    dw1, dw3 = wgrad_dw13_regions_sm90(da_store, x_store, plans[0], seg, cnt,
                                       nan_tensor(E, H, D, **f32), nan_tensor(E, H, D, **f32))
    for got, want in ((dw1, ref[:, :H]), (dw3, ref[:, H:])):
        assert not got.isnan().any() and torch.all(got[5] == 0)
        assert rel_err(got, want) <= 1e-5, rel_err(got, want)
    before = torch.randn(E, H, D, device="cuda", **f32)
    acc1, acc3 = wgrad_dw13_regions_sm90(da_store, x_store, plans[0], seg, cnt, before.clone(),
                                         before.clone(), accumulate=True)
    assert torch.equal(acc1[5], before[5]) and torch.equal(acc3[5], before[5])
    assert torch.equal(acc1, before + dw1) and torch.equal(acc3, before + dw3)
    with pytest.raises(ValueError, match="seg_start"):
        wgrad_dw13_regions_sm90(da_store, x_store, plans[0], seg[:, :-1].contiguous(), cnt,
                                dw1, dw3)
    # x gathered inside: one x of all plans' tokens, each plan's slots offset to its tokens
    x_all = torch.cat(xs)
    row_slot = torch.full((rows,), -1, dtype=torch.int32, device="cuda")
    first_token = 0
    for p, x, start in zip(plans, xs, starts):
        rs = p.row_slot
        row_slot[start:start + p.max_rows] = torch.where(rs >= 0, rs + first_token * K, -1)
        first_token += x.shape[0]
    g1, g3 = wgrad_dw13_regions_sm90(da_store, x_all, plans[0], seg, cnt,
                                     nan_tensor(E, H, D, **f32), nan_tensor(E, H, D, **f32),
                                     row_slot=row_slot)
    for got, want in ((g1, ref[:, :H]), (g3, ref[:, H:])):
        assert not got.isnan().any() and torch.all(got[5] == 0)
        assert rel_err(got, want) <= 1e-5, rel_err(got, want)
    with pytest.raises(ValueError, match="row_slot"):
        wgrad_dw13_regions_sm90(da_store, x_all, plans[0], seg, cnt, g1, g3,
                                row_slot=row_slot[:-1])


def test_bad_shapes_name_the_requirement():
    ids = torch.randint(0, 4, (64, 2), device="cuda")
    plan = build_plan(ids, 4, BM)
    dy = torch.randn(64, 256, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="columns % 256"):
        wgrad_dw2_sm90(dy, nan_tensor(plan.max_rows, 192), plan, nan_tensor(4, 256, 192))
    with pytest.raises(TypeError, match="must all be bfloat16 or all float32"):
        wgrad_dw2_sm90(dy, nan_tensor(plan.max_rows, 256), plan,
                       torch.empty(4, 256, 256, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="3 experts|the plan has 4 experts"):
        wgrad_dw2_sm90(dy, nan_tensor(plan.max_rows, 256), plan, nan_tensor(3, 256, 256))


def test_real_30b_shape_matches_grouped_mm_and_reruns_bitwise():
    T, K, E, D, H = 16384, 8, 128, 2048, 768
    torch.manual_seed(0)
    ids = skewed_ids(T, K, E, never=7)  # one expert never chosen
    plan = build_plan(ids, E, BM)
    dy = torch.randn(T, D, device="cuda").bfloat16()
    x = torch.randn(T, D, device="cuda").bfloat16()
    hw = torch.randn(plan.max_rows, H, device="cuda").bfloat16()
    da = torch.randn(plan.max_rows, 2 * H, device="cuda").bfloat16()
    order = longest_first(plan)
    dw2 = wgrad_dw2_sm90(dy, hw, plan, nan_tensor(E, D, H), order)
    dw1, dw3 = wgrad_dw13_sm90(da, x, plan, nan_tensor(E, H, D), nan_tensor(E, H, D), order)
    # the _grouped_mm side needs zero padding rows in both operands: zero them in hw / da
    pad = plan.row_slot < 0
    hw[pad] = 0
    da[pad] = 0
    ref2 = grouped_wgrad(gather_rows(dy, plan), hw, plan, dw2)
    x_rows = gather_rows(x, plan)
    ref1 = grouped_wgrad(da[:, :H], x_rows, plan, dw1)
    ref3 = grouped_wgrad(da[:, H:], x_rows, plan, dw3)
    for got, ref in ((dw2, ref2), (dw1, ref1), (dw3, ref3)):
        assert not got.isnan().any()
        assert rel_err(got, ref.double()) < 1e-2
    assert torch.all(dw2[7] == 0) and torch.all(dw1[7] == 0)
    hw2, da2 = torch.randn_like(hw), torch.randn_like(da)  # other padding values: same result
    hw2[~pad], da2[~pad] = hw[~pad], da[~pad]
    assert torch.equal(wgrad_dw2_sm90(dy, hw2, plan, nan_tensor(E, D, H), order), dw2)
    again = wgrad_dw13_sm90(da2, x, plan, nan_tensor(E, H, D), nan_tensor(E, H, D), order)
    assert torch.equal(again[0], dw1) and torch.equal(again[1], dw3), "reruns must be bitwise"


def test_backward_with_the_sm90_weight_gradients_matches_the_reference(monkeypatch):
    variant = Sm90()  # the tuner's sm90 candidate (rows gathered first)
    got = forced_backward_matches_reference(
        monkeypatch, {"wgrad_dw2": variant, "wgrad_dw13": variant}, seed=7, saved=False)
    assert torch.all(got[2][3] == 0) and torch.all(got[3][3] == 0)  # the empty expert
