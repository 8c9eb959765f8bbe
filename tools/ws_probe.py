"""Probe whether a GEMM's warp-specialized config compiles and is correct on this GPU.

    python -m tools.ws_probe gemm1_swiglu|gemm2_rows

Runs in its own process because a failing Triton warp-specialization pass may abort the process
(C++ assertion). Exit 0: compiled and matched the reference; the caller then lists the kernel in
MEGAMOE_TRITON_WS so the tuner may consider its warp-specialized candidates.
"""

import sys

import torch

from torchtitan_megamoe.ops import reference
from torchtitan_megamoe.ops.hopper.kernels import gemm1_swiglu, gemm2_rows
from torchtitan_megamoe.ops.hopper.local_forward import forward_ep1


def main(name: str) -> int:
    mods = {"gemm1_swiglu": gemm1_swiglu, "gemm2_rows": gemm2_rows}
    ws = [c for c in mods[name].GPU_CONFIGS if c.get("WARP_SPEC")]
    if not ws:
        return 1
    T, K, E, D, H = 2048, 8, 16, 2048, 768
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    w1 = (torch.randn(E, H, D, device=dev) / D**0.5).bfloat16()
    w3 = (torch.randn(E, H, D, device=dev) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, H, device=dev) / H**0.5).bfloat16()
    ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)])
    w = torch.rand(T, K, device=dev)
    ref = reference.forward(x, ids, w, w1, w2, w3, None, "bf16").float()
    for cfg in ws:
        kw = {"gemm1_config" if name == "gemm1_swiglu" else "gemm2_config": cfg}
        out = forward_ep1(x, ids, w, w1, w2, w3, **kw).float()
        err = float((out - ref).norm() / ref.norm())
        print(f"ws_probe {name} {cfg}: rel err {err:.2e}")
        if not err <= 1e-2:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
