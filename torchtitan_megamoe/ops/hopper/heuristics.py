"""Which kernel configs each stage offers its tuner, in which order, and where each one fits.

Every stage's candidate list, fit check and first pick lives here; kernels/ holds the kernels
and their launchers, tune.py times what this module offers. One key schema for every config:

    block_m, block_n, block_k   tile (rows, output columns, contraction step)
    group_m                     M tiles that sweep one N tile together (int, or "wave")
    num_warps, num_stages       Triton launch knobs
    use_tma, persistent, tma_store, pre_gathered, static   switches (absent: off)
    impl                        side: absent (Triton), "sm90" (csrc/ kernels), "sm90_fused",
                                "cublas" (torch._grouped_mm), "deepgemm" (deepgemm.py, when
                                installed)

The Triton launchers translate these keys to their kernels' constexpr names. The first
candidate of a list also runs untuned (CPU interpreter, CUDA graph capture, MEGAMOE_TUNE=0) and
is the reference the tuner checks the others against, so a Triton config always comes first.
Each Triton config is offered because it was the fastest of its stage at a Qwen3 shape in at
least one bench run on the GPU.
"""

from __future__ import annotations

import torch

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper import deepgemm
from torchtitan_megamoe.ops.hopper.cuda import gemm1_swiglu as sm90_gemm1
from torchtitan_megamoe.ops.hopper.cuda import gemm_rows as sm90_rows
from torchtitan_megamoe.ops.hopper.cuda import wgrad as sm90_wgrad
from torchtitan_megamoe.ops.hopper.cuda.sm90 import fp8_shape_supported, sm90_usable

# the plan tile heights (tiles.py), which every candidate's block_m divides; the stage files
# still import them from here
from torchtitan_megamoe.ops.hopper.tiles import (  # noqa: F401
    BLOCK_M, FP8_BLOCK_M, INTERPRET_BLOCK_M, plan_block_m,
)

# ------------------------------------------------------------------------------ gemm1_swiglu

# Two accumulators double a plain GEMM tile's registers, hence block_n <= 128. group_m 16 and a
# warp-specialized K loop never won, so they are not offered.
GEMM1_SWIGLU_CONFIGS = [
    dict(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3, use_tma=True),
    # pointer weight loads: won with the a1/a3 store at both shapes
    dict(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3, use_tma=False),
    # deeper pipeline (4 x 48 KiB of shared memory per CTA): the usual 30B pick
    dict(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4, use_tma=True),
    # persistent grid (one program per SM over the used tiles)
    dict(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3, use_tma=True,
         persistent=True),
    # group_m "wave": one group per wave of resident programs, so the tiles sharing an A or a
    # weight tile run concurrently and hit in L2; persistent, the usual 235B pick
    dict(block_m=128, block_n=128, block_k=64, group_m="wave", num_warps=8, num_stages=3,
         use_tma=True, persistent=True),
    dict(block_m=128, block_n=128, block_k=64, group_m="wave", num_warps=8, num_stages=3,
         use_tma=True),
    # hidden sizes that are multiples of 64 but not 128: it loses to the 128-wide tiles where
    # they fit, so it is only offered where none does
    dict(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4),
]
# csrc/ warp-specialized kernel (TMA weights, cp.async row gathers, wgmma, a global tile
# ticket, bulk-store epilogue): the usual pick at both shapes where it builds and fits
GEMM1_SWIGLU_SM90 = dict(impl="sm90", block_m=128, block_n=128, block_k=64, group_m=8)


def gemm1_swiglu_candidates(x: torch.Tensor, H: int, D: int, block_m: int) -> list[dict]:
    cands = [c for c in GEMM1_SWIGLU_CONFIGS if H % c["block_n"] == 0 and D % c["block_k"] == 0]
    if any(c["block_n"] == 128 for c in cands):
        cands = [c for c in cands if c["block_n"] == 128]
    if sm90_gemm1.shape_supported(H, D, block_m) and sm90_usable(x):
        cands.append(GEMM1_SWIGLU_SM90)
    return cands


# ------------------------------------------------------------------------------------ gemm2

# group_m 16, a warp-specialized K loop, the non-persistent bulk store and the persistent
# 4-stage variant never won, so they are not offered.
GEMM2_CONFIGS = [
    dict(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, use_tma=True),
    dict(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=4, use_tma=True),
    # persistent grid, and with the output tile as one bulk tensor store (+64 KiB of shared
    # memory for the staging tile): nearly always the Triton pick
    dict(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, use_tma=True,
         persistent=True),
    dict(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, use_tma=True,
         persistent=True, tma_store=True),
    # any dim/hidden multiples of 64: only offered where the 256-wide tiles do not fit
    dict(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4),
]
# csrc/ row GEMM (TMA for both operands, wgmma, tile ticket, bulk-store epilogue): the usual pick
GEMM2_SM90 = dict(impl="sm90", block_m=128, block_n=256, block_k=64, group_m=8)


def gemm2_candidates(h: torch.Tensor, w2: torch.Tensor, y: torch.Tensor, block_m: int) -> list[dict]:
    _, D, H = w2.shape
    cands = [c for c in GEMM2_CONFIGS if D % c["block_n"] == 0 and H % c["block_k"] == 0]
    if any(c["block_n"] == 256 for c in cands):
        cands = [c for c in cands if c["block_n"] == 256]
    bf16 = h.dtype == w2.dtype == y.dtype == torch.bfloat16
    if bf16 and sm90_rows.shape_supported(D, H, block_m) and sm90_usable(h):
        cands.append(GEMM2_SM90)
    return cands


INTERPRET_GEMM = dict(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)
"""gemm1_swiglu's and gemm2's config under the CPU interpreter."""


def forward_configs(gemm1_config: dict | None, gemm2_config: dict | None):
    """(gemm1_config, gemm2_config): the given ones, else the interpreter's, else None (the
    tuner picks)."""
    if settings.triton_interpreting():
        return gemm1_config or INTERPRET_GEMM, gemm2_config or INTERPRET_GEMM
    return gemm1_config, gemm2_config


# ----------------------------------------------------------------- backward: sides per stage

CUBLAS = dict(impl="cublas")
"""The torch._grouped_mm side of a backward stage (kernels/grouped_mm.py)."""


def is_cublas(cfg: dict) -> bool:
    return cfg.get("impl") == "cublas"


def cublas_unsupported_reason(D: int, H: int, E: int = 1) -> str | None:
    """Why the _grouped_mm stages cannot run for these dims (None: they can)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if E >= 1024:
        return f"torch._grouped_mm takes fewer than 1024 groups, got {E} local experts"
    if D % 8 or H % 8:
        return f"torch._grouped_mm needs D and H multiples of 8 (16-byte strides), got D={D}, H={H}"
    return None


def stage_candidates(triton_cands: list, D: int, H: int, E: int = 1,
                     auto_cublas: bool = True) -> list:
    """Candidates of one backward stage under MEGAMOE_BWD_IMPL. Under auto the Triton configs
    come first, so whatever runs untuned stays Triton; ``auto_cublas`` False: auto offers no
    grouped_mm side (a stage where it never won)."""
    impl = settings.bwd_impl()
    reason = cublas_unsupported_reason(D, H, E)
    if impl == "triton" or (impl == "auto" and reason):
        return triton_cands
    if impl == "cublas":
        if reason:
            raise ValueError(f"{settings.BWD_IMPL}=cublas: {reason}; set {settings.BWD_IMPL}="
                             "triton or auto")
        return [CUBLAS]
    return triton_cands + [CUBLAS] if auto_cublas else triton_cands


def _sm90_offered(block_m: int) -> bool:
    # the csrc/ kernels are offered only at the GPU plan's tile height, and only under auto
    return block_m == BLOCK_M and settings.bwd_impl() == "auto"


# ---------------------------------------------------------------------------- dgrad2_swiglu

# One dgrad GEMM (dy rows @ w2[e], K-dim = D) plus an epilogue that loads the a1/a3 tiles: one
# fp32 accumulator. 128x128 with 4 stages won every run, well ahead of 128x64. TMA applies only
# where the tiles divide D and H; elsewhere the pointer-load config is offered too.
DGRAD2_SWIGLU_CONFIGS = [
    dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, use_tma=True),
]
DGRAD2_SWIGLU_UNEVEN = dict(block_m=128, block_n=64, block_k=32, num_warps=8, num_stages=4,
                            use_tma=False)
# the dh GEMM as csrc/'s N-major row GEMM (w2 read as stored) on gathered dy rows, then the
# SwiGLU backward rows kernel (the grouped_mm side's structure)
DGRAD2_SWIGLU_SM90 = dict(impl="sm90")
# one csrc/ launch (dy rows gathered inside, SwiGLU backward in the epilogue); it stores the dy
# rows it gathers, so dw2 reuses them as after the two-step sides: the usual pick
DGRAD2_SWIGLU_SM90_FUSED = dict(impl="sm90_fused", block_n=256)
INTERPRET_DGRAD2_SWIGLU = dict(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=1,
                               use_tma=True)


def dgrad2_swiglu_sm90_fits(x: torch.Tensor, w2: torch.Tensor, block_m: int) -> bool:
    """Both sm90 sides: the tiles of the dh GEMM fit and the operands are bf16."""
    E, D, H = w2.shape
    return (_sm90_offered(block_m) and x.dtype == w2.dtype == torch.bfloat16
            and sm90_rows.shape_supported(H, D, BLOCK_M) and sm90_usable(x))


def dgrad2_swiglu_triton(D: int, H: int) -> list[dict]:
    if settings.triton_interpreting():
        return [INTERPRET_DGRAD2_SWIGLU]
    cands = DGRAD2_SWIGLU_CONFIGS
    if not any(D % c["block_k"] == 0 and H % c["block_n"] == 0 for c in cands):
        cands = cands + [DGRAD2_SWIGLU_UNEVEN]
    return cands


def dgrad2_swiglu_candidates(x: torch.Tensor, w2: torch.Tensor, block_m: int) -> list[dict]:
    E, D, H = w2.shape
    cands = stage_candidates(dgrad2_swiglu_triton(D, H), D, H, E)
    if dgrad2_swiglu_sm90_fits(x, w2, block_m):
        cands = cands + [DGRAD2_SWIGLU_SM90, DGRAD2_SWIGLU_SM90_FUSED]
    return cands


# ------------------------------------------------------------------ wgrad_dw2 and wgrad_dw13

# 128x128 is the usual pick, 128x256 takes dw2 at 235B. Their TMA loads do not depend on D and H,
# so no pointer-load config is needed.
WGRAD_CONFIGS = [
    dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, use_tma=True),
    dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, use_tma=True),
]
# csrc/'s weight-gradient kernel (longest expert first) on the token operand gathered into the
# row space first (dw2 reuses dgrad2_swiglu's dy rows); its in-kernel gather never won
WGRAD_SM90_PRE_GATHERED = dict(impl="sm90", pre_gathered=True)
INTERPRET_WGRAD = dict(block_m=32, block_n=32, block_k=16, num_warps=1, num_stages=1, use_tma=True)


def wgrad_sm90_fits(x: torch.Tensor, params: tuple, block_m: int) -> bool:
    """bf16 x and contiguous bf16 or fp32 parameters of one dtype (the gradients are written in
    their dtype and layout; a zero-stride stand-in's, moe.py, is contiguous too), and tiles that
    fit D and H."""
    _, H, D = params[0].shape
    return (_sm90_offered(block_m) and x.dtype == torch.bfloat16
            and all(p.dtype == params[0].dtype for p in params)
            and all(p.dtype in (torch.bfloat16, torch.float32)
                    and (p.is_contiguous() or not any(p.stride()))
                    for p in params)
            and sm90_wgrad.shapes_supported(D, H, BLOCK_M) and sm90_usable(x))


def wgrad_triton() -> list[dict]:
    return [INTERPRET_WGRAD] if settings.triton_interpreting() else WGRAD_CONFIGS


def wgrad_candidates(x: torch.Tensor, params: tuple, block_m: int) -> list[dict]:
    """The candidates of wgrad_dw2 and of wgrad_dw13 (each tuned on its own)."""
    E, H, D = params[0].shape
    cands = stage_candidates(wgrad_triton(), D, H, E)
    if wgrad_sm90_fits(x, params, block_m):
        cands = cands + [WGRAD_SM90_PRE_GATHERED]
    return cands


# ----------------------------------------------------------------------------------- dgrad1

# 128x256 is the usual pick, 128x128 wins some runs at both shapes.
DGRAD1_CONFIGS = [
    dict(block_n=128, block_k=64, num_warps=8, num_stages=3, use_tma=True),
    dict(block_n=256, block_k=64, num_warps=8, num_stages=3, use_tma=True),
]
DGRAD1_UNEVEN = dict(block_n=128, block_k=32, num_warps=8, num_stages=4, use_tma=False)
# csrc/'s N-major row GEMM ([da1 | da3] against w1 and w3 as stored): dx in the plan's row space,
# whole tiles, instead of a scatter into slots. The _grouped_mm side is not offered under auto:
# it never won.
DGRAD1_SM90 = dict(impl="sm90")
INTERPRET_DGRAD1 = dict(block_n=32, block_k=16, num_warps=1, num_stages=1, use_tma=True)


def dgrad1_sm90_fits(da: torch.Tensor, w1: torch.Tensor, block_m: int) -> bool:
    E, H, D = w1.shape
    return (_sm90_offered(block_m) and da.dtype == w1.dtype == torch.bfloat16
            and sm90_rows.shape_supported(D, 2 * H, BLOCK_M) and H % sm90_rows.BK == 0
            and sm90_usable(da))


def dgrad1_triton(D: int, H: int) -> list[dict]:
    if settings.triton_interpreting():
        return [INTERPRET_DGRAD1]
    cands = DGRAD1_CONFIGS
    if not any(H % c["block_k"] == 0 and D % c["block_n"] == 0 for c in cands):
        cands = cands + [DGRAD1_UNEVEN]
    return cands


def dgrad1_candidates(da: torch.Tensor, w1: torch.Tensor, block_m: int) -> list[dict]:
    E, H, D = w1.shape
    cands = stage_candidates(dgrad1_triton(D, H), D, H, E, auto_cublas=False)
    if dgrad1_sm90_fits(da, w1, block_m):
        cands = cands + [DGRAD1_SM90]
    return cands


# ------------------------------------------------------------------------------- FP8 GEMMs

# Offline sm_90a compiles (Triton 3.9): plain 128x128 at 8 warps spills nothing, 128x256 a
# little; swiglu spills at 128x128 (two accumulators) and not at 64x128; dgrad2_swiglu's
# epilogue (five quantized stores) spills at its only legal tile, 128x128. Triton waits for each
# 128-K step's wgmma before scaling it into the accumulator, so 4-warp tiles (several CTAs per
# SM, one's promotion under another's MMAs) are offered next to the 8-warp ones. The FP8
# kernels' block_k is fixed at 128 (one scale step).
FP8_GEMM_ROWS_CONFIGS = [  # fp8_gemm2 and fp8_dgrad1
    dict(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=3),
    dict(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3),
    dict(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=4),
    dict(block_m=128, block_n=256, group_m=8, num_warps=8, num_stages=3),
    dict(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4),
    dict(block_m=128, block_n=64, group_m=8, num_warps=4, num_stages=4),
    dict(block_m=64, block_n=256, group_m=8, num_warps=8, num_stages=3),
]
FP8_GEMM1_SWIGLU_CONFIGS = [  # block_n 128: one row scale per tile
    dict(block_m=64, block_n=128, group_m=8, num_warps=8, num_stages=3),
    dict(block_m=64, block_n=128, group_m=8, num_warps=8, num_stages=4),
    dict(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3),
    dict(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4),
    dict(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=3),
]
FP8_DGRAD2_SWIGLU_CONFIGS = [  # 128 x 128 only: one row and one column scale per tile
    dict(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3),
    dict(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=2),
    dict(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=4),
]
# csrc/'s warp-specialized FP8 kernels (producer warpgroup, two consumer warpgroups promoting
# unsynchronized): GEMM 1 + SwiGLU, dgrad2_swiglu, and the row GEMMs on row-space A with a
# bf16 output
FP8_SM90 = dict(impl="sm90", group_m=8)
FP8_DEEPGEMM = dict(impl="deepgemm")  # DeepGEMM picks its own tiles
FP8_INTERPRET = dict(block_m=128, block_n=128, group_m=2, num_warps=1, num_stages=1)


FP8_CONFIGS = {
    "gemm_rows": FP8_GEMM_ROWS_CONFIGS,
    "gemm1_swiglu": FP8_GEMM1_SWIGLU_CONFIGS,
    "dgrad2_swiglu": FP8_DGRAD2_SWIGLU_CONFIGS,
}
"""Per epilogue of kernels/fp8_gemm.py: a plain row GEMM, GEMM 1's SwiGLU, the backward's."""


def fp8_gemm_candidates(epilogue: str, a: torch.Tensor, N: int, K: int, block_m: int,
                        out: torch.Tensor, gather: bool, expert_group: bool = False) -> list[dict]:
    """``epilogue``: a key of FP8_CONFIGS. The csrc/ kernels take the SwiGLU epilogues on
    gathered token rows and the row GEMM on row-space A with a bf16 output. DeepGEMM is not
    offered for one group of experts (``expert_group``): it writes zeros into the rows of the
    experts it skips, which hold the other groups' results."""
    cands = list(FP8_CONFIGS[epilogue])
    swiglu = epilogue != "gemm_rows"
    # the sm90 row GEMM reads row-space A: per-token A is gathered first (fp8_gemm._run)
    sm90_mode = (swiglu and gather) or (not swiglu and out.dtype == torch.bfloat16)
    if sm90_mode and fp8_shape_supported(N, K, block_m) and sm90_usable(a):
        cands.append(FP8_SM90)
    # DeepGEMM: plain GEMMs with a bf16 output (GEMM 1's SwiGLU then runs as a pass)
    plain = epilogue == "gemm1_swiglu" or (epilogue == "gemm_rows" and out.dtype == torch.bfloat16)
    if plain and not expert_group and block_m == FP8_BLOCK_M and deepgemm.available(a):
        cands.append(FP8_DEEPGEMM)
    return cands


# 4-warp tiles run several CTAs per SM (see FP8_GEMM_ROWS_CONFIGS); the first runs untuned
FP8_WGRAD_CONFIGS = [
    dict(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=3),
    dict(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3),
    dict(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4),
    dict(block_m=128, block_n=64, group_m=8, num_warps=4, num_stages=4),
    dict(block_m=128, block_n=256, group_m=8, num_warps=8, num_stages=3),
    dict(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=4),
]


def fp8_wgrad_candidates(at: torch.Tensor, M: int, N: int, out_dtype: torch.dtype) -> list[dict]:
    cands = [c for c in FP8_WGRAD_CONFIGS if M % c["block_m"] == 0 and N % c["block_n"] == 0]
    if sm90_wgrad.fp8_wgrad_supported(M, N, out_dtype) and sm90_usable(at):
        cands.append(FP8_SM90)
    return cands
