"""The hopper backend's side of the FP8 weight copies (ops/fp8_weights.py: their layouts and
container): making them, and handing each FP8 stage the copy it reads.

The module-made ones come out of one quantization pass per weight (one read of each weight
writes the forward and the transposed layout); where only the forward copy is at hand (the FSDP
all-gather's, or ``fp8_keep_transposed = False``) the transposed ones are a byte transpose of it
(kernels/fp8_transpose.py: bitwise what quantizing the weight into the transposed layout gives).

Who makes them. The stage code asks ``forward_weights``, ``w2_transposed`` and ``w13_transposed``
with ``cache``: the layer's ``Fp8Weights`` when the op was given them, else anything falsy.

- Given (``Fp8Weights``, the op's ``fp8_weights`` argument): the module that owns the weights
  (moe.MegaExperts, with ``fp8_weight_cache`` on, the default) made them once per optimizer step
  (at the step's first forward, or in the converter's post-optimizer hook) with
  ``make_fp8_weights`` from the parameters themselves: under a bf16 autocast from the fp32 parameter rounded to bf16 (the bits the op's per-call cast
  would give); under FSDP (``fp8``) from the rank's local shard before the all-gather
  (``quantize_weight``), which then moves the e4m3 copy (fp8_allgather.py). The module compares
  each parameter's identity, version counter and storage with what the copies were made from
  before every call and re-makes them if anything changed outside the optimizer step (a
  checkpoint load, a copy_), so they are never stale. Where only the forward copy is there (what
  the FSDP all-gather brings) the transposed ones are made from it in the backward. With a
  recipe whose ``stand_ins`` hold (``fp8``) the op's w1, w2, w3 are then zero-stride stand-ins:
  read their shapes only.
- Not given (``fp8_weight_cache`` off, a functional ``mega_moe`` call without them, FSDP
  without the FP8 all-gather): quantized here on every call (one pass over each weight: read 2
  bytes, write 1 per element and a scale per 16,384), each copy right before the GEMM that
  reads it.
"""


import torch

from torchtitan_megamoe.ops.fp8_weights import (
    BLOCK, ForwardWeights, Fp8Weights, TransposedWeights,
)
from torchtitan_megamoe.ops.hopper import deepgemm
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import quant_weight, weight_blocks
from torchtitan_megamoe.ops.hopper.kernels.fp8_transpose import transpose_blocks


def dense_weights(cache, *ws) -> tuple:
    """The weights as the stages may read them: contiguous, except where the layer's copies
    are given (``cache``: an Fp8Weights) and a weight is a zero-stride stand-in (moe.py,
    precision fp8), which is never read and would be a full buffer of zeros if made dense."""
    given = isinstance(cache, Fp8Weights)
    return tuple(w if given and not any(w.stride()) else w.contiguous() for w in ws)


def make_fp8_weights(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                     forward: bool = True, transposed: bool = True,
                     dtype: torch.dtype | None = None) -> Fp8Weights:
    """The copies of weights w1, w3 [E, H, D], w2 [E, D, H]: one quantization pass per weight,
    which writes the forward layout and (``transposed``) the transposed one from a single read.
    ``forward=False`` makes the transposed copies only (``fp8_bwd``, whose forward is bf16).
    ``dtype``: the values the op computes with are the weights cast to it (bf16 under
    autocast); the pass rounds an fp32 weight to it as it reads."""
    if not (forward or transposed):
        raise ValueError("make_fp8_weights: asked for neither the forward nor the transposed copies")
    E, H, D = w1.shape
    dev = w1.device
    fwd = w2t = w13t = None
    if forward:
        fwd = ForwardWeights(*_w13_halves(E, H, D, dev), *weight_blocks(E, D, H, dev))
    if transposed:
        w2t = TransposedWeights(*weight_blocks(E, D, H, dev, transposed_n=D))
        w13t = TransposedWeights(*weight_blocks(E, H, D, dev, transposed_n=2 * H))
    for w, fq, fs, t, col in ((w1, "w1q", "w1s", w13t, 0), (w3, "w3q", "w3s", w13t, H),
                              (w2, "w2q", "w2s", w2t, 0)):
        quant_weight(w.contiguous(), q=getattr(fwd, fq, None), s=getattr(fwd, fs, None),
                     qt=None if t is None else t.q, st=None if t is None else t.s, t_col0=col,
                     dtype=dtype)
    return Fp8Weights(fwd, w2t, w13t)


def _w13_halves(E: int, H: int, D: int, device) -> tuple:
    """Empty (w1q, w1s, w3q, w3s). Where DeepGEMM runs, the halves of one [E, 2H, D] copy (and
    its scales): GEMM 1 is then one DeepGEMM launch over [w1; w3] (deepgemm.joined), and our
    kernels, which read each weight contiguous, take contiguous copies of the halves (the tuner
    weighs that in). Else two buffers."""
    if not deepgemm.available(torch.empty(0, device=device)):
        return (*weight_blocks(E, H, D, device), *weight_blocks(E, H, D, device))
    q, s = weight_blocks(E, 2 * H, D, device)
    return q[:, :H], s[:, :H // BLOCK], q[:, H:], s[:, H // BLOCK:]


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s): one weight [E, N, K] in its forward layout (an FSDP shard's copy, moe.py), s
    right after q in one byte buffer (``shard_bytes``: what a one-rank FSDP gather moves)."""
    E, N, K = w.shape
    n, ns = E * N * K, E * (N // BLOCK) * (K // BLOCK)
    buf = torch.empty(n + 4 * ns, dtype=torch.uint8, device=w.device)
    q = buf[:n].view(torch.float8_e4m3fn).view(E, N, K)
    s = buf[n:].view(torch.float32).view(E, N // BLOCK, K // BLOCK)
    quant_weight(w.contiguous(), q=q, s=s)
    return q, s


def shard_bytes(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The one byte buffer holding quantize_weight's q and s (a view, no copy)."""
    if s.data_ptr() != q.data_ptr() + q.nbytes:
        raise ValueError("shard_bytes: q and s are not one buffer (made by quantize_weight?)")
    return q.view(torch.uint8).reshape(-1).new_empty(0).set_(
        q.untyped_storage(), q.storage_offset(), (q.nbytes + s.nbytes,))


def transposed_w2(fwd: ForwardWeights) -> TransposedWeights:
    """w2^T from the forward copy of w2 (a byte transpose: no bf16 read)."""
    E, D, H = fwd.w2q.shape
    q, s = weight_blocks(E, D, H, fwd.w2q.device, transposed_n=D)
    transpose_blocks(fwd.w2q, fwd.w2s, q, s)
    return TransposedWeights(q, s)


def transposed_w13(fwd: ForwardWeights, lo: int = 0, hi: int | None = None) -> TransposedWeights:
    """[w1 | w3]^T of experts [lo, hi) from the forward copies of w1 and w3."""
    E, H, D = fwd.w1q.shape
    hi = E if hi is None else hi
    q, s = weight_blocks(hi - lo, H, D, fwd.w1q.device, transposed_n=2 * H)
    transpose_blocks(fwd.w1q[lo:hi], fwd.w1s[lo:hi], q, s, t_col0=0)
    transpose_blocks(fwd.w3q[lo:hi], fwd.w3s[lo:hi], q, s, t_col0=H)
    return TransposedWeights(q, s)


def forward_weights(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                    cache=None, dtype: torch.dtype | None = None) -> ForwardWeights:
    """``cache``: the layer's Fp8Weights (module docstring), else quantized now. ``dtype``: the
    one the op computes in (x's): weights in another (fp32 parameters under a bf16 autocast,
    precision fp8) are quantized from their values rounded to it, by the quantization pass."""
    if isinstance(cache, Fp8Weights) and cache.fwd is not None:
        return cache.fwd
    return _forward_weights(w1, w2, w3, dtype)


def w2_transposed(w2: torch.Tensor, cache=None,
                  dtype: torch.dtype | None = None) -> TransposedWeights:
    """Without a held copy, made only when fp8_dgrad2_swiglu runs (and freed after it), so the
    two transposed copies are never live together in a backward."""
    if isinstance(cache, Fp8Weights):
        if cache.w2t is not None:
            return cache.w2t
        if cache.fwd is not None:
            return transposed_w2(cache.fwd)
    return _w2_transposed(w2, dtype)


def w13_transposed(w1: torch.Tensor, w3: torch.Tensor, lo: int = 0,
                   hi: int | None = None, cache=None,
                   dtype: torch.dtype | None = None) -> TransposedWeights:
    """Experts [lo, hi) (default: all): a group of experts is the backward's way to hold less
    than the whole copy at once when it is not held (fp8_backward)."""
    hi = w1.shape[0] if hi is None else hi
    if isinstance(cache, Fp8Weights):
        if cache.w13t is not None:
            return TransposedWeights(cache.w13t.q[lo:hi], cache.w13t.s[lo:hi])
        if cache.fwd is not None:
            return transposed_w13(cache.fwd, lo, hi)
    return _w13_transposed(w1[lo:hi], w3[lo:hi], dtype)


def _forward_weights(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                     dtype: torch.dtype | None = None) -> ForwardWeights:
    E, H, D = w1.shape
    w1q, w1s = weight_blocks(E, H, D, w1.device)
    w3q, w3s = weight_blocks(E, H, D, w1.device)
    w2q, w2s = weight_blocks(E, D, H, w1.device)
    quant_weight(w1, q=w1q, s=w1s, dtype=dtype)
    quant_weight(w3, q=w3q, s=w3s, dtype=dtype)
    quant_weight(w2, q=w2q, s=w2s, dtype=dtype)
    return ForwardWeights(w1q, w1s, w3q, w3s, w2q, w2s)


def _w2_transposed(w2: torch.Tensor, dtype: torch.dtype | None = None) -> TransposedWeights:
    E, D, H = w2.shape
    q, sc = weight_blocks(E, D, H, w2.device, transposed_n=D)
    quant_weight(w2, qt=q, st=sc, dtype=dtype)
    return TransposedWeights(q, sc)


def _w13_transposed(w1: torch.Tensor, w3: torch.Tensor,
                    dtype: torch.dtype | None = None) -> TransposedWeights:
    E, H, D = w1.shape
    q, sc = weight_blocks(E, H, D, w1.device, transposed_n=2 * H)
    quant_weight(w1, qt=q, st=sc, t_col0=0, dtype=dtype)
    quant_weight(w3, qt=q, st=sc, t_col0=H, dtype=dtype)
    return TransposedWeights(q, sc)
