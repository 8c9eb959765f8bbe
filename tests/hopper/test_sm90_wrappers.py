"""The Python sides of the bf16 modes of csrc/'s kernel families refuse bad input before anything is built or
launched, with an error that names the problem (CPU: the checks run before the library loads)."""

import pytest
import torch

from torchtitan_megamoe.ops.hopper.cuda.dgrad2_swiglu import dgrad2_swiglu_sm90
from torchtitan_megamoe.ops.hopper.cuda.gemm_rows import gemm_rows_nmajor_sm90, gemm_rows_sm90
from torchtitan_megamoe.ops.hopper.cuda.wgrad import wgrad_dw13_sm90, wgrad_dw2_sm90
from torchtitan_megamoe.ops.hopper.plan import build_plan

T, K, E = 64, 2, 4


@pytest.fixture(scope="module")
def plan():
    g = torch.Generator().manual_seed(0)
    return build_plan(torch.randint(0, E, (T, K), generator=g), E, 128)


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


def test_gemm_rows_needs_256_wide_outputs_bf16_and_the_plans_row_space(plan):
    R = plan.max_rows
    with pytest.raises(ValueError, match="out columns % 256"):
        gemm_rows_sm90(_bf16(R, 128), _bf16(E, 192, 128), plan, _bf16(R, 192))
    with pytest.raises(TypeError, match="w must be bfloat16"):
        gemm_rows_sm90(_bf16(R, 128), torch.zeros(E, 256, 128), plan, _bf16(R, 256))
    with pytest.raises(ValueError, match=r"must be \[%d, 128\]" % R):
        gemm_rows_sm90(_bf16(R - 128, 128), _bf16(E, 256, 128), plan, _bf16(R, 256))
    with pytest.raises(ValueError, match="one or two weights of one shape"):
        gemm_rows_nmajor_sm90(_bf16(R, 256), (_bf16(E, 128, 256), _bf16(E, 64, 256)), plan,
                              _bf16(R, 256))
    with pytest.raises(ValueError, match="contiguous"):
        gemm_rows_sm90(_bf16(R, 256)[:, :128], _bf16(E, 256, 128), plan, _bf16(R, 256))


def test_wgrad_needs_tile_multiples_and_a_plan_with_the_gradients_experts(plan):
    R = plan.max_rows
    dy = _bf16(T, 256)
    with pytest.raises(ValueError, match="columns % 256"):
        wgrad_dw2_sm90(dy, _bf16(R, 192), plan, _bf16(E, 256, 192))
    with pytest.raises(TypeError, match="must all be bfloat16 or all float32"):
        wgrad_dw2_sm90(dy, _bf16(R, 256), plan, torch.zeros(E, 256, 256, dtype=torch.float16))
    with pytest.raises(TypeError, match="must all be bfloat16 or all float32"):  # mixed outputs
        wgrad_dw13_sm90(_bf16(R, 512), _bf16(T, 256), plan, _bf16(E, 256, 256),
                        torch.zeros(E, 256, 256))
    with pytest.raises(ValueError, match="the plan has 4 experts, the gradient 3"):
        wgrad_dw2_sm90(dy, _bf16(R, 256), plan, _bf16(3, 256, 256))
    with pytest.raises(ValueError, match="do not match the gradient"):
        wgrad_dw13_sm90(_bf16(R, 512), _bf16(T, 128), plan, _bf16(E, 256, 256),
                        _bf16(E, 256, 256))
    with pytest.raises(ValueError, match="must have one shape"):
        wgrad_dw13_sm90(_bf16(R, 512), _bf16(T, 256), plan, _bf16(E, 256, 256),
                        _bf16(E, 128, 256))


def test_dgrad_swiglu_needs_256_wide_hidden_and_matching_buffers(plan):
    R = plan.max_rows
    tw = torch.rand(T, K)
    with pytest.raises(ValueError, match="hidden % 256"):
        dgrad2_swiglu_sm90(_bf16(T, 256), _bf16(R, 384), tw, _bf16(E, 256, 192), plan)
    with pytest.raises(ValueError, match="do not fit"):
        dgrad2_swiglu_sm90(_bf16(T, 256), _bf16(R, 256), tw, _bf16(E, 256, 256), plan)
    with pytest.raises(ValueError, match="topk_weights has 64 entries"):
        dgrad2_swiglu_sm90(_bf16(T, 256), _bf16(R, 512), tw[:, :1], _bf16(E, 256, 256), plan)
    with pytest.raises(ValueError, match=r"dy_rows must be a contiguous torch.bfloat16 \[%d, 256\]"
                       % R):
        dgrad2_swiglu_sm90(_bf16(T, 256), _bf16(R, 512), tw, _bf16(E, 256, 256), plan,
                             dy_rows=_bf16(T, 256))
