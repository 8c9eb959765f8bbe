"""The FP8 modes of csrc/'s kernel families on an H200 (marked gpu; skipped without an sm_90 GPU
and nvcc): gemm1_swiglu (h quantized per row and 128 columns in the epilogue, a = [a1 | a3]
saved; token rows gathered inside or first), gemm_rows (gemm2, dgrad1), dgrad2_swiglu (dgrad of
linear 2 + the SwiGLU backward: five quantized outputs, or the rows form's da, hw and da in
e4m3) and the weight gradients against float64 math on the same
quantized operands, on uneven routings (dropped slots, an empty expert, one expert holding
every row, one token), token counts that are not tile multiples, outputs poisoned first (rows
past the used ones must stay untouched), and against the Triton FP8 kernels of the same
contract; two identical calls are bitwise equal."""

import pytest
import torch

from moe_testing import SM90_GPU, nan_tensor, rel_err, routing
from torchtitan_megamoe.ops.hopper import heuristics
from torchtitan_megamoe.ops.hopper.cuda.dgrad2_swiglu import (fp8_dgrad2_swiglu_rows_sm90,
                                                              fp8_dgrad2_swiglu_sm90)
from torchtitan_megamoe.ops.hopper.cuda.gemm1_swiglu import fp8_gemm1_swiglu_sm90
from torchtitan_megamoe.ops.hopper.cuda.gemm_rows import fp8_gemm_rows_sm90
from torchtitan_megamoe.ops.hopper.cuda.wgrad import fp8_wgrad_sm90
from torchtitan_megamoe.ops.hopper.fp8_weights import forward_weights, w2_transposed
from torchtitan_megamoe.ops.hopper.sides import fp8_gemm as fg
from torchtitan_megamoe.ops.hopper.sides import fp8_wgrad as fw
from torchtitan_megamoe.ops.hopper.kernels.wgrad import longest_first
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import (FP8, gather_rows, quant_rows,
                                                          quant_rows_t, quant_weight,
                                                          weight_blocks)
from torchtitan_megamoe.ops.hopper.plan import build_plan
from torchtitan_megamoe.ops.hopper.configs import Sm90

pytestmark = SM90_GPU
ROUTINGS = ("random", "uneven", "empty_experts", "one_expert", "t1")


def _deq_rows(q, s):
    """fp64 values of per-row 1x128-scaled e4m3 q [N, K] with scales s [N, K/128]."""
    return q.double() * s.double().repeat_interleave(128, dim=1)


def _deq_weight(q, s):
    return q.double() * s.double().repeat_interleave(128, 1).repeat_interleave(128, 2)


def _setup(T, K, E, D, H, name, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w1, w2, w3 = (torch.randn(E, *shape, device="cuda", generator=g).div(shape[1] ** 0.5)
                  .bfloat16() for shape in ((H, D), (D, H), (H, D)))
    ids = routing(name, T, K, E, seed).cuda()
    plan = build_plan(ids, E, 128)
    xq, xs = quant_rows(x)
    return plan, xq, xs, forward_weights(w1, w2, w3)


def _used(plan):
    used = int(plan.num_rows_used)
    slot = plan.row_slot[:used].long()
    expert = plan.tile_expert.repeat_interleave(plan.block_m)[:used].long()
    return used, slot, expert


def _gemm1(plan, xq, xs, wq, save_a=True, x_rows=False):
    R, H = plan.max_rows, wq.w1q.shape[1]
    hq = torch.full((R, H), float("nan"), device="cuda").to(FP8)
    hs = nan_tensor(R, H // 128, dtype=torch.float32)
    a = nan_tensor(R, 2 * H) if save_a else None
    if x_rows:  # the rows gathered first, read by TMA
        xq, xs = gather_rows(xq, xs, plan)
    fp8_gemm1_swiglu_sm90(xq, xs, wq.w1q, wq.w1s, wq.w3q, wq.w3s, plan, hq, hs, a,
                          x_rows=x_rows)
    torch.cuda.synchronize()
    return hq, hs, a


@pytest.mark.parametrize("x_rows", [False, True], ids=["gathered_inside", "rows_first"])
@pytest.mark.parametrize("name", ROUTINGS)
@pytest.mark.parametrize("T,K,E,D,H", [(700, 4, 8, 256, 384), (333, 2, 5, 640, 128)],
                         ids=["d256_h384", "d640_h128"])
def test_gemm1_swiglu_vs_float64(T, K, E, D, H, name, x_rows):
    plan, xq, xs, wq = _setup(T, K, E, D, H, name)
    hq, hs, a = _gemm1(plan, xq, xs, wq, x_rows=x_rows)
    used, slot, expert = _used(plan)
    xd = _deq_rows(xq, xs)
    w1d, w3d = _deq_weight(wq.w1q, wq.w1s), _deq_weight(wq.w3q, wq.w3s)
    a1 = torch.zeros(used, H, dtype=torch.float64, device="cuda")
    a3 = torch.zeros_like(a1)
    live = slot >= 0
    for e in expert[live].unique().tolist():
        m = live & (expert == e)
        rows = xd[slot[m] // plan.top_k]
        a1[m], a3[m] = rows @ w1d[e].T, rows @ w3d[e].T
    h = a1 * torch.sigmoid(a1) * a3
    got_h = _deq_rows(hq[:used], hs[:used])
    assert torch.isfinite(got_h).all() and torch.isfinite(a[:used].float()).all(), "unwritten rows"
    assert rel_err(a[:used, :H], a1) < 1e-2 and rel_err(a[:used, H:], a3) < 1e-2
    # h is e4m3 (3 mantissa bits): ~2-3% from exact; a wrong scale or row is far off
    assert rel_err(got_h, h) < 4e-2, rel_err(got_h, h)
    assert torch.all(hq[:used][~live].float() == 0), "padding rows must be exactly 0"
    # per-row scales: amax / 448 of each row's 128-column block of h
    amax = h.abs().reshape(used, H // 128, 128).amax(-1).clamp_min(1e-12)
    assert rel_err(hs[:used][live], (amax / 448)[live]) < 1e-2
    assert torch.isnan(a[used:].float()).all(), "wrote rows past the used ones"
    # again, and the other way of reading the rows: the same bits (same products, same order)
    for again in (_gemm1(plan, xq, xs, wq, x_rows=x_rows), _gemm1(plan, xq, xs, wq,
                                                                 x_rows=not x_rows)):
        assert all(torch.equal(u.view(torch.uint8) if u.dtype == FP8 else u,
                               v.view(torch.uint8) if v.dtype == FP8 else v)
                   for u, v in zip((hq[:used], hs[:used], a[:used]), (t[:used] for t in again)))
    hq2, hs2, _ = _gemm1(plan, xq, xs, wq, save_a=False, x_rows=x_rows)  # the inference form
    assert torch.equal(hq2[:used].view(torch.uint8), hq[:used].view(torch.uint8))


def _row_operands(plan, E, N, KD, seed):
    """A row GEMM's operands: random row-space rows [R, KD] (zero on padding rows) per row
    quantized, and random weights [E, N, KD] in 128 x 128 blocks."""
    used, slot, _ = _used(plan)
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.randn(plan.max_rows, KD, device="cuda", generator=g)
    rows[:used][slot < 0] = 0
    aq, a_s = quant_rows(rows)
    w = torch.randn(E, N, KD, device="cuda", generator=g).div(KD ** 0.5).bfloat16()
    bq, b_s = weight_blocks(E, N, KD, "cuda")
    quant_weight(w, q=bq, s=b_s)
    return aq, a_s, bq, b_s


@pytest.mark.parametrize("name", ROUTINGS)
@pytest.mark.parametrize("T,K,E,N,KD", [(700, 4, 8, 256, 384), (333, 2, 5, 640, 1152)],
                         ids=["k3", "k9"])
def test_rows_vs_float64(T, K, E, N, KD, name):
    plan, *_ = _setup(T, K, E, 128, 128, name)
    used, slot, expert = _used(plan)
    aq, a_s, bq, b_s = _row_operands(plan, E, N, KD, seed=1)
    out = nan_tensor(plan.max_rows, N)
    fp8_gemm_rows_sm90(aq, a_s, bq, b_s, plan, out)
    torch.cuda.synchronize()
    ad, bd = _deq_rows(aq, a_s), _deq_weight(bq, b_s)
    ref = torch.zeros(used, N, dtype=torch.float64, device="cuda")
    for e in expert.unique().tolist():
        m = expert == e
        ref[m] = ad[:used][m] @ bd[e].T
    assert not torch.isnan(out[:used]).any(), "used rows left unwritten"
    assert rel_err(out[:used], ref) < 1e-2, rel_err(out[:used], ref)
    assert torch.all(out[:used][slot < 0] == 0), "padding rows must be exactly 0"
    assert torch.isnan(out[used:]).all(), "wrote rows past the used ones"


@pytest.mark.parametrize("name", ("random", "uneven", "one_expert"))
def test_rows_by_expert_groups(name):
    """The backward's dgrad of linear 1 split by experts (B holding one group's experts): each
    launch writes its group's rows only, and the groups together equal the one launch."""
    T, K, E, N, KD = 700, 4, 8, 256, 384
    plan, *_ = _setup(T, K, E, 128, 128, name)
    used, slot, expert = _used(plan)
    aq, a_s, bq, b_s = _row_operands(plan, E, N, KD, seed=2)
    whole = nan_tensor(plan.max_rows, N)
    fp8_gemm_rows_sm90(aq, a_s, bq, b_s, plan, whole)
    split = nan_tensor(plan.max_rows, N)
    for lo, hi in ((0, 3), (3, 4), (4, 8)):
        fp8_gemm_rows_sm90(aq, a_s, bq[lo:hi], b_s[lo:hi], plan, split, expert_base=lo)
        torch.cuda.synchronize()
        done = expert < hi
        assert torch.equal(split[:used][done], whole[:used][done]), (lo, hi)
        assert torch.isnan(split[:used][~done]).all(), f"group {lo}:{hi} wrote other rows"
    with pytest.raises(ValueError, match="not within"):
        fp8_gemm_rows_sm90(aq, a_s, bq[:3], b_s[:3], plan, split, expert_base=6)


def _dgrad2_swiglu_setup(T, K, E, D, H, name, seed=0):
    """dy, w2 (quantized as kernel A reads them), a saved a (zero on padding rows, as GEMM 1
    leaves it) and routing weights."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w2 = torch.randn(E, D, H, device="cuda", generator=g).div(H ** 0.5).bfloat16()
    plan = build_plan(routing(name, T, K, E, seed).cuda(), E, 128)
    used, slot, _ = _used(plan)
    a = (2 * torch.randn(plan.max_rows, 2 * H, device="cuda", generator=g)).bfloat16()
    a[:used][slot < 0] = 0
    tw = torch.rand(T * K, device="cuda", generator=g)
    gq, gs = quant_rows(dy)
    return plan, gq, gs, w2_transposed(w2), a, tw


def _kernel_a(plan, gq, gs, w2t, a, tw):
    R, H = plan.max_rows, w2t.q.shape[1]
    fp8_nan = lambda *shape: torch.full(shape, float("nan"), device="cuda").to(FP8)  # noqa: E731
    out = dict(daq=fp8_nan(R, 2 * H), das=nan_tensor(R, 2 * H // 128, dtype=torch.float32),
               daTq=fp8_nan(2 * H, R), daTs=nan_tensor(2 * H, R // 128, dtype=torch.float32),
               hTq=fp8_nan(H, R), hTs=nan_tensor(H, R // 128, dtype=torch.float32),
               part=nan_tensor(H // 128, R, dtype=torch.float32))
    fp8_dgrad2_swiglu_sm90(gq, gs, w2t.q, w2t.s, a, tw, plan, **out)
    torch.cuda.synchronize()
    return out


def _dgrad2_swiglu_f64(plan, gq, gs, w2t, a, tw):
    """(dhg, h, da1, da3) over the used rows, float64, on the quantized dy and w2^T."""
    used, slot, expert = _used(plan)
    H = w2t.q.shape[1]
    gd, wd = _deq_rows(gq, gs), _deq_weight(w2t.q, w2t.s)
    live = slot >= 0
    dhg = torch.zeros(used, H, dtype=torch.float64, device="cuda")
    for e in expert[live].unique().tolist():
        m = live & (expert == e)
        dhg[m] = gd[slot[m] // plan.top_k] @ wd[e].T
    a1, a3 = a[:used, :H].double(), a[:used, H:].double()
    sig = torch.sigmoid(a1)
    h = a1 * sig * a3 * live[:, None]
    dh = dhg * (tw.double()[slot.clamp_min(0)] * live)[:, None]
    return dhg, h, dh * a3 * sig * (1 + a1 * (1 - sig)), dh * a1 * sig


def _deq_cols(q, s, used):
    """fp64 values of the used columns of q [C, R] e4m3 scaled per 128 of them by s [C, R/128]."""
    return (q.double() * s.double().repeat_interleave(128, dim=1))[:, :used]


def _kernel_a_case(T, K, E, D, H, name, kernel):
    """(o, operands, used, live, dhg, h, da): ``kernel``'s outputs on a routing and the float64
    values of the same rows."""
    plan, gq, gs, w2t, a, tw = _dgrad2_swiglu_setup(T, K, E, D, H, name)
    o = kernel(plan, gq, gs, w2t, a, tw)
    used, slot, _ = _used(plan)
    dhg, h, da1, da3 = _dgrad2_swiglu_f64(plan, gq, gs, w2t, a, tw)
    return o, (plan, gq, gs, w2t, a, tw), used, slot >= 0, dhg, h, torch.cat([da1, da3], 1)


def _check_daq_and_part(o, used, live, dhg, h, da):
    """Both kernel A forms: da in e4m3 per row (values, scales, zero padding rows, nothing past
    the used rows) and the d(topk_weights) partials."""
    got_da = _deq_rows(o["daq"][:used], o["das"][:used])
    assert torch.isfinite(got_da).all(), "used rows left unwritten"
    # e4m3 holds 3 mantissa bits: ~2-3% from exact; a wrong scale, row or column is far off
    assert rel_err(got_da, da) < 4e-2, rel_err(got_da, da)
    assert torch.all(o["daq"][:used][~live].float() == 0), "padding rows must be exactly 0"
    amax = da.abs().reshape(used, da.shape[1] // 128, 128).amax(-1).clamp_min(1e-12)
    assert rel_err(o["das"][:used][live], (amax / 448)[live]) < 1e-2
    part = o["part"][:, :used].sum(0)
    assert rel_err(part, (dhg * h).sum(1)) < 1e-2, rel_err(part, (dhg * h).sum(1))


KERNEL_A_CASES = pytest.mark.parametrize(
    "T,K,E,D,H", [(700, 4, 8, 384, 256), (333, 2, 5, 1152, 128)], ids=["d384_h256", "d1152_h128"])


@pytest.mark.parametrize("name", ROUTINGS)
@KERNEL_A_CASES
def test_dgrad2_swiglu_vs_float64(T, K, E, D, H, name):
    o, ops, used, live, dhg, h, da = _kernel_a_case(T, K, E, D, H, name, _kernel_a)
    plan, gq, gs, w2t, a, tw = ops
    _check_daq_and_part(o, used, live, dhg, h, da)
    assert torch.isnan(o["daq"][used:].float()).all(), "wrote rows past the used ones"
    for key, ref in (("daTq", da.T), ("hTq", h.T)):
        q, sc = o[key], o[key[:-1] + "s"]
        got = _deq_cols(q, sc, used)
        assert torch.isfinite(got).all(), f"{key}: used columns left unwritten"
        assert rel_err(got, ref) < 4e-2, (key, rel_err(got, ref))
        col_amax = ref.abs().reshape(ref.shape[0], used // 128, 128).amax(-1).clamp_min(1e-12)
        assert rel_err(sc[:, : used // 128], col_amax / 448) < 1e-2, key
        assert torch.isnan(q[:, used:].float()).all(), f"{key}: wrote columns past the used ones"
    again = _kernel_a(plan, gq, gs, w2t, a, tw)
    written = dict(daq=(slice(0, used),), das=(slice(0, used),), part=(slice(None), slice(0, used)),
                   daTq=(slice(None), slice(0, used)), hTq=(slice(None), slice(0, used)),
                   daTs=(slice(None), slice(0, used // 128)),
                   hTs=(slice(None), slice(0, used // 128)))
    for key, index in written.items():
        u, v = o[key][index], again[key][index]
        if u.dtype == FP8:
            u, v = u.view(torch.uint8), v.view(torch.uint8)
        assert torch.equal(u, v), f"{key}: two identical calls differ"


def _kernel_a_rows(plan, gq, gs, w2t, a, tw, in_place=False):
    """The rows form on outputs poisoned with NaN; ``in_place``: da written over a copy of a."""
    R, H = plan.max_rows, w2t.q.shape[1]
    a_saved = a.clone()
    da = a_saved if in_place else nan_tensor(R, 2 * H)
    out = (da, nan_tensor(R, H), nan_tensor(H // 128, R, dtype=torch.float32))
    da, hw, part, daq, das = fp8_dgrad2_swiglu_rows_sm90(gq, gs, w2t.q, w2t.s, a_saved, tw,
                                                         plan, out=out)
    torch.cuda.synchronize()
    return dict(da=da, hw=hw, part=part, daq=daq, das=das)


@pytest.mark.parametrize("name", ROUTINGS)
@KERNEL_A_CASES
def test_dgrad2_swiglu_rows_vs_float64(T, K, E, D, H, name):
    o, ops, used, live, dhg, h, da = _kernel_a_case(T, K, E, D, H, name, _kernel_a_rows)
    plan, gq, gs, w2t, a, tw = ops
    slot = plan.row_slot[:used].long()
    w = (tw.double()[slot.clamp_min(0)] * live)[:, None]
    for key, ref in (("da", da), ("hw", w * h)):
        got = o[key][:used].double()
        assert torch.isfinite(got).all(), f"{key}: used rows left unwritten"
        # bf16 rounding of fp32 math: ~4e-3; a wrong row, column or weight is far off
        assert rel_err(got, ref) < 1e-2, (key, rel_err(got, ref))
        assert torch.all(got[~live] == 0), f"{key}: padding rows must be exactly 0"
        assert torch.isnan(o[key][used:].float()).all(), f"{key}: wrote rows past the used ones"
    _check_daq_and_part(o, used, live, dhg, h, da)
    assert torch.isnan(o["part"][:, used:]).all(), "part: wrote rows past the used ones"
    again = _kernel_a_rows(plan, gq, gs, w2t, a, tw, in_place=True)
    for key, u in o.items():
        v = again[key]
        u, v = (u[:, :used], v[:, :used]) if key == "part" else (u[:used], v[:used])
        if u.dtype == FP8:
            u, v = u.view(torch.uint8), v.view(torch.uint8)
        assert torch.equal(u, v), f"{key}: da over a, or a second call, differs"


def _wgrad_operands(plan, M, N, seed=5):
    """A^T [M, R], B^T [N, R] quantized per column and 128 rows from random row-space rows
    (zero on padding rows, as the backward's operands are)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    used, slot, _ = _used(plan)
    src = [torch.randn(plan.max_rows, C, device="cuda", generator=g).bfloat16() for C in (M, N)]
    for t in src:
        t[:used][slot < 0] = 0
    (aq, a_s), (bq, b_s) = (quant_rows_t(t, plan, gather=False) for t in src)
    return aq, a_s, bq, b_s


@pytest.mark.parametrize("name", ROUTINGS)
@pytest.mark.parametrize("E,M,N", [(8, 256, 384), (5, 640, 128)], ids=["m256_n384", "m640_n128"])
def test_wgrad_vs_float64(E, M, N, name):
    plan, *_ = _setup(700, 4 if E == 8 else 2, E, 128, 128, name)
    used, slot, expert = _used(plan)
    aq, a_s, bq, b_s = _wgrad_operands(plan, M, N)
    out = nan_tensor(E, M, N)
    order = longest_first(plan)
    fp8_wgrad_sm90(aq, a_s, bq, b_s, plan, out, order)
    torch.cuda.synchronize()
    ad, bd = (_deq_cols(q, sc, used) for q, sc in ((aq, a_s), (bq, b_s)))
    ref = torch.zeros(E, M, N, dtype=torch.float64, device="cuda")
    for e in range(E):
        m = expert == e
        ref[e] = ad[:, m] @ bd[:, m].T
    assert not torch.isnan(out).any(), "unwritten gradient blocks"
    assert rel_err(out, ref) < 1e-2, rel_err(out, ref)
    for e in range(E):
        if int(plan.count[e]) == 0:
            assert torch.all(out[e] == 0), f"expert {e} has no rows: its gradient must be 0"
    again = nan_tensor(E, M, N)
    fp8_wgrad_sm90(aq, a_s, bq, b_s, plan, again, order)
    assert torch.equal(out, again), "two identical calls differ"


def test_qwen3_30b_shape_matches_triton():
    """The 30B-A3B layer shape (E 128, D 2048, H 768, top-8, 4096 tokens): both CUDA kernels
    against the Triton FP8 kernels of the same contract."""
    T, K, E, D, H = 4096, 8, 128, 2048, 768
    plan, xq, xs, wq = _setup(T, K, E, D, H, "random", seed=3)
    used = int(plan.num_rows_used)
    tri = heuristics.FP8_GEMM1_SWIGLU_CONFIGS[0]
    hq_t, hs_t, a_t = fg.fp8_gemm1_swiglu(xq, xs, wq.w1q, wq.w1s, wq.w3q, wq.w3s, plan,
                                           save_a=True, config=tri)
    hq_c, hs_c, a_c = fg.fp8_gemm1_swiglu(xq, xs, wq.w1q, wq.w1s, wq.w3q, wq.w3s, plan,
                                           save_a=True, config=Sm90())
    # the tuner's other sm90 candidate (rows gathered first): the same bits
    first = fg.fp8_gemm1_swiglu(xq, xs, wq.w1q, wq.w1s, wq.w3q, wq.w3s, plan, save_a=True,
                                config=Sm90(gather_first=True))
    assert all(torch.equal(u[:used].view(torch.uint8), v[:used].view(torch.uint8))
               for u, v in zip((hq_c, hs_c, a_c), first))
    assert rel_err(a_c[:used], a_t[:used]) < 1e-3
    assert rel_err(_deq_rows(hq_c[:used], hs_c[:used]), _deq_rows(hq_t[:used], hs_t[:used])) < 1e-2
    y_t = fg.fp8_gemm_rows(hq_c, hs_c, wq.w2q, wq.w2s, plan, torch.bfloat16,
                           config=heuristics.FP8_GEMM_ROWS_CONFIGS[0])
    y_c = fg.fp8_gemm_rows(hq_c, hs_c, wq.w2q, wq.w2s, plan, torch.bfloat16,
                           config=Sm90())
    assert rel_err(y_c[:used], y_t[:used]) < 1e-3, rel_err(y_c[:used], y_t[:used])
    # kernel A on the same plan: every output against the Triton kernel's
    g = torch.Generator(device="cuda").manual_seed(4)
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    gq, gs = quant_rows(dy)
    w2t = w2_transposed(torch.randn(E, D, H, device="cuda", generator=g).div(H ** 0.5).bfloat16())
    tw = torch.rand(T * K, device="cuda", generator=g)
    outs = [fg.fp8_dgrad2_swiglu(gq, gs, w2t.q, w2t.s, a_c, tw, plan, config=cfg)
            for cfg in (heuristics.FP8_DGRAD2_SWIGLU_CONFIGS[0], Sm90())]
    (daq_t, das_t, daTq_t, daTs_t, hTq_t, hTs_t, part_t), (daq_c, das_c, daTq_c, daTs_c, hTq_c,
                                                            hTs_c, part_c) = outs
    assert rel_err(_deq_rows(daq_c[:used], das_c[:used]), _deq_rows(daq_t[:used], das_t[:used])) < 1e-2
    for (q_c, s_c), (q_t, s_t) in (((daTq_c, daTs_c), (daTq_t, daTs_t)),
                                   ((hTq_c, hTs_c), (hTq_t, hTs_t))):
        assert rel_err(_deq_cols(q_c, s_c, used), _deq_cols(q_t, s_t, used)) < 1e-2
    assert rel_err(part_c[:, :used], part_t[:, :used]) < 1e-3
    # the weight gradients dw2 (dy^T against h^T) of the same plan against the Triton kernel's
    dyTq, dyTs = quant_rows_t(dy, plan, gather=True, row_weight=tw)
    dw = [fw.fp8_wgrad(dyTq, dyTs, hTq_c, hTs_c, plan, nan_tensor(E, D, H), config=cfg)
          for cfg in (heuristics.FP8_WGRAD_CONFIGS[0], Sm90())]
    assert rel_err(dw[1], dw[0]) < 1e-3, rel_err(dw[1], dw[0])


def test_rejects_bad_operands():
    plan, xq, xs, wq = _setup(64, 2, 4, 256, 128, "random")
    R = plan.max_rows
    out = nan_tensor(R, 256)
    with pytest.raises(ValueError, match="e4m3"):
        fp8_gemm_rows_sm90(torch.zeros(R, 128, device="cuda").bfloat16(), xs[:R], wq.w2q, wq.w2s,
                      plan, out)
    with pytest.raises(ValueError, match="N % 128"):
        fp8_gemm_rows_sm90(torch.zeros(R, 128, device="cuda").to(FP8),
                      torch.ones(R, 1, device="cuda"), wq.w2q[:, :200], wq.w2s, plan,
                      nan_tensor(R, 200))
