"""Suite-wide setup that must happen before any test module imports triton.

Triton decides at import time whether @triton.jit functions run under its CPU interpreter
(TRITON_INTERPRET=1). Test modules outside tests/triton import TorchTitan, which imports triton,
before tests/hopper/conftest.py is loaded in a whole-suite run; without this, triton's own jit
helpers (tl.cdiv, tl.sigmoid) are compiled-mode objects that the interpreted kernels cannot call.
On a CUDA machine nothing is set, so the kernels compile for the GPU.
"""

import os


def _has_cuda() -> bool:
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


if os.environ.get("MEGAMOE_TRITON_INTERPRET") == "1" or not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
