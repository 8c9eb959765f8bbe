"""torchtitan-megamoe: one fused, overlapped MoE op for TorchTitan.

``mega_moe`` is the functional op (see ``torchtitan_megamoe.ops.api``). The TorchTitan
integration lives in ``config`` (TOML section + converter registration), ``converter``, ``moe``
and ``parallel``; importing this package does not import TorchTitan.
"""

from torchtitan_megamoe.ops.api import mega_moe

__all__ = ["mega_moe"]
