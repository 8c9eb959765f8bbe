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
from torchtitan_megamoe.ops.hopper.kernels import gemm2 as g2
from torchtitan_megamoe.ops.hopper.plan import build_plan

needs_nvcc = pytest.mark.skipif(build.nvcc_path() is None, reason="needs nvcc")


@needs_nvcc
def test_grouped_gemm_sm90_builds_without_spills(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAMOE_CUDA_CACHE", str(tmp_path))
    lib_path = build.build("grouped_gemm_sm90")
    lib = ctypes.CDLL(str(lib_path))  # loads without a GPU (cudart binds the driver lazily)
    assert lib.megamoe_gemm1_swiglu and lib.megamoe_gemm_rows and lib.megamoe_error_string
    assert lib.megamoe_wgrad and lib.megamoe_dgrad_swiglu
    log = (lib_path.parent / "build.log").read_text()
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    assert spills and max(spills) <= 64, log  # a few bytes of the producer's row pointers
    # ptxas serializes wgmma batches it cannot prove safe to keep in flight (C7518, e.g. across
    # a branch: the deferred stores are predicated for this reason); that silently turns the
    # pipeline into wait-for-each-batch
    assert "C7518" not in log and "serialized" not in log, log
    # cached: a second build is the same file, not a recompile
    mtime = lib_path.stat().st_mtime_ns
    assert build.build("grouped_gemm_sm90") == lib_path and lib_path.stat().st_mtime_ns == mtime


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
    g2.gemm2(h, torch.randn(2, 256, 128).bfloat16(), plan)  # a shape the kernel fits
    assert not calls
