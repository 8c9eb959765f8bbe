"""What each stage table offers the tuner (heuristics.py's Triton lists, sides/): the lists at
the Qwen3 shapes, the fallback configs only where the shape needs them, fit checks that reject
shapes the tiles do not divide, the sides MEGAMOE_BWD_IMPL allows, and typed configs. Plain
shapes and availability, no GPU."""

import pytest
import torch

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper import heuristics as hx
from torchtitan_megamoe.ops.hopper import tiles
from torchtitan_megamoe.ops.hopper.sides import dgrad1, dgrad2_swiglu, fp8_gemm, fp8_wgrad
from torchtitan_megamoe.ops.hopper.sides import gemm1_swiglu, gemm2, wgrad
from torchtitan_megamoe.ops.hopper.sides.backward import Shape as Bwd
from torchtitan_megamoe.ops.hopper.sides.backward import cublas_offer
from torchtitan_megamoe.ops.hopper.configs import Cublas, Sm90, TritonGemm
from torchtitan_megamoe.ops.hopper.sides.table import Available
from torchtitan_megamoe.ops.shapes import hopper_multiple

QWEN3 = {"30b": (2048, 768), "235b": (4096, 1536)}  # (D, H)
NONE = Available()  # Triton alone
GPU = Available(cublas=True)  # grouped_mm, no csrc/ build, no DeepGEMM


@pytest.fixture
def gpu_lists(monkeypatch):
    """The GPU's lists (the interpreter swaps in its small tiles), tuner side auto."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(settings.BWD_IMPL, raising=False)


def _cands(stage, shape, avail=GPU):
    return list(stage.offer(shape, avail).candidates)


def test_typed_configs():
    lists = [hx.GEMM1_SWIGLU_CONFIGS, hx.GEMM2_CONFIGS, hx.DGRAD2_SWIGLU_CONFIGS,
             hx.WGRAD_CONFIGS, hx.DGRAD1_CONFIGS, hx.FP8_WGRAD_CONFIGS, *hx.FP8_CONFIGS.values()]
    singles = [hx.DGRAD2_SWIGLU_UNEVEN, hx.DGRAD1_UNEVEN, hx.FP8_INTERPRET, hx.INTERPRET_GEMM,
               hx.INTERPRET_GEMM_WIDE,
               hx.INTERPRET_DGRAD2_SWIGLU, hx.INTERPRET_WGRAD, hx.INTERPRET_DGRAD1]
    for cfg in [c for cands in lists for c in cands] + singles:
        assert isinstance(cfg, TritonGemm) and cfg.side == "triton"
    assert hx.GEMM1_SWIGLU_CONFIGS[1].kwargs() == dict(
        block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
    assert Sm90().as_dict() == {"impl": "sm90", "group_m": 8} and Cublas().as_dict() == {
        "impl": "cublas"}


@pytest.mark.parametrize("shape", QWEN3)
def test_forward_lists_at_the_qwen3_shapes(shape, gpu_lists):
    D, H = QWEN3[shape]
    g1 = _cands(gemm1_swiglu.STAGE, gemm1_swiglu.Shape(H, D, tiles.BLOCK_M))
    assert g1 == [c for c in hx.GEMM1_SWIGLU_CONFIGS if c.block_n == 128]
    assert len(g1) == 6 and g1[0].use_tma and not g1[0].persistent  # the reference
    g2 = _cands(gemm2.STAGE, gemm2.Shape(D, H, tiles.BLOCK_M))
    assert g2 == [c for c in hx.GEMM2_CONFIGS if c.block_n == 256] and len(g2) == 4
    sm90 = Available(sm90=True)
    assert _cands(gemm1_swiglu.STAGE, gemm1_swiglu.Shape(H, D, tiles.BLOCK_M), sm90) == g1 + [Sm90()]
    assert _cands(gemm2.STAGE, gemm2.Shape(D, H, tiles.BLOCK_M), sm90) == g2 + [Sm90()]
    assert _cands(gemm2.STAGE, gemm2.Shape(D, H, tiles.BLOCK_M, bf16=False), sm90) == g2


def test_forward_narrow_fallback_only_where_no_wide_tile_fits(gpu_lists):
    # H a multiple of 64, not of 128: only the 64-wide GEMM 1 tile
    assert [c.block_n for c in hx.gemm1_swiglu_triton(832, 2048)] == [64]
    # D a multiple of 64, not of 256: only the 64-wide GEMM 2 tile
    assert [c.block_n for c in hx.gemm2_triton(2112, 768)] == [64]
    # nothing divides: no candidate (the op's check_inputs refuses such shapes first)
    assert hx.gemm1_swiglu_triton(800, 2048) == []
    assert hx.gemm1_swiglu_triton(768, 2000) == []


@pytest.mark.parametrize("shape", QWEN3)
def test_backward_lists_at_the_qwen3_shapes(shape, gpu_lists):
    D, H = QWEN3[shape]
    s = Bwd(D, H, 128, tiles.BLOCK_M)
    assert _cands(dgrad2_swiglu.STAGE, s) == hx.DGRAD2_SWIGLU_CONFIGS + [Cublas()]
    assert _cands(wgrad.DW2, s) == hx.WGRAD_CONFIGS + [Cublas()]
    assert _cands(wgrad.DW13, s) == hx.WGRAD_CONFIGS + [Cublas()]
    # dgrad1's grouped_mm side is offered only when forced
    assert _cands(dgrad1.STAGE, s) == hx.DGRAD1_CONFIGS
    # no grouped_mm where it cannot run (the interpreter, a CPU)
    assert _cands(wgrad.DW2, s, NONE) == hx.WGRAD_CONFIGS


def test_backward_pointer_configs_only_where_no_tma_config_fits(gpu_lists):
    assert hx.dgrad2_swiglu_triton(2048, 832) == hx.DGRAD2_SWIGLU_CONFIGS + [hx.DGRAD2_SWIGLU_UNEVEN]
    assert hx.dgrad1_triton(2048, 832) == hx.DGRAD1_CONFIGS
    assert hx.dgrad2_swiglu_triton(2000, 768)[-1] == hx.DGRAD2_SWIGLU_UNEVEN
    assert hx.dgrad1_triton(2000, 768) == hx.DGRAD1_CONFIGS + [hx.DGRAD1_UNEVEN]
    assert hx.dgrad2_swiglu_triton(2000, 768)[0] == hx.DGRAD2_SWIGLU_CONFIGS[0]


def test_sides_follow_megamoe_bwd_impl(gpu_lists):
    offer = cublas_offer()
    assert offer(Bwd(64, 32, 1, 128), GPU) == [Cublas()]
    assert cublas_offer(auto=False)(Bwd(64, 32, 1, 128), GPU) == []
    assert offer(Bwd(60, 32, 1, 128), GPU) == []  # auto skips what _grouped_mm cannot run
    assert offer(Bwd(64, 32, 1, 128, forced="triton"), GPU) == []
    # forced: the grouped_mm side alone, even where auto does not offer it
    forced = Bwd(2048, 768, 128, 128, forced="cublas")
    all_sides = Available(sm90=True, deepgemm=True, cublas=True)
    for stage in (dgrad2_swiglu.STAGE, wgrad.DW2, dgrad1.STAGE):
        assert _cands(stage, forced, all_sides) == [Cublas()]
    triton_only = Bwd(2048, 768, 128, 128, forced="triton")
    assert _cands(dgrad2_swiglu.STAGE, triton_only, all_sides) == hx.DGRAD2_SWIGLU_CONFIGS
    with pytest.raises(ValueError, match=settings.BWD_IMPL):
        offer(Bwd(64, 36, 1, 128, forced="cublas"), GPU)


def test_sm90_fit_checks_reject_what_they_cannot_run(gpu_lists):
    sm90 = Available(sm90=True)
    s = Bwd(2048, 768, 4, tiles.BLOCK_M)
    for stage in (dgrad2_swiglu.STAGE, wgrad.DW2, dgrad1.STAGE):
        assert any(c.side == "sm90" for c in _cands(stage, s, sm90))
        # not built here, another plan tile height, or fp32 operands: not offered
        for shape, avail in ((s, NONE), (Bwd(2048, 768, 4, 64), sm90),
                             (Bwd(2048, 768, 4, tiles.BLOCK_M, bf16=False), sm90)):
            assert not any(c.side == "sm90" for c in _cands(stage, shape, avail))
    assert not any(c.side == "sm90"
                   for c in _cands(wgrad.DW2, Bwd(2048, 768, 4, 128, params_ok=False), sm90))


def test_fp8_lists(gpu_lists):
    for epilogue, cands in hx.FP8_CONFIGS.items():
        shape = fp8_gemm.Shape(epilogue, 768, 2048, 128, out_bf16=True, gather=True)
        assert _cands(fp8_gemm.STAGES["fp8_gemm2"], shape) == cands
    # the SwiGLU epilogues keep one scale per row (block_n 128); dgrad2_swiglu one per column too
    assert {c.block_n for c in hx.FP8_GEMM1_SWIGLU_CONFIGS} == {128}
    assert {(c.block_m, c.block_n) for c in hx.FP8_DGRAD2_SWIGLU_CONFIGS} == {(128, 128)}
    bf16 = torch.bfloat16
    assert _cands(fp8_wgrad.STAGE, fp8_wgrad.Shape(768, 2048, bf16)) == hx.FP8_WGRAD_CONFIGS
    # M = 192 is not a multiple of 128: only the 64-row tiles
    assert {c.block_m for c in _cands(fp8_wgrad.STAGE, fp8_wgrad.Shape(192, 2048, bf16))} == {64}


def test_fp8_deepgemm_not_for_one_group_of_experts(gpu_lists):
    dg = Available(deepgemm=True)
    rows = fp8_gemm.STAGES["fp8_dgrad1"]
    whole = fp8_gemm.Shape("gemm_rows", 2048, 1536, 128, out_bf16=True, gather=False)
    group = fp8_gemm.Shape("gemm_rows", 2048, 1536, 128, out_bf16=True, gather=False,
                           expert_group=True)
    assert _cands(rows, whole, dg)[-1].side == "deepgemm"
    assert all(c.side == "triton" for c in _cands(rows, group, dg))


def test_interpreter_tiles(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tiles.plan_block_m() == tiles.INTERPRET_BLOCK_M and hopper_multiple() == 16
    assert hx.forward_configs(None, None) == (hx.INTERPRET_GEMM, hx.INTERPRET_GEMM)
    # FP8-shaped problems (128-row segments, 128-multiple D and H) walk 16x fewer tiles
    wide = (hx.INTERPRET_GEMM_WIDE,) * 2
    assert hx.forward_configs(None, None, 128, 128, 256) == wide
    # 64-multiple D and H: 64-wide tiles; others keep the 16-wide ones (even paths at any size)
    assert hx.forward_configs(None, None, 16, 128, 256) == (hx.INTERPRET_GEMM_64,) * 2
    assert hx.forward_configs(None, None, 128, 96, 256) == (hx.INTERPRET_GEMM,) * 2
    assert hx.dgrad2_swiglu_triton(2048, 768) == [hx.INTERPRET_DGRAD2_SWIGLU_64]
    assert hx.dgrad2_swiglu_triton(96, 48) == [hx.INTERPRET_DGRAD2_SWIGLU]
    assert hx.dgrad1_triton(2048, 768) == [hx.INTERPRET_DGRAD1_64]
    assert hx.dgrad1_triton(2048, 48) == [hx.INTERPRET_DGRAD1]
    monkeypatch.delenv("TRITON_INTERPRET")
    assert tiles.plan_block_m() == tiles.BLOCK_M and hopper_multiple() == 64
    assert hx.forward_configs(None, None) == (None, None)  # the tuner picks
