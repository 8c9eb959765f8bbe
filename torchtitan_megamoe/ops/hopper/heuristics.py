"""The Triton side of every stage: its tile configs in the tuner's order, and which of them fit
a shape. The stage tables (sides/) offer them next to the other sides; tune.py times them.
Each config is offered because it was the fastest of its stage at a Qwen3 shape in at least one
bench run on the GPU; the first one of a list is the tuner's correctness reference.
"""

from __future__ import annotations

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.configs import TritonGemm as T


# ------------------------------------------------------------------------------ gemm1_swiglu

# two accumulators double a plain tile's registers: block_n stays at 128
GEMM1_SWIGLU_CONFIGS = [
    T(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3, use_tma=True),
    # pointer weight loads: fastest with the a1/a3 store
    T(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3, use_tma=False),
    # a deeper pipeline hides the weight loads at H = 768
    T(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4, use_tma=True),
    # persistent: one program per SM over the used tiles only
    T(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3, use_tma=True,
      persistent=True),
    # group_m "wave": the tiles sharing an A or a weight tile run in one wave and hit in L2
    T(block_m=128, block_n=128, block_k=64, group_m="wave", num_warps=8, num_stages=3,
      use_tma=True, persistent=True),
    T(block_m=128, block_n=128, block_k=64, group_m="wave", num_warps=8, num_stages=3,
      use_tma=True),
    # H a multiple of 64 but not of 128: offered only where no 128-wide tile fits
    T(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4),
]


def gemm1_swiglu_triton(H: int, D: int) -> list:
    cands = [c for c in GEMM1_SWIGLU_CONFIGS if H % c.block_n == 0 and D % c.block_k == 0]
    if any(c.block_n == 128 for c in cands):
        cands = [c for c in cands if c.block_n == 128]
    return cands


# ------------------------------------------------------------------------------------ gemm2

GEMM2_CONFIGS = [
    T(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, use_tma=True),
    T(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=4, use_tma=True),
    # persistent, and with the output tile as one bulk tensor store (+64 KiB shared memory)
    T(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, use_tma=True,
      persistent=True),
    T(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, use_tma=True,
      persistent=True, tma_store=True),
    # D and H multiples of 64: offered only where no 256-wide tile fits
    T(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4),
]


def gemm2_triton(D: int, H: int) -> list:
    cands = [c for c in GEMM2_CONFIGS if D % c.block_n == 0 and H % c.block_k == 0]
    if any(c.block_n == 256 for c in cands):
        cands = [c for c in cands if c.block_n == 256]
    return cands


INTERPRET_GEMM = T(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)
"""gemm1_swiglu's and gemm2's config under the CPU interpreter."""
INTERPRET_GEMM_64 = T(block_m=16, block_n=64, block_k=64, group_m=2, num_warps=1, num_stages=1)
"""The same where D and H are multiples of 64: the interpreter's cost goes by the tiles it
walks, 16x fewer than INTERPRET_GEMM's."""
INTERPRET_GEMM_WIDE = T(block_m=32, block_n=64, block_k=64, group_m=2, num_warps=1,
                        num_stages=1)
"""The same for FP8-shaped problems (128-row segments, D and H multiples of 128)."""


def _multiples_of_64(D: int, H: int) -> bool:
    """Whether the interpreter's 64-wide tiles divide D and H (the tiles they replace keep the
    even, unmasked paths tested at small sizes)."""
    return D > 0 and H > 0 and D % 64 == 0 and H % 64 == 0


def forward_configs(gemm1_config, gemm2_config, block_m: int = 0, D: int = 0, H: int = 0):
    """(gemm1_config, gemm2_config): the given ones, else the interpreter's (for rows in
    segments of ``block_m`` and GEMMs over D and H: every caller of one problem passes the
    same, so a recomputed GEMM 1 has the forward's bits), else None (the tuner picks)."""
    if settings.triton_interpreting():
        wide = min(block_m, D, H) >= 128 and not (block_m % 128 or D % 128 or H % 128)
        cfg = (INTERPRET_GEMM_WIDE if wide else INTERPRET_GEMM_64 if _multiples_of_64(D, H)
               else INTERPRET_GEMM)
        return gemm1_config or cfg, gemm2_config or cfg
    return gemm1_config, gemm2_config


# ---------------------------------------------------------------------------- dgrad2_swiglu

# one fp32 accumulator: 128x128 with 4 stages is fastest where TMA tiles divide D and H
DGRAD2_SWIGLU_CONFIGS = [
    T(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, use_tma=True),
]
# pointer loads for D, H the TMA tiles do not divide
DGRAD2_SWIGLU_UNEVEN = T(block_m=128, block_n=64, block_k=32, num_warps=8, num_stages=4,
                         use_tma=False)
INTERPRET_DGRAD2_SWIGLU = T(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=1,
                            use_tma=True)
INTERPRET_DGRAD2_SWIGLU_64 = T(block_m=16, block_n=64, block_k=64, num_warps=1, num_stages=1,
                               use_tma=True)


def dgrad2_swiglu_triton(D: int, H: int) -> list:
    if settings.triton_interpreting():
        return [INTERPRET_DGRAD2_SWIGLU_64 if _multiples_of_64(D, H) else INTERPRET_DGRAD2_SWIGLU]
    cands = DGRAD2_SWIGLU_CONFIGS
    if not any(D % c.block_k == 0 and H % c.block_n == 0 for c in cands):
        cands = cands + [DGRAD2_SWIGLU_UNEVEN]
    return cands


# ------------------------------------------------------------------ wgrad_dw2 and wgrad_dw13

# 128x256 is faster for dw2 at H = 1536; TMA loads do not depend on D and H
WGRAD_CONFIGS = [
    T(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, use_tma=True),
    T(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, use_tma=True),
]
# masked tiles: any D and H
INTERPRET_WGRAD = T(block_m=128, block_n=128, block_k=32, num_warps=1, num_stages=1, use_tma=True)


def wgrad_triton() -> list:
    return [INTERPRET_WGRAD] if settings.triton_interpreting() else WGRAD_CONFIGS


# ----------------------------------------------------------------------------------- dgrad1

# the wider tile is faster at most shapes, the narrower at some runs of both
DGRAD1_CONFIGS = [
    T(block_n=128, block_k=64, num_warps=8, num_stages=3, use_tma=True),
    T(block_n=256, block_k=64, num_warps=8, num_stages=3, use_tma=True),
]
# pointer loads for D, H the TMA tiles do not divide
DGRAD1_UNEVEN = T(block_n=128, block_k=32, num_warps=8, num_stages=4, use_tma=False)
INTERPRET_DGRAD1 = T(block_n=32, block_k=16, num_warps=1, num_stages=1, use_tma=True)
INTERPRET_DGRAD1_64 = T(block_n=64, block_k=64, num_warps=1, num_stages=1, use_tma=True)


def dgrad1_triton(D: int, H: int) -> list:
    if settings.triton_interpreting():
        return [INTERPRET_DGRAD1_64 if _multiples_of_64(D, H) else INTERPRET_DGRAD1]
    cands = DGRAD1_CONFIGS
    if not any(H % c.block_k == 0 and D % c.block_n == 0 for c in cands):
        cands = cands + [DGRAD1_UNEVEN]
    return cands


# ------------------------------------------------------------------------------- FP8 GEMMs

# Triton waits for each 128-K step's wgmma before scaling it into the accumulator, so 4-warp
# tiles (several CTAs per SM: one's promotion under another's MMAs) sit next to 8-warp ones;
# block_k is fixed at 128 (one scale step).
FP8_GEMM_ROWS_CONFIGS = [  # fp8_gemm2, fp8_dgrad2 and fp8_dgrad1
    T(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=3),
    T(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3),
    T(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=4),
    T(block_m=128, block_n=256, group_m=8, num_warps=8, num_stages=3),
    T(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4),
    T(block_m=128, block_n=64, group_m=8, num_warps=4, num_stages=4),
    T(block_m=64, block_n=256, group_m=8, num_warps=8, num_stages=3),
]
# block_n 128: one row scale of h per tile; 64-row tiles keep two accumulators from spilling
FP8_GEMM1_SWIGLU_CONFIGS = [
    T(block_m=64, block_n=128, group_m=8, num_warps=8, num_stages=3),
    T(block_m=64, block_n=128, group_m=8, num_warps=8, num_stages=4),
    T(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3),
    T(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4),
    T(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=3),
]
# 128 x 128 only: one row and one column scale per tile
FP8_DGRAD2_SWIGLU_CONFIGS = [
    T(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3),
    T(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=2),
    T(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=4),
]
FP8_INTERPRET = T(block_m=128, block_n=128, group_m=2, num_warps=1, num_stages=1)

FP8_CONFIGS = {
    "gemm_rows": FP8_GEMM_ROWS_CONFIGS,
    "gemm1_swiglu": FP8_GEMM1_SWIGLU_CONFIGS,
    "dgrad2_swiglu": FP8_DGRAD2_SWIGLU_CONFIGS,
}
"""Per epilogue of kernels/fp8_gemm.py: a plain row GEMM, GEMM 1's SwiGLU, the backward's."""

# 4-warp tiles run several CTAs per SM, as the FP8 row GEMMs'
FP8_WGRAD_CONFIGS = [
    T(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=3),
    T(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3),
    T(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4),
    T(block_m=128, block_n=64, group_m=8, num_warps=4, num_stages=4),
    T(block_m=128, block_n=256, group_m=8, num_warps=8, num_stages=3),
    T(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=4),
]


def fp8_wgrad_triton(M: int, N: int) -> list:
    return [c for c in FP8_WGRAD_CONFIGS if M % c.block_m == 0 and N % c.block_n == 0]
