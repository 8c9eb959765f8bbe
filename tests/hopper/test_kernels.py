"""Each forward kernel alone, under TRITON_INTERPRET=1 on CPU (or compiled on a GPU), against
float64 PyTorch math; outputs are poisoned with NaN first so unwritten elements fail."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from moe_testing import make_weights, rel_err, routings
from torchtitan_megamoe.ops.hopper.kernels import combine as combine_mod
from torchtitan_megamoe.ops.hopper.sides import gemm1_swiglu as g1
from torchtitan_megamoe.ops.hopper.sides import gemm2 as g2
from torchtitan_megamoe.ops.hopper.configs import TritonGemm
from torchtitan_megamoe.ops.hopper.plan import build_plan

CFG = TritonGemm(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)
# the bulk-tensor-copy (TMA descriptor) path, and a block_m smaller than the plan's tile height
CFG_TMA = replace(CFG, block_m=8, use_tma=True)
# persistent grid: a few programs loop over the used tiles only
CFG_PERSIST = replace(CFG_TMA, persistent=True)
T, K, E, D, H, BM = 13, 2, 4, 32, 48, 16


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    # torch.empty in the launchers returns NaN-filled memory, so a row the kernel should have
    # written but did not shows up as NaN in the comparison.
    real = torch.empty

    def nan_empty(*a, **kw):
        t = real(*a, **kw)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    for mod in (g1, g2, combine_mod):
        monkeypatch.setattr(mod.torch, "empty", nan_empty)


@pytest.mark.parametrize("name,ids", list(routings(T, K, E)), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("cfg", [CFG, CFG_TMA, CFG_PERSIST], ids=["ptr", "tma", "persistent"])
def test_gemm1_swiglu(name, ids, cfg):
    w1, w2, w3 = make_weights(E, D, H)
    x = torch.randn(ids.shape[0], D).to(torch.bfloat16)
    plan = build_plan(ids, E, BM)
    h = g1.gemm1_swiglu(x, w1, w3, plan, config=cfg)
    exp_e = plan.tile_expert.repeat_interleave(BM).long()
    for r, s in enumerate(plan.row_slot.tolist()):
        if exp_e[r] < 0:
            continue  # tiles past the end are never written nor read
        if s < 0:
            assert torch.all(h[r] == 0), f"padding row {r} must be exactly 0"
            continue
        xr = x[s // K].double()
        e = int(exp_e[r])
        ref = F.silu(xr @ w1[e].double().T) * (xr @ w3[e].double().T)
        assert rel_err(h[r], ref) < 1e-2, (name, r)


@pytest.mark.parametrize("name,ids", list(routings(T, K, E)), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("cfg", [CFG, CFG_TMA, CFG_PERSIST], ids=["ptr", "tma", "persistent"])
def test_gemm1_saves_preactivations(name, ids, cfg):
    """save_a: a = [a1 | a3] per row (what the backward loads instead of recomputing GEMM 1),
    padding rows exactly 0; h is bitwise the h of the call without save_a."""
    w1, w2, w3 = make_weights(E, D, H, seed=3)
    x = torch.randn(ids.shape[0], D).to(torch.bfloat16)
    plan = build_plan(ids, E, BM)
    h, a = g1.gemm1_swiglu(x, w1, w3, plan, config=cfg, save_a=True)  # a poisoned (NaN) first
    assert a.shape == (plan.max_rows, 2 * H) and a.dtype == x.dtype
    used = int(plan.num_rows_used)
    assert torch.equal(h[:used], g1.gemm1_swiglu(x, w1, w3, plan, config=cfg)[:used])
    exp_e = plan.tile_expert.repeat_interleave(BM).long()
    for r, s in enumerate(plan.row_slot[:used].tolist()):
        if s < 0:
            assert torch.all(a[r] == 0), f"padding row {r} must be exactly 0"
            continue
        xr = x[s // K].double()
        e = int(exp_e[r])
        assert rel_err(a[r, :H], xr @ w1[e].double().T) < 1e-2, (name, r, "a1")
        assert rel_err(a[r, H:], xr @ w3[e].double().T) < 1e-2, (name, r, "a3")


def test_gemm1_tuner_picks_one_kernel_for_the_saving_and_plain_forward(monkeypatch):
    """The tuner's key for GEMM 1 must not tell save_a apart: two picks could land on kernels
    that round SwiGLU differently (Triton vs csrc/), and activation checkpointing recomputes a
    saving forward whose first run was a plain one; h must be bitwise the same (this broke on
    the GPU once the CUDA kernel became a candidate)."""
    keys = []

    def record(stage, key, problem, launch, outputs=None):
        keys.append(key)
        return CFG  # the interpreter's tiles (no GPU config divides these test sizes)

    monkeypatch.setattr(g1, "pick_config", record)
    w1, _, w3 = make_weights(E, D, H, seed=4)
    ids = next(iter(routings(T, K, E)))[1]
    x = torch.randn(ids.shape[0], D).to(torch.bfloat16)
    plan = build_plan(ids, E, BM)
    g1.gemm1_swiglu(x, w1, w3, plan, save_a=True)  # no config: the tuner is asked
    g1.gemm1_swiglu(x, w1, w3, plan)
    assert len(keys) == 2 and keys[0] == keys[1]


def test_gemm1_tuner_times_the_candidates_with_the_a_store(monkeypatch):
    """One pick serves the plain and the saving forward, and the a1/a3 store is what sets the
    candidates apart in training, so the tuner's launch stores [a1 | a3] (into a scratch
    tensor) even when the call that asks it stores none."""
    seen = []

    def tune(stage, key, problem, launch, outputs=None):
        seen.append(outputs(launch(CFG)))
        return CFG

    monkeypatch.setattr(g1, "pick_config", tune)
    w1, _, w3 = make_weights(E, D, H, seed=5)
    ids = next(iter(routings(T, K, E)))[1]
    x = torch.randn(ids.shape[0], D).to(torch.bfloat16)
    plan = build_plan(ids, E, BM)
    h = g1.gemm1_swiglu(x, w1, w3, plan)
    (h_tuned, a_tuned), = seen
    h_ref, a_ref = g1.gemm1_swiglu(x, w1, w3, plan, config=CFG, save_a=True)
    used = int(plan.num_rows_used)
    assert h_tuned is h and a_tuned.shape == (plan.max_rows, 2 * H)
    assert torch.equal(a_tuned[:used], a_ref[:used]) and torch.equal(h[:used], h_ref[:used])


@pytest.mark.parametrize("name,ids", list(routings(T, K, E)), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("cfg", [CFG, CFG_TMA, CFG_PERSIST, replace(CFG_PERSIST, tma_store=True)],
                         ids=["ptr", "tma", "persistent", "tma_store"])
def test_gemm2_rows(name, ids, cfg):
    w1, w2, w3 = make_weights(E, D, H)
    plan = build_plan(ids, E, BM)
    h = torch.randn(plan.max_rows, H).to(torch.bfloat16)
    h[plan.row_slot < 0] = 0  # padding rows of h are zeros (GEMM 1 stores them so)
    y = g2.gemm2(h, w2, plan, config=cfg)
    tile_e = plan.tile_expert.repeat_interleave(BM)
    used = int(plan.num_rows_used)
    for r in range(used):
        e = int(tile_e[r])
        ref = h[r].double() @ w2[e].double().T
        if int(plan.row_slot[r]) < 0:
            assert torch.all(y[r] == 0), (name, r)
        else:
            assert rel_err(y[r], ref) < 1e-2, (name, r)


def test_gemm2_phase_launches_write_only_their_tiles():
    """A launch with another phase's tiles masked (-1) leaves those rows untouched."""
    import dataclasses

    w1, w2, w3 = make_weights(E, D, H)
    ids = next(routings(T, K, E))[1]
    plan = build_plan(ids, E, BM)
    h = torch.randn(plan.max_rows, H).to(torch.bfloat16)
    first = torch.arange(plan.num_tiles) % 2 == 0
    half = dataclasses.replace(plan, tile_expert=torch.where(first, plan.tile_expert, -1))
    poison = torch.full((plan.max_rows, D), float("nan")).to(torch.bfloat16)
    y = g2.gemm2(h, w2, half, config=CFG_PERSIST, out=poison.clone())
    skipped = (~first).repeat_interleave(BM)
    assert y[skipped].isnan().all()
    done = first.repeat_interleave(BM) & (plan.tile_expert.repeat_interleave(BM) >= 0)
    assert not y[done].isnan().any()


def test_gemm2_fp32_output():
    w1, w2, w3 = make_weights(E, D, H)
    ids = next(routings(T, K, E))[1]
    plan = build_plan(ids, E, BM)
    h = torch.randn(plan.max_rows, H).to(torch.bfloat16)
    y = g2.gemm2(h, w2, plan, out_dtype=torch.float32, config=CFG)
    assert y.dtype == torch.float32
    r = int(plan.slot_row[0])
    ref = h[r].double() @ w2[int(ids[0, 0])].double().T
    assert rel_err(y[r], ref) < 1e-4


@pytest.mark.parametrize("name,ids", list(routings(T, 3, E)), ids=lambda v: v if isinstance(v, str) else "")
def test_combine(name, ids):
    Tn, Kn = ids.shape
    plan = build_plan(ids, E, BM)
    y = torch.randn(plan.max_rows, 40).to(torch.bfloat16)
    y[plan.row_slot < 0] = float("nan")  # never read: only the slots' rows are
    w = torch.rand(Tn, Kn)
    out = combine_mod.combine(y, w, plan.slot_row, torch.bfloat16, block_t=4, block_d=16)
    live = (plan.slot_row >= 0).view(Tn, Kn)
    y_slot = torch.nan_to_num(y.double())[plan.slot_row.clamp(min=0).long()].view(Tn, Kn, -1)
    ref = torch.einsum("tk,tkd->td", w.double() * live.double(), y_slot)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-2 if ref.norm() > 0 else torch.all(out == 0)


def test_combine_live_rows_only():
    """live = n (an EP peer region: the rows that go home): rows t < n as the whole call's,
    the others left as they were."""
    ids = next(iter(routings(T, 3, E)))[1]
    Tn, Kn = ids.shape
    plan = build_plan(ids, E, BM)
    y = torch.randn(plan.max_rows, 40).to(torch.bfloat16)
    w = torch.rand(Tn, Kn)
    whole = combine_mod.combine(y, w, plan.slot_row, torch.bfloat16, block_t=4, block_d=16)
    n = Tn // 2 + 1  # not a multiple of block_t
    out = torch.full_like(whole, -3.0)
    combine_mod.combine(y, w, plan.slot_row, torch.bfloat16, block_t=4, block_d=16, out=out,
                        live=torch.tensor([n], dtype=torch.int32))
    assert torch.equal(out[:n], whole[:n]) and (out[n:] == -3).all()


def test_host_tile_math_matches_triton():
    # the launchers size grids and blocks with tiling.cdiv / next_power_of_2 (plain ints,
    # cheaper on the host than Triton's constexpr functions): the same numbers as Triton's
    import triton

    from torchtitan_megamoe.ops.hopper.kernels.tiling import cdiv, next_power_of_2

    for n in list(range(-3, 300)) + [2**20 - 1, 2**20, 2**20 + 1, 131072 * 8 + 5]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 4, 16, 64, 512):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
