"""The op's settings: one frozen, validated object that travels from the caller (the converter,
or mega_moe()'s keyword arguments) through the op to the backend's forward and backward."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "hopper", "reference")
PRECISIONS = ("bf16", "fp8", "fp8_bwd")
SAVE_MODES = ("keep", "never")


@dataclass(frozen=True)
class MegaMoEOptions:
    backend: str = "auto"
    """``auto`` (the Hopper kernels on SM90 GPUs, else reference), ``hopper`` or ``reference``."""
    precision: str = "bf16"
    """``bf16``, ``fp8`` (blockwise FP8 forward and backward) or ``fp8_bwd`` (BF16 forward, FP8
    backward)."""
    save_activations: str = "keep"
    """``keep``: the forward keeps what its backward can reuse; ``never``: the backward
    recomputes (less memory, more time)."""
    max_tokens_per_rank: int = 0
    """EP capacity: the most tokens any rank of the group sends per call (sizes the receive
    buffers); 0 = from this call's tokens."""
    fp8_weight_cache: bool = False
    """Keep each layer's FP8 weight copies until the next optimizer step."""

    def __post_init__(self):
        for name, kind in (("backend", str), ("precision", str), ("save_activations", str),
                           ("max_tokens_per_rank", int), ("fp8_weight_cache", bool)):
            value = getattr(self, name)
            # bool is an int in Python: refuse True as a token count
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise TypeError(
                    f"mega_moe: {name}={value!r} is a {type(value).__name__}, expected "
                    f"{kind.__name__}"
                )
        for name, allowed in (("backend", BACKENDS), ("precision", PRECISIONS),
                              ("save_activations", SAVE_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"mega_moe: unknown {name} {getattr(self, name)!r}; choose one of "
                    f"{', '.join(allowed)}"
                )
        if self.max_tokens_per_rank < 0:
            raise ValueError(
                f"mega_moe: max_tokens_per_rank={self.max_tokens_per_rank} must be >= 0 "
                "(0: sized from each call's tokens)"
            )
