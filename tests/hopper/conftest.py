"""Kernel tests in this directory run under Triton's CPU interpreter unless a GPU is present.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at conftest
import time. On a CUDA machine (the GPU check script) it is left unset so the same kernels
compile for the GPU; set MEGAMOE_TRITON_INTERPRET=1 to force the interpreter anyway.
"""

import os


def _has_cuda() -> bool:
    # Ask the driver without importing torch.cuda machinery that could import triton early.
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


if os.environ.get("MEGAMOE_TRITON_INTERPRET") == "1" or not _has_cuda():
    os.environ["TRITON_INTERPRET"] = "1"
