"""DeepGEMM's M-grouped FP8 GEMM as one more side of the FP8 row GEMMs (optional).

DeepGEMM (the ``deep_gemm`` package, PyPI sdist ``deepinfer-gemm``, this project's
``[deepgemm]`` extra: scripts/install_deepgemm.sh) picks its tile shape per problem. Where it is
importable, its side in sides/fp8_gemm.py is offered to the tuner next to our kernels, and the
tuner keeps whichever is faster (and agrees with ours). Nothing else depends on it.

    m_grouped_fp8_gemm_nt_contiguous(A rows [M, K] e4m3 + [M, K/128] fp32 scales,
                                     B [E, N, K] e4m3 + [E, N/128, K/128] scales,
                                     D [M, N] bf16, grouped_layout [M] int32)

The plan's row space is already DeepGEMM's contiguous layout: every expert's segment is padded to
128 rows (tiles.FP8_BLOCK_M, its M alignment on SM90), and a row's group is its tile's
expert (-1 past the used rows: DeepGEMM skips those blocks and leaves their D rows unwritten).
DeepGEMM writes zeros into the rows of skipped blocks, so it cannot write one group of experts
into an output that holds the others' rows (sides/fp8_gemm.py: not offered there).
A must be row-contiguous: per-token operands are gathered into the row space first
(kernels/fp8_quant.gather_rows). Scales are passed as fp32 with DeepGEMM's power-of-two (UE8M0)
rounding turned off, so it computes the recipe our kernels and the reference do.
"""

import functools
import importlib

import torch

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.device import is_hopper
from torchtitan_megamoe.ops.hopper.plan import Plan


@functools.cache
def _module():
    """deep_gemm, or None when it is not installed or fails to load (then never offered)."""
    try:
        return importlib.import_module("deep_gemm")
    except Exception:  # not installed, or built against another torch: ours run alone
        return None


def available(t: torch.Tensor) -> bool:
    """Whether DeepGEMM may run on ``t``'s device: installed, not switched off
    (MEGAMOE_DEEPGEMM=0), a CUDA tensor on a Hopper GPU, not under the CPU interpreter."""
    if not settings.deepgemm() or settings.triton_interpreting() or not is_hopper(t.device):
        return False
    return _module() is not None


def version() -> str | None:
    mod = _module()
    return None if mod is None else getattr(mod, "__version__", "unknown")


def grouped_layout(plan: Plan) -> torch.Tensor:
    """[R_max] int32: each row's expert (its tile's), -1 where DeepGEMM must skip."""
    return plan.tile_expert.to(torch.int32).repeat_interleave(plan.block_m)


def gemm_rows(aq: torch.Tensor, a_s: torch.Tensor, bq: torch.Tensor, b_s: torch.Tensor,
              layout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [M, N] (bf16, row stride free) = aq @ bq[group(row)]^T with the blockwise scales."""
    if out.dtype != torch.bfloat16:
        raise TypeError(f"DeepGEMM writes bf16, got an output of {out.dtype}")
    _module().m_grouped_fp8_gemm_nt_contiguous(
        (aq, a_s), (bq, b_s), out, layout, disable_ue8m0_cast=True)
    return out


def joined(b: torch.Tensor, b_s: torch.Tensor, b2: torch.Tensor,
           b2_s: torch.Tensor) -> tuple | None:
    """(q [E, 2N, K], s [E, 2N/128, K/128]) when weights b, b2 [E, N, K] (and their scales) are
    the halves of one such copy (fp8_weights._w13_halves): GEMM 1 then runs as one launch over
    [w1; w3], its output [a1 | a3] as the forward saves it. Else None."""
    E, N, K = b.shape

    def whole(x, y, rows, cols):
        shape, strides = (E, 2 * rows, cols), (2 * rows * cols, cols, 1)
        if (x.stride() == y.stride() == strides
                and x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
                and y.storage_offset() == x.storage_offset() + rows * cols):
            return x.as_strided(shape, strides)
        return None

    q, s = whole(b, b2, N, K), whole(b_s, b2_s, N // 128, K // 128)
    return None if q is None or s is None else (q, s)

