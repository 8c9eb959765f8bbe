"""What every stage runs untuned (MEGAMOE_TUNE=0, CUDA graph capture, the CPU interpreter): the
side measured fastest on an H200 at the Qwen3 shapes where it fits, falling through the
stage's preference to the Triton reference where it does not. Pinned at the 30B (D 2048, H 768)
and 235B (D 4096, H 1536) layers, E 128, T 16384, K 8, for each precision and each set of
available sides, from plain shapes: no GPU."""

import pytest
import torch

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper import heuristics as hx
from torchtitan_megamoe.ops.hopper import tiles
from torchtitan_megamoe.ops.hopper.sides import dgrad1, dgrad2_swiglu, fp8_gemm, fp8_wgrad
from torchtitan_megamoe.ops.hopper.sides import gemm1_swiglu, gemm2, wgrad
from torchtitan_megamoe.ops.hopper.sides.backward import Shape as Bwd
from torchtitan_megamoe.ops.hopper.configs import Cublas, DeepGemm, Sm90, Sm90Fused
from torchtitan_megamoe.ops.hopper.sides.table import Available, available

QWEN3 = {"30b": (2048, 768), "235b": (4096, 1536)}  # (D, H)
E = 128
H200 = Available(sm90=True, deepgemm=True, cublas=True)  # nvcc and DeepGEMM installed
NO_DEEPGEMM = Available(sm90=True, cublas=True)
NO_NVCC = Available(deepgemm=True, cublas=True)
TRITON_ONLY = Available()


@pytest.fixture(autouse=True)
def gpu_lists(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(settings.BWD_IMPL, raising=False)


def bf16_picks(D, H, avail):
    fwd = (gemm1_swiglu.STAGE.offer(gemm1_swiglu.Shape(H, D, tiles.BLOCK_M), avail).untuned,
           gemm2.STAGE.offer(gemm2.Shape(D, H, tiles.BLOCK_M), avail).untuned)
    s = Bwd(D, H, E, tiles.BLOCK_M)
    bwd = tuple(st.offer(s, avail).untuned
                for st in (dgrad2_swiglu.STAGE, wgrad.DW2, wgrad.DW13, dgrad1.STAGE))
    return fwd + bwd


def fp8_picks(D, H, avail, expert_group=False):
    """fp8_gemm1_swiglu, fp8_gemm2, fp8_dgrad2, fp8_dgrad1 (one launch, or by groups of experts
    without the weight cache), the bf16 weight gradients, and the all-FP8 recipe's
    fp8_dgrad2_swiglu and fp8_wgrad (dw2, dw1)."""
    F = fp8_gemm.Shape
    st = fp8_gemm.STAGES
    rows = (
        (st["fp8_gemm1_swiglu"], F("gemm1_swiglu", H, D, 128, out_bf16=False, gather=True)),
        (st["fp8_gemm2"], F("gemm_rows", D, H, 128, out_bf16=True, gather=False)),
        (st["fp8_dgrad2"], F("gemm_rows", H, D, 128, out_bf16=True, gather=True)),
        (st["fp8_dgrad1"], F("gemm_rows", D, 2 * H, 128, out_bf16=True, gather=False,
                             expert_group=expert_group)),
        (wgrad.DW2, Bwd(D, H, E, tiles.FP8_BLOCK_M)),
        (wgrad.DW13, Bwd(D, H, E, tiles.FP8_BLOCK_M)),
        (st["fp8_dgrad2_swiglu"], F("dgrad2_swiglu", H, D, 128, out_bf16=False, gather=True)),
        (fp8_wgrad.STAGE, fp8_wgrad.Shape(D, H, torch.bfloat16)),
        (fp8_wgrad.STAGE, fp8_wgrad.Shape(H, D, torch.bfloat16)),
    )
    return tuple(stage.offer(shape, avail).untuned for stage, shape in rows)


@pytest.mark.parametrize("shape", QWEN3)
def test_bf16_untuned_is_the_sm90_kernel_of_every_stage(shape):
    D, H = QWEN3[shape]
    assert bf16_picks(D, H, H200) == (Sm90(), Sm90(), Sm90Fused(block_n=256), Sm90(), Sm90(),
                                      Sm90())
    # without nvcc: grouped_mm where it is offered, else the Triton reference
    assert bf16_picks(D, H, NO_NVCC) == (
        hx.GEMM1_SWIGLU_CONFIGS[0], hx.GEMM2_CONFIGS[0], Cublas(), Cublas(), Cublas(),
        hx.DGRAD1_CONFIGS[0])
    assert bf16_picks(D, H, TRITON_ONLY) == (
        hx.GEMM1_SWIGLU_CONFIGS[0], hx.GEMM2_CONFIGS[0], hx.DGRAD2_SWIGLU_CONFIGS[0],
        hx.WGRAD_CONFIGS[0], hx.WGRAD_CONFIGS[0], hx.DGRAD1_CONFIGS[0])


@pytest.mark.parametrize("shape", QWEN3)
def test_fp8_untuned_is_deepgemm_where_installed_else_sm90(shape):
    D, H = QWEN3[shape]
    dg, sm = DeepGemm(), Sm90()
    assert fp8_picks(D, H, H200) == (dg, dg, dg, dg, sm, sm, sm, sm, sm)
    # by groups of experts DeepGEMM would zero the other groups' rows: ours
    assert fp8_picks(D, H, H200, expert_group=True) == (dg, dg, dg, sm, sm, sm, sm, sm, sm)
    assert fp8_picks(D, H, NO_DEEPGEMM) == (sm,) * 9
    assert fp8_picks(D, H, NO_NVCC) == (
        dg, dg, dg, dg, Cublas(), Cublas(), hx.FP8_DGRAD2_SWIGLU_CONFIGS[0],
        hx.FP8_WGRAD_CONFIGS[0], hx.FP8_WGRAD_CONFIGS[0])
    assert fp8_picks(D, H, TRITON_ONLY) == (
        hx.FP8_GEMM1_SWIGLU_CONFIGS[0], hx.FP8_GEMM_ROWS_CONFIGS[0], hx.FP8_GEMM_ROWS_CONFIGS[0],
        hx.FP8_GEMM_ROWS_CONFIGS[0], hx.WGRAD_CONFIGS[0], hx.WGRAD_CONFIGS[0],
        hx.FP8_DGRAD2_SWIGLU_CONFIGS[0], hx.FP8_WGRAD_CONFIGS[0], hx.FP8_WGRAD_CONFIGS[0])


def test_the_reference_stays_first_whatever_runs_untuned():
    D, H = QWEN3["30b"]
    offer = dgrad2_swiglu.STAGE.offer(Bwd(D, H, E, tiles.BLOCK_M), H200)
    assert offer.candidates[0] == hx.DGRAD2_SWIGLU_CONFIGS[0]
    assert offer.untuned == Sm90Fused(block_n=256)


def test_the_interpreter_keeps_its_config(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    here = available(torch.empty(1))
    assert here == Available()
    s = Bwd(64, 32, 4, tiles.INTERPRET_BLOCK_M)
    assert dgrad2_swiglu.STAGE.offer(s, here).untuned == hx.INTERPRET_DGRAD2_SWIGLU
    assert wgrad.DW2.offer(s, here).untuned == hx.INTERPRET_WGRAD
    assert dgrad1.STAGE.offer(s, here).untuned == hx.INTERPRET_DGRAD1
