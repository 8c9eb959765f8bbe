"""What heuristics.py offers the tuner per stage: the lists at the Qwen3 shapes, the fallback
configs only where the shape needs them, the first pick, fit checks that reject shapes the tiles
do not divide, and one key schema. On CPU tensors (no sm90 kernel is ever offered)."""

import pytest
import torch

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper import heuristics as hx
from torchtitan_megamoe.ops.shapes import hopper_multiple

QWEN3 = {"30b": (2048, 768), "235b": (4096, 1536)}  # (D, H)


@pytest.fixture
def gpu_lists(monkeypatch):
    """The GPU's lists (the interpreter swaps in its small tiles), tuner side auto."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(settings.BWD_IMPL, raising=False)


def _bf16(*shape):
    return torch.empty(*shape, dtype=torch.bfloat16)


def _all_configs():
    lists = [hx.GEMM1_SWIGLU_CONFIGS, hx.GEMM2_CONFIGS, hx.DGRAD2_SWIGLU_CONFIGS,
             hx.WGRAD_CONFIGS, hx.DGRAD1_CONFIGS, hx.FP8_WGRAD_CONFIGS, *hx.FP8_CONFIGS.values()]
    singles = [hx.GEMM1_SWIGLU_SM90, hx.GEMM2_SM90, hx.DGRAD2_SWIGLU_UNEVEN, hx.DGRAD2_SWIGLU_SM90,
               hx.DGRAD2_SWIGLU_SM90_FUSED, hx.WGRAD_SM90_PRE_GATHERED, hx.DGRAD1_UNEVEN,
               hx.DGRAD1_SM90, hx.FP8_SM90, hx.FP8_INTERPRET, hx.INTERPRET_GEMM,
               hx.INTERPRET_DGRAD2_SWIGLU, hx.INTERPRET_WGRAD, hx.INTERPRET_DGRAD1, hx.CUBLAS]
    return [c for cands in lists for c in cands] + singles


def test_one_key_schema():
    allowed = {"block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages", "use_tma",
               "persistent", "tma_store", "pre_gathered", "static", "impl"}
    for cfg in _all_configs():
        assert set(cfg) <= allowed, cfg
    assert {c.get("impl") for c in _all_configs()} == {None, "sm90", "sm90_fused", "cublas"}


@pytest.mark.parametrize("shape", QWEN3)
def test_forward_lists_at_the_qwen3_shapes(shape, gpu_lists):
    D, H = QWEN3[shape]
    x = _bf16(4, D)
    g1 = hx.gemm1_swiglu_candidates(x, H, D, hx.BLOCK_M)
    assert g1 == [c for c in hx.GEMM1_SWIGLU_CONFIGS if c["block_n"] == 128]
    assert len(g1) == 6 and g1[0] == hx.GEMM1_SWIGLU_CONFIGS[0]
    assert g1[0]["use_tma"] and not g1[0].get("persistent")  # what runs untuned
    w2, y = _bf16(2, D, H), _bf16(4, D)
    g2 = hx.gemm2_candidates(_bf16(4, H), w2, y, hx.BLOCK_M)
    assert g2 == [c for c in hx.GEMM2_CONFIGS if c["block_n"] == 256] and len(g2) == 4
    assert g2[0]["use_tma"] and not g2[0].get("persistent")


def test_forward_narrow_fallback_only_where_no_wide_tile_fits(gpu_lists):
    x = _bf16(4, 2048)
    # H a multiple of 64, not of 128: only the 64-wide GEMM 1 tile
    assert [c["block_n"] for c in hx.gemm1_swiglu_candidates(x, 832, 2048, hx.BLOCK_M)] == [64]
    # D a multiple of 64, not of 256: only the 64-wide GEMM 2 tile
    g2 = hx.gemm2_candidates(_bf16(4, 768), _bf16(2, 2112, 768), _bf16(4, 2112), hx.BLOCK_M)
    assert [c["block_n"] for c in g2] == [64]
    # nothing divides: no candidate (the op's check_inputs refuses such shapes first)
    assert hx.gemm1_swiglu_candidates(x, 800, 2048, hx.BLOCK_M) == []
    assert hx.gemm1_swiglu_candidates(x, 768, 2000, hx.BLOCK_M) == []


@pytest.mark.parametrize("shape", QWEN3)
def test_backward_lists_at_the_qwen3_shapes(shape, gpu_lists):
    D, H = QWEN3[shape]
    E = 128
    x, w1, w2, w3 = _bf16(4, D), _bf16(E, H, D), _bf16(E, D, H), _bf16(E, H, D)
    assert hx.dgrad2_swiglu_candidates(x, w2, hx.BLOCK_M) == hx.DGRAD2_SWIGLU_CONFIGS + [hx.CUBLAS]
    assert hx.wgrad_candidates(x, (w1, w2, w3), hx.BLOCK_M) == hx.WGRAD_CONFIGS + [hx.CUBLAS]
    # dgrad1's grouped_mm side never won: not offered under auto
    assert hx.dgrad1_candidates(_bf16(4, 2 * H), w1, hx.BLOCK_M) == hx.DGRAD1_CONFIGS


def test_backward_pointer_configs_only_where_no_tma_config_fits(gpu_lists):
    assert hx.dgrad2_swiglu_triton(2048, 832) == hx.DGRAD2_SWIGLU_CONFIGS + [hx.DGRAD2_SWIGLU_UNEVEN]
    assert hx.dgrad1_triton(2048, 832) == hx.DGRAD1_CONFIGS
    assert hx.dgrad2_swiglu_triton(2000, 768)[-1] == hx.DGRAD2_SWIGLU_UNEVEN
    assert hx.dgrad1_triton(2000, 768) == hx.DGRAD1_CONFIGS + [hx.DGRAD1_UNEVEN]
    assert hx.dgrad2_swiglu_triton(2000, 768)[0] == hx.DGRAD2_SWIGLU_CONFIGS[0]


def test_sides_follow_megamoe_bwd_impl(monkeypatch, gpu_lists):
    tri = [dict(block_n=64)]
    assert hx.stage_candidates(tri, 64, 32) == tri + [hx.CUBLAS]  # auto: Triton first
    assert hx.stage_candidates(tri, 64, 32, auto_cublas=False) == tri
    assert hx.stage_candidates(tri, 60, 32) == tri  # auto skips what _grouped_mm cannot run
    monkeypatch.setenv(settings.BWD_IMPL, "triton")
    assert hx.stage_candidates(tri, 64, 32) == tri
    monkeypatch.setenv(settings.BWD_IMPL, "cublas")  # forced: the grouped_mm side all the same
    assert hx.stage_candidates(tri, 64, 32, auto_cublas=False) == [hx.CUBLAS]
    with pytest.raises(ValueError, match=settings.BWD_IMPL):
        hx.stage_candidates(tri, 64, 36)


def test_sm90_fit_checks_reject_what_they_cannot_run(gpu_lists):
    E, D, H = 4, 2048, 768
    x, w1, w2, w3 = _bf16(4, D), _bf16(E, H, D), _bf16(E, D, H), _bf16(E, H, D)
    # CPU tensors: the csrc/ kernels never run here
    assert not hx.dgrad2_swiglu_sm90_fits(x, w2, hx.BLOCK_M)
    assert not hx.wgrad_sm90_fits(x, (w1, w2, w3), hx.BLOCK_M)
    assert not hx.dgrad1_sm90_fits(_bf16(4, 2 * H), w1, hx.BLOCK_M)
    # another plan tile height, or fp32 operands: not offered whatever the device
    assert not hx.dgrad2_swiglu_sm90_fits(x, w2, 64)
    assert not hx.wgrad_sm90_fits(x.float(), (w1, w2, w3), hx.BLOCK_M)


def test_fp8_lists(gpu_lists):
    a, out = torch.empty(4, 2048, dtype=torch.float8_e4m3fn), _bf16(4, 2048)
    for epilogue, cands in hx.FP8_CONFIGS.items():
        assert hx.fp8_gemm_candidates(epilogue, a, 768, 2048, 128, out, gather=True) == cands
    # the SwiGLU epilogues keep one scale per row (block_n 128); dgrad2_swiglu one per column too
    assert {c["block_n"] for c in hx.FP8_GEMM1_SWIGLU_CONFIGS} == {128}
    assert {(c["block_m"], c["block_n"]) for c in hx.FP8_DGRAD2_SWIGLU_CONFIGS} == {(128, 128)}
    at = torch.empty(768, 256, dtype=torch.float8_e4m3fn)
    assert hx.fp8_wgrad_candidates(at, 768, 2048, torch.bfloat16) == hx.FP8_WGRAD_CONFIGS
    # M = 192 is not a multiple of 128: only the 64-row tiles
    assert {c["block_m"] for c in hx.fp8_wgrad_candidates(at, 192, 2048, torch.bfloat16)} == {64}


def test_interpreter_tiles(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert hx.plan_block_m() == hx.INTERPRET_BLOCK_M and hopper_multiple() == 16
    assert hx.forward_configs(None, None) == (hx.INTERPRET_GEMM, hx.INTERPRET_GEMM)
    assert hx.dgrad2_swiglu_triton(2048, 768) == [hx.INTERPRET_DGRAD2_SWIGLU]
    monkeypatch.delenv("TRITON_INTERPRET")
    assert hx.plan_block_m() == hx.BLOCK_M and hopper_multiple() == 64
    assert hx.forward_configs(None, None) == (None, None)  # the tuner picks
