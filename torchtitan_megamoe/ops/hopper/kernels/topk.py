"""Router top-k: the indices of the k largest of (scores + bias) per token, in one launch.

Stock TorchTitan's router calls ``torch.topk(scores + expert_bias, k, sorted=False)``, a
single-block radix select that is a noticeable share of the layer's forward at Qwen3 shapes.
Here one program holds BLOCK_T whole rows of scores in registers and takes k arg-max
passes over them.

Order and ties: column j of the result is the j-th largest (descending); among equal values the
lower expert index comes first, NaN counts as larger than any number (torch.topk's rule), so
the result is one of the index sets torch.topk may return. The gating values are not computed
here: the caller gathers them from the unbiased scores, so autograd sees plain torch ops.

topk_gate (eager) goes one step further: the same selection, the gating values, their
normalization and scale, and the tokens per expert in the same launch (_topk_gate_kernel), so
a sigmoid router issues five launches (gate, fp32 cast, sigmoid, the counts' zero fill, this)
instead of eleven before the layer's first big kernel, where the host's issue time is not
hidden (each launch's host time leaves the GPU idle in a waited forward).
topk_softmax_gate (eager softmax routers) also takes the fp32 cast and the softmax into that
launch (SOFTMAX: it reads the gate's raw logits and stores the fp32 scores for the backward), so
those routers issue three (gate, zero fill, this). The backward of both is one launch too
(_topk_gate_bwd_kernel): the gradient of the scores through the gather / normalize / scale,
and for topk_softmax_gate on through the softmax (on the saved fp32 scores) and the cast, where
autograd would run ~12 small kernels.

Tiles: BLOCK_T tokens x BLOCK_E (>= E, power of 2) experts per program, fp32.
Waits on: nothing. Signals: nothing (topk_gate: atomics on the zeroed counts).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.kernels.tiling import cdiv, next_power_of_2

MAX_EXPERTS = 1024
"""Above this a row no longer sits comfortably in one program's registers (torch.topk then)."""


@triton.jit
def _row_scores(s_ptr, bias_ptr, rows, cols, T, E, stride_s, HAS_BIAS: tl.constexpr,
                SOFTMAX: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    """(raw [BLOCK_T, BLOCK_E] fp32 scores, the ranking key: raw + bias with NaN as +inf, which
    ranks above every number as in torch.topk); 0 outside the T x E block.

    SOFTMAX: s_ptr holds logits (any float dtype) and raw is their fp32 softmax over the row's
    E columns as torch.softmax computes it (the row max subtracted, exp, IEEE division by the
    row sum); padding columns take no part (exp(-inf) = 0) and hold 0; a row of -inf only gives
    NaN, as in torch. LIBDEVICE_EXP: libdevice's expf (what torch's CUDA softmax calls, <= 2
    ulp) rather than tl.exp, which compiles to ex2.approx (off by up to ~|x| * 6e-8 relative);
    the interpreter has no libdevice, and its tl.exp is numpy's."""
    in_e = cols < E
    raw = tl.load(s_ptr + rows.to(tl.int64)[:, None] * stride_s + cols[None, :],
                  mask=(rows < T)[:, None] & in_e[None, :], other=0.0).to(tl.float32)
    if SOFTMAX:
        x = tl.where(in_e[None, :], raw, -float("inf"))  # rows past T: 0s, so no NaN there
        z = x - tl.max(x, axis=1)[:, None]
        if LIBDEVICE_EXP:
            ez = libdevice.exp(z)
        else:
            ez = tl.exp(z)
        raw = tl.where(in_e[None, :], tl.math.div_rn(ez, tl.sum(ez, axis=1)[:, None]), 0.0)
    key = raw
    if HAS_BIAS:
        key += tl.load(bias_ptr + cols, mask=in_e, other=0.0).to(tl.float32)[None, :]
    return raw, tl.where(key != key, float("inf"), key)


@triton.jit
def _next_best(key, taken, cols, BLOCK_E: tl.constexpr):
    """(j [BLOCK_T], pick [BLOCK_T, BLOCK_E]): per row the lowest untaken column holding the
    row's best key (-inf rows: the lowest untaken), and that column as a mask."""
    live = tl.where(taken, -float("inf"), key)
    best = tl.max(live, axis=1)
    hit = (live == best[:, None]) & ~taken
    j = tl.min(tl.where(hit, cols[None, :], BLOCK_E), axis=1)
    return j, cols[None, :] == j[:, None]


@triton.jit
def _topk_kernel(s_ptr, bias_ptr, idx_ptr, T, E, stride_s, HAS_BIAS: tl.constexpr,
                 K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    _, key = _row_scores(s_ptr, bias_ptr, rows, cols, T, E, stride_s, HAS_BIAS, False, False)
    taken = (cols[None, :] >= E) | (rows[:, None] < 0)  # [BLOCK_T, BLOCK_E]; padding columns
    for k in tl.static_range(K):
        j, pick = _next_best(key, taken, cols, BLOCK_E)
        tl.store(idx_ptr + rows.to(tl.int64) * K + k, j.to(tl.int64), mask=rows < T)
        taken = taken | pick


@triton.jit
def _topk_gate_kernel(s_ptr, bias_ptr, idx_ptr, val_ptr, cnt_ptr, sm_ptr, T, E, stride_s, scale,
                      HAS_BIAS: tl.constexpr, NORM: tl.constexpr, SOFTMAX: tl.constexpr,
                      LIBDEVICE_EXP: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """_topk_kernel plus what the router does with the choice: the gating values gathered from
    the unbiased scores, normalized over the row (NORM) and scaled, and the tokens per expert
    (integer atomics into cnt: exact, so deterministic). SOFTMAX: s_ptr holds the gate's logits,
    the scores are their fp32 softmax (see _row_scores), also stored to sm_ptr (contiguous
    [T, E] fp32) for the backward."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    ks = tl.arange(0, K_PAD)
    in_t = rows < T
    raw, key = _row_scores(s_ptr, bias_ptr, rows, cols, T, E, stride_s, HAS_BIAS, SOFTMAX,
                           LIBDEVICE_EXP)
    if SOFTMAX:
        tl.store(sm_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], raw,
                 mask=in_t[:, None] & (cols < E)[None, :])
    taken = (cols[None, :] >= E) | (rows[:, None] < 0)
    vals = tl.zeros((BLOCK_T, K_PAD), tl.float32)
    for k in tl.static_range(K):
        j, pick = _next_best(key, taken, cols, BLOCK_E)
        g = tl.sum(tl.where(pick, raw, 0.0), axis=1)
        vals = tl.where(ks[None, :] == k, g[:, None], vals)
        tl.store(idx_ptr + rows.to(tl.int64) * K + k, j.to(tl.int64), mask=in_t)
        taken = taken | pick
    if NORM:
        vals = vals / (tl.sum(vals, axis=1) + 1e-20)[:, None]
    vals = vals * scale
    tl.store(val_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], vals,
             mask=in_t[:, None] & (ks[None, :] < K))
    chosen = taken & (cols < E)[None, :] & in_t[:, None]
    tl.atomic_add(cnt_ptr + cols, tl.sum(chosen.to(tl.int64), axis=0), mask=cols < E)


@triton.jit
def _topk_gate_bwd_kernel(p_ptr, idx_ptr, dv_ptr, out_ptr, T, E, stride_p, scale,
                          NORM: tl.constexpr, SOFTMAX: tl.constexpr, K: tl.constexpr,
                          K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """The router tail's backward in one launch: the formulas autograd ran for stock's gather /
    normalize / scale (and, SOFTMAX, aten's softmax backward) in fp32, its sums in this
    kernel's order (so within fp32 rounding of stock's, not bitwise):
    g = scores[idx], dout = dvals * scale, with NORM dout = (dout - sum(dout * g / den)) / den
    (den = sum g + 1e-20), dscores = dout scattered to the chosen columns (0 elsewhere), and
    SOFTMAX: d(logits) = p * (dscores - sum(dscores * p)) with p the saved fp32 softmax, stored
    in out's dtype. p_ptr: [T, E] fp32, unit column stride; idx, dvals: [T, K] contiguous;
    out: [T, E] contiguous."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    ks = tl.arange(0, K_PAD)
    in_t = rows < T
    tile = in_t[:, None] & (cols < E)[None, :]
    r64 = rows.to(tl.int64)
    p = tl.load(p_ptr + r64[:, None] * stride_p + cols[None, :], mask=tile, other=0.0)
    kmask = in_t[:, None] & (ks < K)[None, :]
    idx = tl.load(idx_ptr + r64[:, None] * K + ks[None, :], mask=kmask, other=-1).to(tl.int32)
    dout = tl.load(dv_ptr + r64[:, None] * K + ks[None, :], mask=kmask, other=0.0) * scale
    if NORM:
        g = tl.zeros((BLOCK_T, K_PAD), tl.float32)
        for k in tl.static_range(K):
            j = tl.sum(tl.where(ks[None, :] == k, idx, 0), axis=1)
            gk = tl.sum(tl.where(cols[None, :] == j[:, None], p, 0.0), axis=1)
            g = tl.where(ks[None, :] == k, gk[:, None], g)
        den = tl.sum(g, axis=1)[:, None] + 1e-20
        dout = (dout - tl.sum(dout * (g / den), axis=1)[:, None]) / den
    ds = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    for k in tl.static_range(K):
        j = tl.sum(tl.where(ks[None, :] == k, idx, 0), axis=1)
        dk = tl.sum(tl.where(ks[None, :] == k, dout, 0.0), axis=1)
        ds = tl.where(cols[None, :] == j[:, None], dk[:, None], ds)
    if SOFTMAX:
        ds = p * (ds - tl.sum(ds * p, axis=1)[:, None])
    tl.store(out_ptr + r64[:, None] * E + cols[None, :], ds.to(out_ptr.dtype.element_ty),
             mask=tile)


def _tile(E: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_E) of the launches here: a whole row of E experts (a power of 2) per
    program and ~4096 scores per program (experiments/topk_variants.py times the other tile
    choices)."""
    block_e = next_power_of_2(E)
    return max(1, min(64, 4096 // block_e)), block_e


def supported(scores: torch.Tensor, k: int) -> bool:
    return (scores.dim() == 2 and 0 < k <= scores.shape[1] <= MAX_EXPERTS
            and scores.dtype in (torch.float32, torch.bfloat16, torch.float16))


def topk_indices(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[T, k] int64 indices of the k largest (scores + bias) per row (see the module docstring):
    the launch behind the router_topk custom op (eager routers call topk_gate instead)."""
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
    BLOCK_T, BLOCK_E = _tile(E)
    _topk_kernel[(cdiv(T, BLOCK_T),)](
        scores, bias if bias is not None else scores, idx, T, E, scores.stride(0),
        HAS_BIAS=bias is not None, K=k, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, num_warps=4,
    )
    return idx


def _launch_gate(scores, k, bias, norm, scale, softmax=False, block_t=None, num_warps=4):
    """(vals, idx, counts, the fp32 softmax of ``scores`` [T, E] with ``softmax`` else None).
    block_t / num_warps: the tile (experiments/topk_variants.py times the choices)."""
    T, E = scores.shape
    idx = torch.empty((T, k), dtype=torch.int64, device=scores.device)
    vals = torch.empty((T, k), dtype=torch.float32, device=scores.device)
    counts = torch.zeros(E, dtype=torch.int64, device=scores.device)
    probs = torch.empty((T, E), dtype=torch.float32, device=scores.device) if softmax else None
    if T == 0:
        return vals, idx, counts, probs
    BLOCK_T, BLOCK_E = _tile(E)
    BLOCK_T = block_t or BLOCK_T
    _topk_gate_kernel[(cdiv(T, BLOCK_T),)](
        scores, bias if bias is not None else scores, idx, vals, counts,
        probs if softmax else vals, T, E, scores.stride(0), float(scale),
        HAS_BIAS=bias is not None, NORM=bool(norm), SOFTMAX=bool(softmax),
        LIBDEVICE_EXP=bool(softmax) and not settings.triton_interpreting(), K=k,
        K_PAD=next_power_of_2(k), BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, num_warps=num_warps,
    )
    return vals, idx, counts, probs


def _gate_backward(scores, idx, dvals, norm, scale, softmax_dtype=None):
    """[T, E] gradient of the fp32 scores from that of the gating values (non-zero at the k
    chosen columns only), as autograd takes it through stock's gather / normalize / scale;
    with ``softmax_dtype`` the scores are the saved softmax and the result is the gradient of
    the logits, in that dtype (aten's softmax backward, then the cast). One launch
    (_topk_gate_bwd_kernel) instead of the ~12 small ones autograd would run."""
    if dvals is None:  # not materialized: only idx or counts reached the loss
        return None
    T, E = scores.shape
    k = idx.shape[1]
    out = torch.empty((T, E), dtype=softmax_dtype or torch.float32, device=scores.device)
    if T == 0:
        return out
    BLOCK_T, BLOCK_E = _tile(E)
    _topk_gate_bwd_kernel[(cdiv(T, BLOCK_T),)](
        scores, idx, dvals.float().contiguous(), out, T, E, scores.stride(0), float(scale),
        NORM=bool(norm), SOFTMAX=softmax_dtype is not None, K=k, K_PAD=next_power_of_2(k),
        BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, num_warps=4,
    )
    return out


class _TopKGate(torch.autograd.Function):
    """(gating values, indices, tokens per expert) of the router from its fp32 scores; the
    gradient flows back to the scores only (at the chosen columns), as through stock's
    gather / normalize / scale."""

    @staticmethod
    def forward(ctx, scores, k, bias, norm, scale):
        vals, idx, counts, _ = _launch_gate(scores, k, bias, norm, scale)
        ctx.save_for_backward(scores, idx)
        ctx.norm, ctx.scale = norm, scale
        ctx.mark_non_differentiable(idx, counts)
        ctx.set_materialize_grads(False)  # no zero fills for idx's and counts' (unused) grads
        return vals, idx, counts

    @staticmethod
    def backward(ctx, dvals, _didx, _dcounts):
        scores, idx = ctx.saved_tensors
        return _gate_backward(scores, idx, dvals, ctx.norm, ctx.scale), None, None, None, None


class _TopKSoftmaxGate(torch.autograd.Function):
    """_TopKGate on softmax(logits.float()) computed in the same launch; the gradient flows
    back to the logits, in their dtype, as through stock's cast and softmax."""

    @staticmethod
    def forward(ctx, logits, k, bias, norm, scale):
        vals, idx, counts, probs = _launch_gate(logits, k, bias, norm, scale, softmax=True)
        ctx.save_for_backward(probs, idx)  # the fp32 scores: an intermediate, not recomputed
        ctx.norm, ctx.scale, ctx.dtype = norm, scale, logits.dtype
        ctx.mark_non_differentiable(idx, counts)
        ctx.set_materialize_grads(False)
        return vals, idx, counts

    @staticmethod
    def backward(ctx, dvals, _didx, _dcounts):
        probs, idx = ctx.saved_tensors
        # stock's softmax backward (fp32, s * (g - sum_j g_j s_j)) and the cast's, in the launch
        dlogits = _gate_backward(probs, idx, dvals, ctx.norm, ctx.scale, softmax_dtype=ctx.dtype)
        return dlogits, None, None, None, None


def _gate_inputs(name, x, k, bias, what, dtypes):
    """x with unit column stride, after the checks topk_gate and topk_softmax_gate share."""
    if not supported(x, k) or x.dtype not in dtypes:
        raise ValueError(
            f"{name}: needs 2-D {what} with 0 < k <= experts <= {MAX_EXPERTS}, got "
            f"{tuple(x.shape)} {x.dtype}, k={k}"
        )
    E = x.shape[1]
    if bias is not None and (bias.shape != (E,) or not bias.is_contiguous()):
        raise ValueError(f"{name}: bias must be a contiguous [{E}] vector, got "
                         f"{tuple(bias.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def topk_gate(scores: torch.Tensor, k: int, bias: torch.Tensor | None, norm: bool,
              scale: float):
    """What TorchTitan's TokenChoiceTopKRouter computes after its scores, in one launch (plus
    the counts' zero fill): (top_scores [T, k] fp32, selected [T, k] int64, tokens per expert
    [E] int64). top_scores = scores[selected] (/ their row sum + 1e-20 with ``norm``) *
    ``scale``; selected as topk_indices (by scores + bias). Differentiable in ``scores``.
    Eager only: a compiled graph uses router_topk and torch ops (see router.py)."""
    scores = _gate_inputs("topk_gate", scores, k, bias, "fp32 scores", (torch.float32,))
    return _TopKGate.apply(scores, k, bias, norm, scale)


def topk_softmax_gate(logits: torch.Tensor, k: int, bias: torch.Tensor | None, norm: bool,
                      scale: float):
    """topk_gate(torch.softmax(logits.float(), dim=1), k, bias, norm, scale) in one launch (plus
    the counts' zero fill): the fp32 cast and the softmax happen in the kernel, which also keeps
    the fp32 scores for the backward. ``logits``: the gate's output [T, E], fp32, bf16 or fp16,
    any row stride. Differentiable in ``logits`` (the gradient comes back in their dtype)."""
    logits = _gate_inputs("topk_softmax_gate", logits, k, bias, "fp32/bf16/fp16 logits",
                          (torch.float32, torch.bfloat16, torch.float16))
    return _TopKSoftmaxGate.apply(logits, k, bias, norm, scale)


@torch.library.custom_op("megamoe::router_topk", mutates_args=())
def router_topk(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """topk_indices as a custom op, so torch.compile keeps it as one opaque call."""
    return topk_indices(scores, k, bias)


@router_topk.register_fake
def _router_topk_fake(scores, k, bias=None):
    return scores.new_empty((scores.shape[0], k), dtype=torch.int64)
