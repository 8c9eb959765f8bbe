"""The FP8 row GEMMs (kernels/fp8_gemm.py): their sides and the stages' entries.

    triton    kernels/fp8_gemm.py, every epilogue (the reference)
    sm90      csrc/ (cuda/): warp-specialized FP8 kernels (a producer warpgroup, two consumer
              warpgroups promoting unsynchronized): GEMM 1 + SwiGLU and dgrad2_swiglu on the
              gathered token rows, the row GEMM on row-space A with a bf16 output
    deepgemm  deepgemm.py: plain GEMMs with a bf16 output; A gathered into the row space where
              it is per token, GEMM 1's SwiGLU then a pass. Not for one group of experts: it
              writes zeros into the rows of the experts it skips, which hold the other groups'
              results

One table per tuner name: fp8_gemm1_swiglu, fp8_gemm2, fp8_dgrad2, fp8_dgrad1 (row GEMMs of the
forward and backward) and fp8_dgrad2_swiglu (the all-FP8 recipe's fused backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper import deepgemm, heuristics
from torchtitan_megamoe.ops.hopper.cuda.dgrad2_swiglu import fp8_dgrad2_swiglu_sm90
from torchtitan_megamoe.ops.hopper.cuda.gemm1_swiglu import fp8_gemm1_swiglu_sm90
from torchtitan_megamoe.ops.hopper.cuda.gemm_rows import fp8_gemm_rows_sm90
from torchtitan_megamoe.ops.hopper.cuda.sm90 import fp8_shape_supported
from torchtitan_megamoe.ops.hopper.heuristics import FP8_INTERPRET
from torchtitan_megamoe.ops.hopper.tiles import FP8_BLOCK_M
from torchtitan_megamoe.ops.hopper.kernels.fp8_gemm import (
    MODE_DGRAD2_SWIGLU, MODE_GEMM1_SWIGLU, MODE_GEMM_ROWS, fp8_rows_triton,
)
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import FP8, gather_rows, swiglu_quant_rows
from torchtitan_megamoe.ops.hopper.plan import Plan
from torchtitan_megamoe.ops.hopper.configs import DeepGemm, Sm90
from torchtitan_megamoe.ops.hopper.sides.table import Side, Stage, available
from torchtitan_megamoe.ops.hopper.tune import bucket, pick_config, relative_difference

EPILOGUES = {MODE_GEMM_ROWS: "gemm_rows", MODE_GEMM1_SWIGLU: "gemm1_swiglu",
             MODE_DGRAD2_SWIGLU: "dgrad2_swiglu"}
"""Each mode's key of heuristics.FP8_CONFIGS."""


@dataclass(frozen=True)
class Shape:
    epilogue: str  # a key of heuristics.FP8_CONFIGS
    N: int
    K: int
    block_m: int
    out_bf16: bool
    gather: bool  # A is per token, gathered by the plan
    expert_group: bool = False  # B holds one group of the experts


class Operands(NamedTuple):
    mode: int
    a: torch.Tensor
    a_s: torch.Tensor
    b: torch.Tensor
    b_s: torch.Tensor
    plan: Plan
    out: torch.Tensor
    out_s: torch.Tensor | None
    gather: bool
    b2: torch.Tensor | None = None
    b2_s: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    tw: torch.Tensor | None = None
    qt: torch.Tensor | None = None
    qt_s: torch.Tensor | None = None
    ht: torch.Tensor | None = None
    ht_s: torch.Tensor | None = None
    part: torch.Tensor | None = None
    expert_base: int | None = None


def _contiguous(op: Operands) -> Operands:
    """Our kernels read each weight contiguous: the halves of a joined [w1; w3] copy are copied
    (deepgemm.joined; the tuner times that too)."""
    b, b_s, b2, b2_s = (t if t is None else t.contiguous() for t in (op.b, op.b_s, op.b2, op.b2_s))
    return op._replace(b=b, b_s=b_s, b2=b2, b2_s=b2_s)


def _triton(cfg, op: Operands):
    op = _contiguous(op)
    fp8_rows_triton(cfg.kwargs(), *op)


def _row_space(op: Operands, gather: bool) -> tuple:
    """A and its scales in the plan's row space: per-token A gathered by a pass, or as given."""
    return gather_rows(op.a, op.a_s, op.plan) if gather else (op.a, op.a_s)


def _sm90_rows(cfg: Sm90, op: Operands):
    rows, rows_s = _row_space(op, op.gather)
    fp8_gemm_rows_sm90(rows, rows_s, op.b, op.b_s, op.plan, op.out, group_m=cfg.group_m,
                       expert_base=op.expert_base)


def _sm90_gemm1_swiglu(cfg: Sm90, op: Operands):
    x, xs = _row_space(op, cfg.gather_first)
    fp8_gemm1_swiglu_sm90(x, xs, op.b, op.b_s, op.b2, op.b2_s, op.plan, op.out, op.out_s,
                          op.aux, group_m=cfg.group_m, x_rows=cfg.gather_first)


def _sm90_dgrad2_swiglu(cfg: Sm90, op: Operands):
    fp8_dgrad2_swiglu_sm90(op.a, op.a_s, op.b, op.b_s, op.aux, op.tw, op.plan, op.out, op.out_s,
                           op.qt, op.qt_s, op.ht, op.ht_s, op.part, group_m=cfg.group_m)


_SM90 = {MODE_GEMM_ROWS: _sm90_rows, MODE_GEMM1_SWIGLU: _sm90_gemm1_swiglu,
         MODE_DGRAD2_SWIGLU: _sm90_dgrad2_swiglu}
"""The csrc/ entry point of each mode (the row GEMM reads row-space A: per-token A is gathered
first)."""


def _sm90(cfg: Sm90, op: Operands):
    _SM90[op.mode](cfg, _contiguous(op))


def _deepgemm_rows(op: Operands, rows, rows_s, layout):
    deepgemm.gemm_rows(rows, rows_s, op.b, op.b_s, layout, op.out)


def _deepgemm_gemm1_swiglu(op: Operands, rows, rows_s, layout):
    """a = [a1 | a3] from the GEMMs on the same rows, then the SwiGLU quantized per row."""
    plan, b, b_s, b2, b2_s = op.plan, op.b, op.b_s, op.b2, op.b2_s
    N = b.shape[1]
    acts = op.aux if op.aux is not None else torch.empty(
        (plan.max_rows, 2 * N), dtype=torch.bfloat16, device=op.a.device)
    w13 = deepgemm.joined(b, b_s, b2, b2_s)
    if w13 is not None:  # one launch over [w1; w3] writes [a1 | a3]
        deepgemm.gemm_rows(rows, rows_s, *w13, layout, acts)
    else:
        deepgemm.gemm_rows(rows, rows_s, b, b_s, layout, acts[:, :N])
        deepgemm.gemm_rows(rows, rows_s, b2, b2_s, layout, acts[:, N:])
    swiglu_quant_rows(acts, plan, op.out, op.out_s)


_DEEPGEMM = {MODE_GEMM_ROWS: _deepgemm_rows, MODE_GEMM1_SWIGLU: _deepgemm_gemm1_swiglu}
"""The plain GEMM, and the fused epilogue's work as passes around it, per mode."""


def _deepgemm(cfg: DeepGemm, op: Operands):
    """A gathered into the row space where it is per token, then the mode's GEMMs and passes."""
    assert op.mode in _DEEPGEMM and op.expert_base is None, op.mode
    rows, rows_s = _row_space(op, op.gather)
    _DEEPGEMM[op.mode](op, rows, rows_s, deepgemm.grouped_layout(op.plan))


def _sm90_offer(s: Shape, av) -> list:
    swiglu = s.epilogue != "gemm_rows"
    # the sm90 row GEMM reads row-space A: per-token A is gathered first (_sm90)
    mode = (swiglu and s.gather) or (not swiglu and s.out_bf16)
    if not (mode and av.sm90 and fp8_shape_supported(s.N, s.K, s.block_m)):
        return []
    # GEMM 1: the rows gathered inside (cp.async) or by a pass first (TMA): which is faster
    # depends on the shape, so the tuner times both
    firsts = (False, True) if s.epilogue == "gemm1_swiglu" else (False,)
    return [Sm90(group_m=8, gather_first=f) for f in firsts]


def _deepgemm_offer(s: Shape, av) -> list:
    plain = s.epilogue == "gemm1_swiglu" or (s.epilogue == "gemm_rows" and s.out_bf16)
    fits = plain and not s.expert_group and s.block_m == FP8_BLOCK_M and av.deepgemm
    return [DeepGemm()] if fits else []


SIDES = (
    Side("triton", lambda s, av: list(heuristics.FP8_CONFIGS[s.epilogue]), _triton),
    Side("sm90", _sm90_offer, _sm90),
    Side("deepgemm", _deepgemm_offer, _deepgemm),
)
# DeepGEMM was faster than ours at every FP8 GEMM it runs, at both Qwen3 shapes; ours (sm90)
# are faster than the Triton kernels, whose promotions stall the tensor cores
FASTEST_FIRST = ("deepgemm", "sm90", "triton")
STAGES = {name: Stage(name, SIDES, "triton", FASTEST_FIRST)
          for name in ("fp8_gemm1_swiglu", "fp8_gemm2", "fp8_dgrad2", "fp8_dgrad1",
                       "fp8_dgrad2_swiglu")}


def _run(stage: str, op: Operands, config=None, outputs=None):
    table = STAGES[stage]
    a, b, plan = op.a, op.b, op.plan
    E, N, K = b.shape
    assert op.expert_base is None or op.mode == MODE_GEMM_ROWS
    R = plan.max_rows
    assert K % 128 == 0 and N % 128 == 0 and a.shape[1] == K, (a.shape, b.shape)

    def launch(cfg):
        return table.launch(cfg, op)

    def checked():  # what the tuner compares (the used rows: every position written; syncs)
        return outputs() if outputs else (op.out[: int(plan.num_rows_used)],)

    if config is None:
        if settings.triton_interpreting():
            config = FP8_INTERPRET
        else:
            # DeepGEMM on or off (MEGAMOE_DEEPGEMM) offers other candidates: another pick
            key = (bucket(R), N, K, E, plan.block_m, op.gather, op.aux is not None,
                   op.expert_base is not None, deepgemm.available(a))
            shape = Shape(EPILOGUES[op.mode], N, K, plan.block_m,
                          op.out.dtype == torch.bfloat16, op.gather, op.expert_base is not None)
            config = pick_config(table, key, lambda: (shape, available(a)), launch,
                                 outputs=lambda _: checked(), mismatch=relative_difference)
    launch(config)


def fp8_gemm1_swiglu(xq, xs, w1q, w1s, w3q, w3s, plan: Plan, save_a: bool, config=None,
                     a_out: torch.Tensor | None = None):
    """(hq [R_max, H] e4m3, hs [R_max, H/128], a [R_max, 2H] bf16 or None): GEMM 1 + SwiGLU on
    the token rows of xq (gathered by the plan), h quantized per row for GEMM 2. ``a_out``: the
    a to write (with ``save_a``)."""
    E, H, D = w1q.shape
    R = plan.max_rows
    hq = torch.empty((R, H), dtype=FP8, device=xq.device)
    hs = torch.empty((R, H // 128), dtype=torch.float32, device=xq.device)
    a = None
    if save_a:
        a = a_out if a_out is not None else torch.empty((R, 2 * H), dtype=torch.bfloat16,
                                                        device=xq.device)
    op = Operands(MODE_GEMM1_SWIGLU, xq, xs, w1q, w1s, plan, hq, hs, gather=True, b2=w3q,
                  b2_s=w3s, aux=a)
    _run("fp8_gemm1_swiglu", op, config=config,
         outputs=lambda: tuple(t[: int(plan.num_rows_used)]
                               for t in (hq, hs) + ((a,) if save_a else ())))
    return hq, hs, a


def fp8_gemm_rows(aq, a_s, bq, b_s, plan: Plan, out_dtype, gather: bool = False, config=None,
                  expert_base: int | None = None, out: torch.Tensor | None = None,
                  stage: str = "fp8_gemm2"):
    """out [R_max, N] (out_dtype) = rows of aq @ bq[e]^T in the row space; ``stage``: the
    tuner's name (fp8_gemm2, or fp8_dgrad2 / fp8_dgrad1 for the backward's uses). With
    ``expert_base`` e0, bq / b_s hold experts [e0, e0 + E) only and only their rows of ``out``
    (given, or new) are written: one group of a GEMM split by experts."""
    if out is None:
        out = torch.empty((plan.max_rows, bq.shape[1]), dtype=out_dtype, device=aq.device)
    outputs = None
    if expert_base is not None:  # what the tuner compares: this group's rows (syncs)
        def outputs():
            lo, hi = plan.seg_start[[expert_base, expert_base + bq.shape[0]]].tolist()
            return (out[lo:hi],)
    op = Operands(MODE_GEMM_ROWS, aq, a_s, bq, b_s, plan, out, None, gather=gather,
                  expert_base=expert_base)
    _run(stage, op, config=config, outputs=outputs)
    return out


def fp8_dgrad2_swiglu(gq, gs, w2tq, w2ts, a_saved, topk_weights, plan: Plan, config=None):
    """fp8_dgrad2_swiglu (kernels/fp8_gemm.py's dswiglu epilogue). Returns (daq [R, 2H], das
    [R, 2H/128], daTq [2H, R], daTs [2H, R/128], hTq [H, R], hTs [H, R/128], part [H/128, R])."""
    E, H, D = w2tq.shape
    R = plan.max_rows
    dev = gq.device
    daq = torch.empty((R, 2 * H), dtype=FP8, device=dev)
    das = torch.empty((R, 2 * H // 128), dtype=torch.float32, device=dev)
    daTq = torch.empty((2 * H, R), dtype=FP8, device=dev)
    daTs = torch.empty((2 * H, R // 128), dtype=torch.float32, device=dev)
    hTq = torch.empty((H, R), dtype=FP8, device=dev)
    hTs = torch.empty((H, R // 128), dtype=torch.float32, device=dev)
    part = torch.empty((H // 128, R), dtype=torch.float32, device=dev)
    assert hTq.stride(0) == R and daTq.stride(0) == R and hTs.stride(0) == daTs.stride(0)
    used = lambda t: t[: int(plan.num_rows_used)]  # noqa: E731  (rows past them are unwritten)
    op = Operands(MODE_DGRAD2_SWIGLU, gq, gs, w2tq, w2ts, plan, daq, das, gather=True,
                  aux=a_saved, tw=topk_weights.reshape(-1).float(), qt=daTq, qt_s=daTs, ht=hTq,
                  ht_s=hTs, part=part)
    _run("fp8_dgrad2_swiglu", op, config=config,
         outputs=lambda: (used(daq), used(das), part.sum(0)[: int(plan.num_rows_used)]))
    return daq, das, daTq, daTs, hTq, hTs, part
