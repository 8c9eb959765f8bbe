"""The expert weights in blockwise FP8 (128 x 128 blocks), in the layouts the FP8 GEMMs read.

    forward   w1, w3 [E, H, D] as stored (GEMM 1 contracts over D)
              w2     [E, D, H] as stored (GEMM 2 contracts over H)
    backward  w2^T        [E, H, D]  (fp8_dgrad2_swiglu: dh = dy @ w2[e], contracts over D)
              [w1 | w3]^T [E, D, 2H] (fp8_dgrad1: dx = [da1 | da3] @ [w1; w3], over 2H)
A block's scale serves both uses: the transposed copies carry the same scales, transposed.

By default the weights are quantized on every call (one pass over each weight: read 2 bytes,
write 1 per element and a scale per 16,384), so a quantized copy is never stale, whatever
changed the weights (an optimizer step, a checkpoint load, FSDP's all-gather into reused
storage). The pass is bound by HBM bandwidth.

With the cache on (``cache=True``: MegaMoEOptions.fp8_weight_cache, ``[megamoe] fp8_weight_cache``) a
layer's quantized weights are kept until the next optimizer step (``new_weights_step``, the
converter's post-optimizer hook) or until any weight's version counter moves (every in-place
write through PyTorch bumps it: the optimizer, copy_, a checkpoint load), whichever comes
first. An entry holds its weights, so their memory cannot be reused under the cache's key.
Only for weights that nothing rewrites behind the version counter and that reach the op as
themselves: the converter refuses the cache under FSDP, whose all-gather refills reused storage
and restores the counter, and under autocast with a lower-precision dtype, where every call
gets a fresh cast (no hit, and each cast held until the next optimizer step).
"""

from dataclasses import dataclass

import torch

from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import quant_weight, weight_blocks


@dataclass
class ForwardWeights:
    w1q: torch.Tensor
    w1s: torch.Tensor
    w3q: torch.Tensor
    w3s: torch.Tensor
    w2q: torch.Tensor
    w2s: torch.Tensor


@dataclass
class TransposedWeights:
    """w2^T [E, H, D] (fp8_dgrad2_swiglu), or [w1 | w3]^T [E, D, 2H] (fp8_dgrad1: w1^T in
    columns [0, H), w3^T in [H, 2H)), with the blocks' scales transposed alike."""

    q: torch.Tensor
    s: torch.Tensor


_GENERATION = 0
_CACHE: dict = {}


def new_weights_step() -> None:
    """The weights changed (an optimizer step): every cached copy is re-made on next use."""
    global _GENERATION
    _GENERATION += 1
    _CACHE.clear()


def _cached(kind: str, ws: tuple, make, cache: bool):
    if not cache:
        _CACHE.clear()  # the cache turned off holds nothing
        return make()
    if torch.compiler.is_compiling() or (
            torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return make()
    key = (kind,) + tuple((w.data_ptr(), tuple(w.shape), w.dtype, w.device) for w in ws)
    stamp = (_GENERATION,) + tuple(w._version for w in ws)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[2]
    value = make()
    _CACHE[key] = (stamp, ws, value)
    return value


def forward_weights(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                    cache: bool = False) -> ForwardWeights:
    """``cache``: keep the copies until the weights change (see the module docstring)."""
    return _cached("fwd", (w1, w2, w3), lambda: _forward_weights(w1, w2, w3), cache)


def w2_transposed(w2: torch.Tensor, cache: bool = False) -> TransposedWeights:
    """Quantized only when fp8_dgrad2_swiglu runs (and freed after it), so the two transposed
    copies are never live together in a backward."""
    return _cached("w2t", (w2,), lambda: _w2_transposed(w2), cache)


def w13_transposed(w1: torch.Tensor, w3: torch.Tensor, lo: int = 0,
                   hi: int | None = None, cache: bool = False) -> TransposedWeights:
    """Experts [lo, hi) (default: all). Only the whole copy is cached: a group of experts is
    the backward's way to hold less than the whole copy at once (fp8_backward)."""
    hi = w1.shape[0] if hi is None else hi
    if lo == 0 and hi == w1.shape[0]:
        return _cached("w13t", (w1, w3), lambda: _w13_transposed(w1, w3), cache)
    return _w13_transposed(w1[lo:hi], w3[lo:hi])


def _forward_weights(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> ForwardWeights:
    E, H, D = w1.shape
    w1q, w1s = weight_blocks(E, H, D, w1.device)
    w3q, w3s = weight_blocks(E, H, D, w1.device)
    w2q, w2s = weight_blocks(E, D, H, w1.device)
    quant_weight(w1, q=w1q, s=w1s)
    quant_weight(w3, q=w3q, s=w3s)
    quant_weight(w2, q=w2q, s=w2s)
    return ForwardWeights(w1q, w1s, w3q, w3s, w2q, w2s)


def _w2_transposed(w2: torch.Tensor) -> TransposedWeights:
    E, D, H = w2.shape
    q, sc = weight_blocks(E, D, H, w2.device, transposed_n=D)
    quant_weight(w2, qt=q, st=sc)
    return TransposedWeights(q, sc)


def _w13_transposed(w1: torch.Tensor, w3: torch.Tensor) -> TransposedWeights:
    E, H, D = w1.shape
    q, sc = weight_blocks(E, H, D, w1.device, transposed_n=2 * H)
    quant_weight(w1, qt=q, st=sc, t_col0=0)
    quant_weight(w3, qt=q, st=sc, t_col0=H)
    return TransposedWeights(q, sc)
