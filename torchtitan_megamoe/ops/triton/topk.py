"""Router top-k: the indices of the k largest of (scores + bias) per token, in one launch.

Stock TorchTitan's router calls ``torch.topk(scores + expert_bias, k, sorted=False)``, which
costs ~115 us per call at 16384 tokens x 128 experts on an H200 (the single-block radix select,
measured in docs/perf/2026-11-30_h200_ep1_profile_2a1ace5.log), about 4% of our 30B layer's
forward. Here one program holds BLOCK_T whole rows of scores in registers and takes k arg-max
passes over them.

Order and ties: column j of the result is the j-th largest (descending); among equal values the
lower expert index comes first, NaN counts as larger than any number (torch.topk's rule), so
the result is one of the index sets torch.topk may return. The gating values are not computed
here: the caller gathers them from the unbiased scores, so autograd sees plain torch ops.

Tiles: BLOCK_T tokens x BLOCK_E (>= E, power of 2) experts per program, fp32.
Waits on: nothing. Signals: nothing.
"""

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 1024
"""Above this a row no longer sits comfortably in one program's registers (torch.topk then)."""


@triton.jit
def _topk_kernel(s_ptr, bias_ptr, idx_ptr, T, E, stride_s, HAS_BIAS: tl.constexpr,
                 K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    in_t = rows < T
    in_e = cols < E
    s = tl.load(s_ptr + rows.to(tl.int64)[:, None] * stride_s + cols[None, :],
                mask=in_t[:, None] & in_e[None, :], other=0.0).to(tl.float32)
    if HAS_BIAS:
        s += tl.load(bias_ptr + cols, mask=in_e, other=0.0).to(tl.float32)[None, :]
    s = tl.where(s != s, float("inf"), s)  # NaN ranks above every number, as in torch.topk
    taken = (cols[None, :] >= E) | (rows[:, None] < 0)  # [BLOCK_T, BLOCK_E]; padding columns
    for k in tl.static_range(K):
        live = tl.where(taken, -float("inf"), s)
        best = tl.max(live, axis=1)
        # lowest untaken column holding the row's best value (-inf rows: lowest untaken)
        hit = (live == best[:, None]) & ~taken
        j = tl.min(tl.where(hit, cols[None, :], BLOCK_E), axis=1)
        tl.store(idx_ptr + rows.to(tl.int64) * K + k, j.to(tl.int64), mask=in_t)
        taken = taken | (cols[None, :] == j[:, None])


def topk_indices_reference(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None):
    """The same order in plain torch: a stable descending sort, NaN first."""
    s = scores.float() if bias is None else scores.float() + bias.float()
    s = torch.where(torch.isnan(s), torch.full_like(s, float("inf")), s)
    return torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k]


def supported(scores: torch.Tensor, k: int) -> bool:
    return (scores.dim() == 2 and 0 < k <= scores.shape[1] <= MAX_EXPERTS
            and scores.dtype in (torch.float32, torch.bfloat16, torch.float16))


def topk_indices(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[T, k] int64 indices of the k largest (scores + bias) per row (see the module docstring).
    Eager callers use this directly: the custom op below adds ~20 us of dispatch per call, and
    the router runs before the layer's first big kernel, where host time is not hidden."""
    if not supported(scores, k):
        raise ValueError(
            f"router_topk: needs 2-D float scores with 0 < k <= experts <= {MAX_EXPERTS}, got "
            f"{tuple(scores.shape)} {scores.dtype}, k={k}; use torch.topk"
        )
    T, E = scores.shape
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    if bias is not None and (bias.shape != (E,) or not bias.is_contiguous()):
        raise ValueError(f"router_topk: bias must be a contiguous [{E}] vector, got "
                         f"{tuple(bias.shape)}")
    idx = torch.empty((T, k), dtype=torch.int64, device=scores.device)
    if T == 0:
        return idx
    BLOCK_E = triton.next_power_of_2(E)
    BLOCK_T = max(1, min(64, 4096 // BLOCK_E))
    _topk_kernel[(triton.cdiv(T, BLOCK_T),)](
        scores, bias if bias is not None else scores, idx, T, E, scores.stride(0),
        HAS_BIAS=bias is not None, K=k, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, num_warps=4,
    )
    return idx


@torch.library.custom_op("megamoe::router_topk", mutates_args=())
def router_topk(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """topk_indices as a custom op, so torch.compile keeps it as one opaque call."""
    return topk_indices(scores, k, bias)


@router_topk.register_fake
def _router_topk_fake(scores, k, bias=None):
    return scores.new_empty((scores.shape[0], k), dtype=torch.int64)
