"""The ``[megamoe]`` TOML section's entry point for TorchTitan.

Point TorchTitan at this module with ``[job] custom_config_module =
"torchtitan_megamoe.config"``: TorchTitan imports it while it parses the TOML and merges the
``JobConfig`` below into its own, so ``[megamoe]`` keys (``settings.MegaMoEConfig``) and
``--megamoe.<field>`` CLI overrides work. Importing this module also registers the ``megamoe``
model converter, so ``[model] converters = ["megamoe"]`` switches the fused op on; leaving it
out gives the stock run (the A/B switch).
"""

from dataclasses import dataclass, field

# Registration by import, as TorchTitan's own converters do: importing this module is enough
# for a TOML to use the CPU shims, the flavors and the converter (the shims first).
from torchtitan_megamoe import cpu, flavors, flavors_gpu  # noqa: F401
from torchtitan_megamoe import converter  # noqa: F401
from torchtitan_megamoe.settings import MegaMoEConfig


@dataclass
class JobConfig:
    megamoe: MegaMoEConfig = field(default_factory=MegaMoEConfig)
    """The fused op's settings (torchtitan_megamoe.settings.MegaMoEConfig)."""
