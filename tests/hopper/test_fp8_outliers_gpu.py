"""The hopper backend at precision fp8 / fp8_bwd on inputs with outliers (1% of the tokens scaled
by 20-100x, one channel by 20x: tests/moe_testing.outlier_inputs), against float64: no less
accurate than the reference backend's emulation of the same recipe on the same inputs, with the
same weight-gradient setting (MEGAMOE_FP8_WGRAD). The emulation's own errors on such inputs are
pinned by tests/test_fp8_outliers.py (docs/FP8.md, "FP8 accuracy with outliers").
"""

import pytest
import torch

from moe_testing import RESULT_NAMES as NAMES, op_results, outlier_inputs, rel_err


SHAPE = dict(T=2048, D=512, H=256, E=16, K=4)
CUDA = torch.cuda.is_available()


def _run(inp, backend, precision, exact=False):
    return op_results(inp, precision, backend, exact)


@pytest.fixture(scope="module")
def cases():
    """{kind: (inputs, float64 results)}, made once."""
    out = {}
    for kind in ("plain", "tokens", "both"):
        inp = outlier_inputs(**SHAPE, kind=kind, seed=0, device="cuda")
        out[kind] = (inp, _run(inp, "reference", "bf16", exact=True))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("wgrad", ["0", "1"], ids=["bf16_wgrad", "fp8_wgrad"])
@pytest.mark.parametrize("kind", ["plain", "tokens", "both"])
@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_fp8_outliers_gpu(cases, precision, kind, wgrad, monkeypatch):
    monkeypatch.setenv("MEGAMOE_FP8_WGRAD", wgrad)
    inp, exact = cases[kind]
    got = _run(inp, "hopper", precision)
    emu = _run(inp, "reference", precision)
    for n in NAMES:
        assert torch.isfinite(got[n]).all(), n
        g, e = rel_err(got[n], exact[n]), rel_err(emu[n], exact[n])
        assert g < 1.5 * e + 2e-3, (precision, kind, n, g, e)
