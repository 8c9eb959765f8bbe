"""The expert weights' FP8 copies (128 x 128 blocks, e4m3, fp32 scales) as the op takes them,
independent of the backend that makes and reads them: the layouts, the container that travels
through the op (``fp8_weights``, a ``Tensor?[]`` of both registered ops), and their values
(``dequantized``). The hopper backend quantizes them (ops/hopper/fp8_weights.py); moe.MegaExperts
owns them; api.mega_moe checks them.

    forward   w1, w3 [E, H, D] as stored (GEMM 1 contracts over D)
              w2     [E, D, H] as stored (GEMM 2 contracts over H)
    backward  w2^T        [E, H, D]  (fp8_dgrad2_swiglu: dh = dy @ w2[e], contracts over D)
              [w1 | w3]^T [E, D, 2H] (fp8_dgrad1: dx = [da1 | da3] @ [w1; w3], over 2H)
A block's scale serves both uses: the transposed copies carry the same scales, transposed.

Which copies a layer keeps is its recipe's (Recipe.kept_copies): ``fp8`` the forward copies,
3·E·H·D bytes, plus the transposed copies, 3·E·H·D bytes, as much as the layer's bf16 expert
weights (Qwen3-30B-A3B: 1.2 GB per layer; scales add 1/4096); ``fp8_keep_transposed = False``
the forward ones only; ``fp8_bwd`` the transposed copies only, half that. Under the FP8
all-gather a rank keeps its shard's forward copies (3·E·H·D / FSDP degree bytes) and nothing
else between calls. When: from the layer's forward to the end of its backward
(``fp8_free_after_backward``, the default), or from one optimizer step to the next.
"""

from dataclasses import dataclass

import torch

from torchtitan_megamoe.ops.recipe import SCALE_BLOCK

BLOCK = SCALE_BLOCK
FP8 = torch.float8_e4m3fn


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


@dataclass
class Fp8Weights:
    """One layer's FP8 expert weights as their owner made them (module docstring): the forward
    copies, and the transposed ones where held. Travels through the op as a list of tensors
    (``tensors`` / ``from_tensors``: None where a part is not held)."""

    fwd: ForwardWeights | None
    w2t: TransposedWeights | None = None
    w13t: TransposedWeights | None = None

    SLOTS = 10

    def tensors(self) -> list:
        fwd = ([self.fwd.w1q, self.fwd.w1s, self.fwd.w3q, self.fwd.w3s, self.fwd.w2q,
                self.fwd.w2s] if self.fwd is not None else [None] * 6)
        return (fwd + ([self.w2t.q, self.w2t.s] if self.w2t is not None else [None, None])
                + ([self.w13t.q, self.w13t.s] if self.w13t is not None else [None, None]))

    @classmethod
    def from_tensors(cls, ts) -> "Fp8Weights | None":
        """The inverse of ``tensors``; None for an empty list (no copies given)."""
        if not ts:
            return None
        if len(ts) != cls.SLOTS:
            raise ValueError(f"mega_moe: fp8_weights must hold {cls.SLOTS} tensors, got {len(ts)}")
        fwd = ForwardWeights(*ts[:6]) if ts[0] is not None else None
        w2t = TransposedWeights(*ts[6:8]) if ts[6] is not None else None
        w13t = TransposedWeights(*ts[8:10]) if ts[8] is not None else None
        return cls(fwd, w2t, w13t)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors() if t is not None)

    def check(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Raise, naming the part, if a copy does not fit weights w1 [E, H, D], w2 [E, D, H]."""
        E, H, D = w1.shape
        want = {}
        if self.fwd is not None:
            f = self.fwd
            want.update(w1q=(f.w1q, (E, H, D)), w3q=(f.w3q, (E, H, D)), w2q=(f.w2q, (E, D, H)),
                        w1s=(f.w1s, (E, H // BLOCK, D // BLOCK)),
                        w3s=(f.w3s, (E, H // BLOCK, D // BLOCK)),
                        w2s=(f.w2s, (E, D // BLOCK, H // BLOCK)))
        if self.w2t is not None:
            want.update(w2t_q=(self.w2t.q, (E, H, D)),
                        w2t_s=(self.w2t.s, (E, H // BLOCK, D // BLOCK)))
        if self.w13t is not None:
            want.update(w13t_q=(self.w13t.q, (E, D, 2 * H)),
                        w13t_s=(self.w13t.s, (E, D // BLOCK, 2 * H // BLOCK)))
        if not want:
            raise ValueError("mega_moe: fp8_weights holds no copy; pass None instead")
        for name, (t, shape) in want.items():
            dtype = torch.float32 if name.endswith("s") else FP8
            if tuple(t.shape) != shape or t.dtype != dtype or t.device != w1.device:
                raise ValueError(
                    f"mega_moe: fp8_weights {name} is {tuple(t.shape)} {t.dtype} on {t.device}, "
                    f"expected {shape} {dtype} on {w1.device} (experts {E}, hidden {H}, dim {D})"
                )


def dequantized(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [E, N, K] e4m3 times its block scales, in ``dtype``: the values FP8 GEMMs multiply
    (for a backend that takes real weights where only the FP8 copy was gathered)."""
    scale = s.repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
    return (q.to(torch.float32) * scale).to(dtype)
