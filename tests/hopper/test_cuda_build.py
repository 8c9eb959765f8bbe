"""The JIT build of csrc/ (CPU-only machines with nvcc, as CI's, compile it too): the sources
compile for sm_90a, the library exports its entry points, ptxas reports no large spills, and
machines without an sm_90 GPU never pick the CUDA kernels."""

import ctypes
import re

import pytest
import torch

from torchtitan_megamoe.ops.hopper.cuda import build
from torchtitan_megamoe.ops.hopper.cuda.sm90 import sm90_usable
from torchtitan_megamoe.ops.hopper.kernels import gemm1_swiglu as g1
from torchtitan_megamoe.ops.hopper.kernels import gemm2_rows as g2
from torchtitan_megamoe.ops.hopper.plan import build_plan

needs_nvcc = pytest.mark.skipif(build.nvcc_path() is None, reason="needs nvcc")


@needs_nvcc
@pytest.mark.parametrize("defines", [(), ("MEGAMOE_SM90_PRODUCER_FENCE=1", "MEGAMOE_SM90_WGMMA_LAG=1"),
                                     ("MEGAMOE_SM90_WGMMA_LAG=1",),
                                     ("MEGAMOE_SM90_BK=32", "MEGAMOE_SM90_STAGES=8"),
                                     ("MEGAMOE_SM90_TMA_STORE=1", "MEGAMOE_SM90_WGMMA_LAG=1"),
                                     ("MEGAMOE_SM90_TMA_STORE=1", "MEGAMOE_SM90_GEMM1_DEFER=0"),
                                     ("MEGAMOE_SM90_TMA_STORE=1", "MEGAMOE_SM90_EPI_BUFFERS=2",
                                      "MEGAMOE_SM90_STAGES=3")],
                         ids=["default", "knobs", "lag1", "bk32", "tma_store", "tma_store_no_defer",
                              "tma_store_2_buffers"])
def test_gemm1_swiglu_sm90_builds_without_spills(tmp_path, monkeypatch, defines):
    monkeypatch.setenv("MEGAMOE_CUDA_CACHE", str(tmp_path))
    lib_path = build.build("grouped_gemm_sm90", defines)
    lib = ctypes.CDLL(str(lib_path))  # loads without a GPU (cudart binds the driver lazily)
    assert lib.megamoe_gemm1_swiglu and lib.megamoe_gemm_rows and lib.megamoe_error_string
    assert lib.megamoe_wgrad and lib.megamoe_dgrad_swiglu
    log = (lib_path.parent / "build.log").read_text()
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    assert spills and max(spills) <= 64, log  # a few bytes of the producer's row pointers
    # ptxas serializes wgmma batches it cannot prove safe to keep in flight (C7518, e.g. across
    # a branch); with lag 1 that silently turned the pipeline back into wait-for-each-batch
    assert "C7518" not in log and "serialized" not in log, log
    # cached: a second build is the same file, not a recompile; other knobs, another file
    assert build.build("grouped_gemm_sm90", defines) == lib_path
    assert build.build("grouped_gemm_sm90", defines + ("MEGAMOE_SM90_STAGES=3",)) != lib_path


def test_nvcc_missing_names_the_fix(monkeypatch):
    monkeypatch.setattr(build, "nvcc_path", lambda: None)
    with pytest.raises(RuntimeError, match="needs nvcc.*CUDA_HOME"):
        build.build("grouped_gemm_sm90")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only machines")
def test_cpu_never_offers_the_cuda_candidates(monkeypatch):
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    assert not sm90_usable(x)
    calls = []

    def fake(*a, **kw):
        calls.append(1)

    monkeypatch.setattr(g1, "gemm1_swiglu_sm90", fake)
    monkeypatch.setattr(g2, "gemm_rows_sm90", fake)
    ids = torch.tensor([[0], [1], [0], [1]])
    plan = build_plan(ids, 2, 128)
    w = torch.randn(2, 128, 128).bfloat16()
    h = g1.gemm1_swiglu(x, w, w, plan)
    g2.gemm2_rows(h, torch.randn(2, 256, 128).bfloat16(), plan)  # a shape the kernel fits
    assert not calls


def test_prebuilt_builds_cover_every_candidate_and_default():
    """`make cuda-cache` compiles sm90.TUNER_BUILDS ahead of time; a candidate or wrapper
    default outside that set would still be compiled on the GPU machine, in device time."""
    import importlib
    import inspect

    from torchtitan_megamoe.ops.hopper.cuda import dgrad_swiglu, gemm1_swiglu, gemm_rows, wgrad
    from torchtitan_megamoe.ops.hopper.cuda.sm90 import TUNER_BUILDS

    backward = importlib.import_module("torchtitan_megamoe.ops.hopper.backward_pass")  # not the function

    used = {tuple(c.get("DEFINES", ())) for c in g1.SM90_CONFIGS + g2.SM90_CONFIGS}
    used.add(tuple(backward.C_SM90["defines"]))
    wrappers = [dgrad_swiglu.dgrad_l2_swiglu_sm90, gemm1_swiglu.gemm1_swiglu_sm90,
                gemm_rows.gemm_rows_sm90, gemm_rows.gemm_rows_nmajor_sm90,
                wgrad.wgrad_dw2_sm90, wgrad.wgrad_dw13_sm90]
    for fn in wrappers:
        used.add(tuple(inspect.signature(fn).parameters["defines"].default))
    assert used <= set(TUNER_BUILDS), used - set(TUNER_BUILDS)
