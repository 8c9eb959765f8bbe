"""The expert weights in blockwise FP8 (128 x 128 blocks), in the layouts the FP8 GEMMs read.

    forward   w1, w3 [E, H, D] as stored (GEMM 1 contracts over D)
              w2     [E, D, H] as stored (GEMM 2 contracts over H)
    backward  w2^T        [E, H, D]  (kernel A: dh = dy @ w2[e], contracts over D)
              [w1 | w3]^T [E, D, 2H] (dgrad of linear 1: dx = [da1 | da3] @ [w1; w3], over 2H)
A block's scale serves both uses: the transposed copies carry the same scales, transposed.

Quantized on every call from the bf16 weights (one pass over each weight: read 2 bytes, write
1 per element plus a scale per 16,384 elements), so a quantized copy is never stale, whatever
changed the weights (an optimizer step, a checkpoint load, FSDP's all-gather into reused
storage). docs/PERF.md gives its cost per layer call.
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
class BackwardWeights:
    w2tq: torch.Tensor
    """[E, H, D] e4m3, scales [E, H/128, D/128]."""
    w2ts: torch.Tensor
    w13tq: torch.Tensor
    """[E, D, 2H] e4m3 (w1^T in columns [0, H), w3^T in [H, 2H)), scales [E, D/128, 2H/128]."""
    w13ts: torch.Tensor


def forward_weights(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> ForwardWeights:
    E, H, D = w1.shape
    w1q, w1s = weight_blocks(E, H, D, w1.device)
    w3q, w3s = weight_blocks(E, H, D, w1.device)
    w2q, w2s = weight_blocks(E, D, H, w1.device)
    quant_weight(w1, q=w1q, s=w1s)
    quant_weight(w3, q=w3q, s=w3s)
    quant_weight(w2, q=w2q, s=w2s)
    return ForwardWeights(w1q, w1s, w3q, w3s, w2q, w2s)


def backward_weights(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> BackwardWeights:
    E, H, D = w1.shape
    w2tq, w2ts = weight_blocks(E, D, H, w1.device, transposed_n=D)
    w13tq, w13ts = weight_blocks(E, H, D, w1.device, transposed_n=2 * H)
    quant_weight(w2, qt=w2tq, st=w2ts)
    quant_weight(w1, qt=w13tq, st=w13ts, t_col0=0)
    quant_weight(w3, qt=w13tq, st=w13ts, t_col0=H)
    return BackwardWeights(w2tq, w2ts, w13tq, w13ts)
