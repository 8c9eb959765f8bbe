"""The test suite's one conftest: Triton's interpreter on CPU machines, the shared helpers on
sys.path, and the ``sm90`` marker.

TRITON_INTERPRET. Triton decides at import time whether @triton.jit functions run under its CPU
interpreter, so the variable must be set before anything imports triton: here, when pytest
loads this file, before any test module (they import TorchTitan, which imports triton). Without
a GPU the hopper backend's kernels then run under the interpreter (tests/hopper, and the hopper
cases of tests/*.py); it is forced to 1 there, since the compiled mode cannot run on a CPU. On
a CUDA machine nothing is set, so the same kernels compile for the GPU;
MEGAMOE_TRITON_INTERPRET=1 forces the interpreter there too.

Helpers. Every test file imports what it shares from tests/moe_testing.py (``from moe_testing
import ...``); this folder is put on sys.path for that (pytest's default rootdir-relative
imports would too, this makes it independent of --import-mode).

``sm90``: tests of the csrc/ kernels (moe_testing.SM90_GPU); skipped, when about to run,
unless an sm_90 GPU and nvcc are there (moe_testing.sm90_ready, checked once).
"""

import os
import sys


def _has_cuda() -> bool:
    # Ask the driver without importing torch.cuda machinery that could import triton early.
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


if os.environ.get("MEGAMOE_TRITON_INTERPRET") == "1" or not _has_cuda():
    os.environ["TRITON_INTERPRET"] = "1"

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_configure(config):
    config.addinivalue_line("markers", "sm90: needs an sm_90 GPU and nvcc (skips without)")


def pytest_runtest_setup(item):
    if item.get_closest_marker("sm90") is not None:
        import pytest

        from moe_testing import sm90_ready

        if not sm90_ready():
            pytest.skip("needs an sm_90 GPU and nvcc")
