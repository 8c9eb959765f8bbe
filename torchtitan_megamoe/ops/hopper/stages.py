"""The hopper backend's stages as the benchmark sees them: the one way in for bench/.

    forward_stages(x, topk_ids, topk_weights, w1, w2, w3)   the EP=1 bf16 forward's stages
    prepare_backward(dy, x, topk_ids, topk_weights, w1, w2, w3)   -> BackwardInputs
    backward(inputs, saved=True)         the whole EP=1 bf16 backward (what the op runs)
    backward_stages(inputs)              every side of each backward stage
    backward_picks(inputs, side)         the tuner's config per backward stage
    tuner_timings(), tuner_pick(stage, key)   what the tuner measured and chose
    exchange_bytes(group, dim)           memory of an EP group's exchange buffers

A stage is a name (the glossary's, docs/ARCHITECTURE.md; a side's suffix: _grouped_mm, _sm90,
...), a function that runs it once on the prepared inputs (outputs into preallocated buffers
where the op does so, so repeated calls time the stage alone) and its GEMM flops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from torchtitan_megamoe.ops.hopper import heuristics, tiles, tune
from torchtitan_megamoe.ops.hopper.bf16_backward import backward_bf16, tuner_key
from torchtitan_megamoe.ops.hopper.bf16_forward import forward_bf16
from torchtitan_megamoe.ops.hopper.cuda.dgrad2_swiglu import dgrad2_swiglu_sm90
from torchtitan_megamoe.ops.hopper.cuda.gemm_rows import gemm_rows_nmajor_sm90
from torchtitan_megamoe.ops.hopper.cuda.wgrad import wgrad_dw2_sm90, wgrad_dw13_sm90
from torchtitan_megamoe.ops.hopper.sides import dgrad1 as dgrad1_sides
from torchtitan_megamoe.ops.hopper.sides import dgrad2_swiglu as dgrad2_sides
from torchtitan_megamoe.ops.hopper.sides import wgrad as wgrad_sides
from torchtitan_megamoe.ops.hopper.sides.backward import params_ok, shape
from torchtitan_megamoe.ops.hopper.sides.table import available
from torchtitan_megamoe.ops.hopper.ep_transport import exchange_nbytes
from torchtitan_megamoe.ops.hopper.kernels.bwd_combine import bwd_combine
from torchtitan_megamoe.ops.hopper.kernels.combine import combine
from torchtitan_megamoe.ops.hopper.kernels.dgrad1 import dgrad1
from torchtitan_megamoe.ops.hopper.kernels.dgrad2_swiglu import dgrad2_swiglu
from torchtitan_megamoe.ops.hopper.sides.gemm1_swiglu import gemm1_swiglu
from torchtitan_megamoe.ops.hopper.sides.gemm2 import gemm2
from torchtitan_megamoe.ops.hopper.kernels.grouped_mm import (
    dgrad1_grouped_mm, dgrad2_swiglu_grouped_mm, gather_rows, segment_ends,
    wgrad_dw2_grouped_mm, wgrad_dw13_grouped_mm,
)
from torchtitan_megamoe.ops.hopper.kernels.wgrad import longest_first, wgrad
from torchtitan_megamoe.ops.hopper.plan import build_plan

TUNED_BACKWARD_STAGES = ("dgrad2_swiglu", "wgrad_dw2", "wgrad_dw13", "dgrad1")
"""The backward's stages with several sides, by their tuner names."""


@dataclass
class Stage:
    run: Callable[[], object]
    flops: int = 0


def forward_stages(x, topk_ids, topk_weights, w1, w2, w3) -> tuple[dict[str, Stage], dict]:
    """({name: Stage} of plan, gemm1_swiglu, gemm2, combine with the tuner's picks, facts:
    rows_used, max_rows and workspace_bytes of the plan)."""
    E, H, D = w1.shape
    T, K = topk_ids.shape
    block_m = tiles.plan_block_m()
    plan = build_plan(topk_ids, E, block_m)
    h = gemm1_swiglu(x, w1, w3, plan)
    y = gemm2(h, w2, plan)
    gemm = 2 * T * K * D * H
    stages = {
        "plan": Stage(lambda: build_plan(topk_ids, E, block_m)),
        "gemm1_swiglu": Stage(lambda: gemm1_swiglu(x, w1, w3, plan), 2 * gemm),
        "gemm2": Stage(lambda: gemm2(h, w2, plan), gemm),
        "combine": Stage(lambda: combine(y, topk_weights, plan.slot_row, x.dtype)),
    }
    facts = {
        "rows_used": int(plan.num_rows_used),
        "max_rows": plan.max_rows,
        "workspace_bytes": plan.max_rows * H * x.element_size() + y.numel() * y.element_size(),
    }
    return stages, facts


@dataclass
class BackwardInputs:
    """The op's backward arguments, what the forward saved, and the plan."""

    dy: torch.Tensor
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor
    saved: tuple
    plan: object

    @property
    def args(self) -> tuple:
        return (self.dy, self.x, self.topk_ids, self.topk_weights, self.w1, self.w2, self.w3)


def prepare_backward(dy, x, topk_ids, topk_weights, w1, w2, w3) -> BackwardInputs:
    """The forward run with save=True (as the op runs it for training), and its plan."""
    _, saved = forward_bf16(x, topk_ids, topk_weights, w1, w2, w3, save=True)
    plan = build_plan(topk_ids, w1.shape[0], tiles.plan_block_m())
    return BackwardInputs(dy, x, topk_ids, topk_weights, w1, w2, w3, saved, plan)


def backward(inputs: BackwardInputs, saved: bool = True):
    """The whole EP=1 bf16 backward: on the forward's saved tensors, or recomputing them."""
    return backward_bf16(*inputs.args, saved=inputs.saved if saved else None)


def backward_key(inputs: BackwardInputs, side: str) -> tuple:
    """The tuner's key of the backward's stages for these inputs, with MEGAMOE_BWD_IMPL=side."""
    E, H, D = inputs.w1.shape
    return tuner_key(inputs.plan.max_rows, D, H, E, inputs.plan.block_m, side)


def backward_picks(inputs: BackwardInputs, side: str = "triton") -> dict:
    """{stage: config} the tuner chose for a backward run with MEGAMOE_BWD_IMPL=side (run it
    first); the first Triton candidate where it timed nothing (interpreter, one candidate)."""
    E, H, D = inputs.w1.shape
    key = backward_key(inputs, side)
    triton = {"dgrad2_swiglu": heuristics.dgrad2_swiglu_triton(D, H),
              "wgrad_dw2": heuristics.wgrad_triton(), "wgrad_dw13": heuristics.wgrad_triton(),
              "dgrad1": heuristics.dgrad1_triton(D, H)}
    return {stage: tune.picked(stage, key) or cands[0] for stage, cands in triton.items()}


def backward_stages(inputs: BackwardInputs, picks: dict[str, dict]) -> dict[str, Stage]:
    """{name: Stage} of every side of each backward stage, the Triton ones with ``picks``
    (backward_picks), the grouped_mm ones with their gathers, as the tuner times them; the
    parts of the grouped_mm sides alone (gather_dy, gather_x, *_grouped_mm_gemm,
    rows_to_slots); gemm1_swiglu with and without the store of a (the recompute's and the
    forward's cost of saving); sm90 sides only where those kernels run."""
    dy, x, ids, tw, w1, w2, w3 = inputs.args
    plan, a_saved = inputs.plan, inputs.saved[0]
    E, H, D = w1.shape
    T, K = ids.shape
    R = plan.max_rows
    nkdh = T * K * D * H
    cfg_a, cfg_w2 = picks["dgrad2_swiglu"].kwargs(), picks["wgrad_dw2"].kwargs()
    cfg_w13, cfg_c = picks["wgrad_dw13"].kwargs(), picks["dgrad1"].kwargs()
    # None on the GPU: the tuner's pick
    g1_cfg, _ = heuristics.forward_configs(None, None, plan.block_m, D, H)

    da, hw, part = dgrad2_swiglu(dy, a_saved, tw, w2, plan, **cfg_a)
    dw1, dw3, dw2 = torch.empty_like(w1), torch.empty_like(w3), torch.empty_like(w2)
    dx_slot = dgrad1(da, w1, w3, plan, **cfg_c)
    ends = segment_ends(plan)
    x_rows, dy_rows = gather_rows(x, plan), gather_rows(dy, plan)
    da1, da3 = da[:, :H], da[:, H:]

    def dgrad1_gemm():
        out = torch._grouped_mm(da1, w1, offs=ends)
        out += torch._grouped_mm(da3, w3, offs=ends)
        return out

    dx_rows = dgrad1_gemm()

    def wgrad_dw13_triton():
        wgrad(da1, x, dw1, plan, a_gather=False, b_gather=True, **cfg_w13)
        wgrad(da3, x, dw3, plan, a_gather=False, b_gather=True, **cfg_w13)

    def wgrad_triton(a, b, out, a_gather, cfg):
        return lambda: wgrad(a, b, out, plan, a_gather=a_gather, b_gather=not a_gather, **cfg)

    stages = {
        "gemm1_swiglu": Stage(lambda: gemm1_swiglu(x, w1, w3, plan, config=g1_cfg), 4 * nkdh),
        "gemm1_swiglu_save_a": Stage(
            lambda: gemm1_swiglu(x, w1, w3, plan, config=g1_cfg, save_a=True), 4 * nkdh),
        "plan": Stage(lambda: build_plan(ids, E, plan.block_m)),
        "dgrad2_swiglu": Stage(lambda: dgrad2_swiglu(dy, a_saved, tw, w2, plan, **cfg_a),
                               2 * nkdh),
        "dgrad2_swiglu_grouped_mm": Stage(
            lambda: dgrad2_swiglu_grouped_mm(dy, a_saved, tw, w2, plan, dy_rows=dy_rows),
            2 * nkdh),
        "wgrad_dw2": Stage(wgrad_triton(dy, hw, dw2, True, cfg_w2), 2 * nkdh),
        "wgrad_dw1": Stage(wgrad_triton(da1, x, dw1, False, cfg_w13), 2 * nkdh),
        "wgrad_dw3": Stage(wgrad_triton(da3, x, dw3, False, cfg_w13), 2 * nkdh),
        "wgrad_dw13": Stage(wgrad_dw13_triton, 4 * nkdh),
        "wgrad_dw2_grouped_mm": Stage(lambda: wgrad_dw2_grouped_mm(dy, hw, plan, dw2), 2 * nkdh),
        "wgrad_dw13_grouped_mm": Stage(lambda: wgrad_dw13_grouped_mm(da, x, plan, dw1, dw3),
                                       4 * nkdh),
        "gather_dy": Stage(lambda: gather_rows(dy, plan, out=dy_rows)),
        "gather_x": Stage(lambda: gather_rows(x, plan, out=x_rows)),
        "wgrad_dw2_grouped_mm_gemm": Stage(
            lambda: torch._grouped_mm(dy_rows.t(), hw, offs=ends), 2 * nkdh),
        "wgrad_dw13_grouped_mm_gemm": Stage(
            lambda: (torch._grouped_mm(da1.t(), x_rows, offs=ends),
                     torch._grouped_mm(da3.t(), x_rows, offs=ends)), 4 * nkdh),
        "dgrad1": Stage(lambda: dgrad1(da, w1, w3, plan, out=dx_slot, **cfg_c), 4 * nkdh),
        "dgrad1_grouped_mm": Stage(lambda: dgrad1_grouped_mm(da, w1, w3, plan, out=dx_slot),
                                   4 * nkdh),
        "dgrad1_grouped_mm_gemm": Stage(dgrad1_gemm, 4 * nkdh),
        "rows_to_slots": Stage(lambda: torch.index_select(
            dx_rows, 0, plan.slot_row.clamp(min=0), out=dx_slot)),
        "bwd_combine": Stage(lambda: bwd_combine(dx_slot, part, plan, dx_dtype=x.dtype,
                                                 dtw_dtype=tw.dtype)),
    }
    bf16 = x.dtype == w1.dtype == torch.bfloat16

    def offers_sm90(stage, params=True) -> bool:
        s = shape(D, H, E, plan.block_m, bf16, params)
        return any(c.side == "sm90" for c in stage.offer(s, available(x)).candidates)

    if offers_sm90(dgrad1_sides.STAGE):
        dx_rows_sm90 = torch.empty(R, D, dtype=x.dtype, device=x.device)
        stages["dgrad1_sm90"] = Stage(
            lambda: gemm_rows_nmajor_sm90(da, (w1, w3), plan, dx_rows_sm90), 4 * nkdh)
        stages["bwd_combine_rows"] = Stage(
            lambda: bwd_combine(dx_rows_sm90, part, plan, dx_dtype=x.dtype, dtw_dtype=tw.dtype,
                                rows=True))
    if offers_sm90(dgrad2_sides.STAGE):
        stages["dgrad2_swiglu_sm90"] = Stage(
            lambda: dgrad2_sides.sm90_rows_side(dy, a_saved, tw, w2, plan, dy_rows=dy_rows),
            2 * nkdh)
        # with the dy rows stored for wgrad_dw2, as the tuner times it
        stages["dgrad2_swiglu_sm90_fused"] = Stage(
            lambda: dgrad2_swiglu_sm90(dy, a_saved, tw, w2, plan, dy_rows=dy_rows), 2 * nkdh)
    if offers_sm90(wgrad_sides.DW2, params_ok((w1, w2, w3))):
        order = longest_first(plan)
        stages["wgrad_dw2_sm90"] = Stage(lambda: wgrad_dw2_sm90(dy, hw, plan, dw2, order),
                                         2 * nkdh)
        stages["wgrad_dw13_sm90"] = Stage(
            lambda: wgrad_dw13_sm90(da, x, plan, dw1, dw3, order), 4 * nkdh)
        # the same kernels on rows gathered first (the gathers included, as the tuner times it)
        stages["wgrad_dw2_sm90_pre_gathered"] = Stage(
            lambda: wgrad_dw2_sm90(gather_rows(dy, plan, out=dy_rows), hw, plan, dw2, order,
                                   pre_gathered=True), 2 * nkdh)
        stages["wgrad_dw13_sm90_pre_gathered"] = Stage(
            lambda: wgrad_dw13_sm90(da, gather_rows(x, plan, out=x_rows), plan, dw1, dw3,
                                    order, pre_gathered=True), 4 * nkdh)
    return stages


def tuner_timings() -> dict:
    """{(stage, key): [(config as a dict, ms, why rejected or "")]} of every stage the tuner
    timed."""
    return {k: [(c.as_dict(), ms, why) for c, ms, why in v] for k, v in tune.TIMINGS.items()}


def tuner_pick(stage: str, key: tuple) -> dict | None:
    """The config (as a dict) the tuner chose for (stage, key); None where it timed nothing."""
    cfg = tune.picked(stage, key)
    return None if cfg is None else cfg.as_dict()


def exchange_bytes(group, dim: int) -> int:
    """Bytes of the EP exchange buffers of ``group`` for rows of width ``dim`` (outside the
    caching allocator: max_memory_allocated does not see them)."""
    return exchange_nbytes(group, dim)
