"""What the tuner is offered per stage (CPU): the fallback configs only where the shape needs
them, and no cuBLAS side for kernel C under auto."""

from torchtitan_megamoe.ops.hopper import bf16_backward as bwd
from torchtitan_megamoe.ops.hopper.kernels import grouped_mm as bwd_cublas
from torchtitan_megamoe.ops.hopper.kernels import gemm1_swiglu as g1
from torchtitan_megamoe.ops.hopper.kernels import gemm2 as g2


def test_backward_pointer_configs_only_where_no_tma_config_fits():
    a, c = bwd.with_uneven(bwd.A_CANDIDATES, bwd.C_CANDIDATES, 2048, 768)  # Qwen3-30B
    assert a == bwd.A_CANDIDATES and c == bwd.C_CANDIDATES
    a, c = bwd.with_uneven(bwd.A_CANDIDATES, bwd.C_CANDIDATES, 4096, 1536)  # Qwen3-235B
    assert a == bwd.A_CANDIDATES and c == bwd.C_CANDIDATES
    a, c = bwd.with_uneven(bwd.A_CANDIDATES, bwd.C_CANDIDATES, 2048, 832)  # H % 128 != 0
    assert a == bwd.A_CANDIDATES + [bwd.A_UNEVEN] and c == bwd.C_CANDIDATES
    a, c = bwd.with_uneven(bwd.A_CANDIDATES, bwd.C_CANDIDATES, 2000, 768)  # D % 64 != 0
    assert a[-1] == bwd.A_UNEVEN and c == bwd.C_CANDIDATES + [bwd.C_UNEVEN]
    assert a[0] == bwd.A_CANDIDATES[0], "the untuned default stays first"


def test_auto_without_cublas_side(monkeypatch):
    monkeypatch.delenv(bwd_cublas.IMPL_ENV, raising=False)
    tri = [dict(block_n=64)]
    assert bwd_cublas.stage_candidates(tri, 64, 32, auto_cublas=False) == tri
    monkeypatch.setenv(bwd_cublas.IMPL_ENV, "cublas")  # forced: the cuBLAS side all the same
    assert bwd_cublas.stage_candidates(tri, 64, 32, auto_cublas=False) == [bwd_cublas.CUBLAS]


def test_forward_lists_keep_their_narrow_fallback_last():
    """GEMM 1 and GEMM 2 offer their BLOCK_N 64 config only where no wider tile fits; each
    list starts with the TMA config that runs untuned."""
    for mod, wide in ((g1, 128), (g2, 256)):
        assert mod.GPU_CONFIGS[0]["USE_TMA"] and mod.GPU_CONFIGS[0]["BLOCK_N"] == wide
        assert [c["BLOCK_N"] for c in mod.GPU_CONFIGS].count(64) == 1
        assert mod.GPU_CONFIGS[-1]["BLOCK_N"] == 64
        assert len(mod.SM90_CONFIGS) == 1 and "DEFINES" not in mod.SM90_CONFIGS[0]
