"""Compile the backward kernels for sm_90a without a GPU and report registers and spills.

    python -m tools.compile_check [--all]

Runs on a CPU-only machine (TRITON_INTERPRET must be unset): Triton lowers each kernel at the
GPU tuner's configurations (``--all``: every candidate, else the first of each list) to PTX,
and the ptxas shipped with Triton reports registers, spills, and how many wgmma / TMA
instructions the kernel uses. Catches compile errors and register blow-ups before a GPU run;
timings still need the GPU (python -m torchtitan_megamoe.bench.backward_stages).
"""

import argparse
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.heuristics import (
    DGRAD1_CONFIGS, DGRAD2_SWIGLU_CONFIGS, WGRAD_CONFIGS,
)
from torchtitan_megamoe.ops.hopper.tiles import BLOCK_M
from torchtitan_megamoe.ops.hopper.kernels import bwd_combine, dgrad1, dgrad2_swiglu, wgrad

BF16 = "*bf16"


def _desc(shape):
    return f"tensordesc<bf16[{shape[0]}, {shape[1]}]>"


def _ptxas_report(ptx: str) -> str:
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        last = ""
        # The plain ptxas may be older than the PTX version Triton emits; try both.
        for exe in ("ptxas", "ptxas-blackwell"):
            path = os.path.join(bindir, exe)
            if not os.path.exists(path):
                continue
            r = subprocess.run([path, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                               capture_output=True, text=True)
            last = r.stderr
            if r.returncode == 0:
                lines = [ln.split(":", 1)[-1].strip() for ln in r.stderr.splitlines()
                         if "spill" in ln or "Used" in ln]
                return "; ".join(lines)
        return "ptxas failed: " + last.strip()[-200:]
    finally:
        os.unlink(f.name)


def compile_one(fn, types, constexprs, num_warps, num_stages):
    sig = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in fn.arg_names}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = k.asm["ptx"]
    return (f"smem {k.metadata.shared} B, wgmma {ptx.count('wgmma.mma_async')}, "
            f"tma {ptx.count('cp.async.bulk.tensor')}; {_ptxas_report(ptx)}")


def _dgrad2_swiglu(cfg):
    bm, bn, bk, tma = cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg.get("use_tma", False)
    types = {n: BF16 for n in ("dy_ptr", "w2_ptr", "da_ptr", "hw_ptr", "a_ptr")}
    types.update(tw_ptr="*fp32", row_slot_ptr="*i32", tile_expert_ptr="*i32", part_ptr="*fp32")
    rows = _desc((bm, bn)) if tma else BF16
    types.update(w2_desc=_desc((bk, bn)) if tma else BF16, a_desc=rows, da_desc=rows,
                 hw_desc=rows)
    consts = dict(PLAN_BM=BLOCK_M, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN=True, USE_TMA=tma,
                  UPCAST=False)
    return dgrad2_swiglu._dgrad2_swiglu_kernel, types, consts


def _wgrad(cfg, a_gather):
    bm, bn, bk, tma = cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg.get("use_tma", False)
    a_tma, b_tma = tma and not a_gather, tma and a_gather
    types = dict(a_ptr=BF16, b_ptr=BF16, out_ptr=BF16, seg_start_ptr="*i32", count_ptr="*i32",
                 row_slot_ptr="*i32", order_ptr="*i32",
                 a_desc=_desc((bk, bm)) if a_tma else BF16, b_desc=_desc((bk, bn)) if b_tma else BF16)
    consts = dict(A_GATHER=a_gather, B_GATHER=not a_gather, A_TMA=a_tma, B_TMA=b_tma,
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN=True, UPCAST=False)
    return wgrad._wgrad_kernel, types, consts


def _dgrad1(cfg):
    bn, bk, tma = cfg["block_n"], cfg["block_k"], cfg.get("use_tma", False)
    types = dict(da_ptr=BF16, w1_ptr=BF16, w3_ptr=BF16, out_ptr=BF16, row_slot_ptr="*i32",
                 tile_expert_ptr="*i32", w1_desc=_desc((bk, bn)) if tma else BF16,
                 w3_desc=_desc((bk, bn)) if tma else BF16)
    consts = dict(BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, EVEN=True, USE_TMA=tma, UPCAST=False)
    return dgrad1._dgrad1_kernel, types, consts


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--all", action="store_true", help="every tuner candidate")
    args = p.parse_args()
    if settings.triton_interpreting():
        raise SystemExit("unset TRITON_INTERPRET: this compiles for the GPU")
    # the launchers' keyword form of each typed config
    pick = (lambda c: [x.kwargs() for x in (c if args.all else c[:1])])
    jobs = []
    for cfg in pick(DGRAD2_SWIGLU_CONFIGS):
        jobs.append((f"dgrad2_swiglu {cfg}", _dgrad2_swiglu(cfg), cfg))
    for cfg in pick(WGRAD_CONFIGS):
        jobs.append((f"wgrad_dw2 {cfg}", _wgrad(cfg, True), cfg))
        jobs.append((f"wgrad_dw13 {cfg}", _wgrad(cfg, False), cfg))
    for cfg in pick(DGRAD1_CONFIGS):
        jobs.append((f"dgrad1 {cfg}", _dgrad1(cfg), cfg))
    comb = (bwd_combine._bwd_combine_kernel,
            dict(dx_slot_ptr=BF16, part_ptr="*fp32", slot_row_ptr="*i32", dx_ptr=BF16,
                 dtw_ptr="*fp32"),
            dict(TOPK=8, NUM_PART=12, BLOCK_T=8, BLOCK_D=256))
    jobs.append(("bwd_combine K=8", comb, dict(num_warps=4, num_stages=1)))
    print(f"triton {triton.__version__}, target sm_90a")
    for name, (fn, types, consts), cfg in jobs:
        try:
            report = compile_one(fn, types, consts, cfg["num_warps"], cfg["num_stages"])
        except Exception as err:  # report every kernel, not just the first failure
            report = f"COMPILE FAILED: {err!r}"[:400]
        print(f"{name}: {report}", flush=True)


if __name__ == "__main__":
    main()
