"""The JIT build of csrc/ (CPU-only machines with nvcc, as CI's, compile it too): every kernel
family's source compiles for sm_90a into its own library, the library exports its bf16 and FP8
entry points, ptxas reports no large spills, and machines without an sm_90 GPU never pick the
CUDA kernels."""

import ctypes
import re

import pytest
import torch

from torchtitan_megamoe.ops.hopper.cuda import build
from torchtitan_megamoe.ops.hopper.cuda.params import ENTRY_POINTS
from torchtitan_megamoe.ops.hopper.cuda.sm90 import sm90_usable
from torchtitan_megamoe.ops.hopper.sides import gemm1_swiglu as g1
from torchtitan_megamoe.ops.hopper.sides import gemm2 as g2
from torchtitan_megamoe.ops.hopper.plan import build_plan

needs_nvcc = pytest.mark.skipif(build.nvcc_path() is None, reason="needs nvcc")


def test_every_family_has_a_source_and_entry_points():
    assert set(ENTRY_POINTS) == set(build.FAMILIES)
    for family in build.FAMILIES:
        assert (build.CSRC / f"{family}.cu").is_file()
    # each family: one bf16 entry point and its FP8 ones (dgrad2_swiglu: two output forms)
    for family, entries in ENTRY_POINTS.items():
        fp8 = [e for e in entries if e.startswith("megamoe_fp8_")]
        assert len(entries) - len(fp8) == 1 and len(fp8) == (2 if family == "dgrad2_swiglu" else 1)


def test_the_cache_key_covers_every_header(tmp_path, monkeypatch):
    assert {p.name for p in build.headers()} >= {"launch_params.h", "ring.cuh", "ptx.cuh"}
    src = tmp_path / "csrc"
    (src / "include" / "sub").mkdir(parents=True)
    (src / "gemm_rows.cu").write_text("// source\n")
    header = src / "include" / "sub" / "deep.cuh"
    header.write_text("// one\n")
    monkeypatch.setattr(build, "CSRC", src)
    version = "echo"  # stands in for `nvcc --version`: the key needs no toolkit
    key = build._cache_key(src / "gemm_rows.cu", version)
    assert build._cache_key(src / "gemm_rows.cu", version) == key
    header.write_text("// two\n")
    assert build._cache_key(src / "gemm_rows.cu", version) != key


@needs_nvcc
@pytest.mark.parametrize("family", build.FAMILIES)
def test_family_builds_without_spills(family, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAMOE_CUDA_CACHE", str(tmp_path))
    lib_path = build.build(family)
    lib = ctypes.CDLL(str(lib_path))  # loads without a GPU (cudart binds the driver lazily)
    assert lib.megamoe_error_string
    for entry in ENTRY_POINTS[family]:
        assert getattr(lib, entry)
    log = (lib_path.parent / "build.log").read_text()
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    assert spills and max(spills) <= 64, log  # a few bytes of the producer's row pointers
    # ptxas serializes wgmma batches it cannot prove safe to keep in flight (C7518, e.g. across
    # a branch: the deferred stores are predicated for this reason); that silently turns the
    # pipeline into wait-for-each-batch
    assert "C7518" not in log and "serialized" not in log, log
    # cached: a second build is the same file, not a recompile
    mtime = lib_path.stat().st_mtime_ns
    assert build.build(family) == lib_path and lib_path.stat().st_mtime_ns == mtime


def test_nvcc_missing_names_the_fix(monkeypatch):
    monkeypatch.setattr(build, "nvcc_path", lambda: None)
    with pytest.raises(RuntimeError, match="needs nvcc.*CUDA_HOME"):
        build.build("gemm1_swiglu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only machines")
def test_cpu_never_offers_the_cuda_candidates(monkeypatch):
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    assert not sm90_usable(x)
    calls = []

    def fake(*a, **kw):
        calls.append(1)

    monkeypatch.setattr(g1.sm90_gemm1, "gemm1_swiglu_sm90", fake)
    monkeypatch.setattr(g2.sm90_rows, "gemm_rows_sm90", fake)
    ids = torch.tensor([[0], [1], [0], [1]])
    plan = build_plan(ids, 2, 128)
    w = torch.randn(2, 128, 128).bfloat16()
    h = g1.gemm1_swiglu(x, w, w, plan)
    g2.gemm2(h, torch.randn(2, 256, 128).bfloat16(), plan)  # a shape the kernel fits
    assert not calls
