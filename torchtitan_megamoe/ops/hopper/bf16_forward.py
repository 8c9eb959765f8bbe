"""EP=1 forward: plan -> GEMM 1 + SwiGLU -> GEMM 2 (row space) -> combine.

Workspace per call (freed by the caching allocator afterwards): h [R_max, H] and
y [R_max, D] in x.dtype, plus O(T*K) int32 plan vectors. R_max = T*K + E*(block_m-1) rounded up
to block_m, an exact static bound, so no routing can overflow at EP=1.

With ``save=True`` (what the op does for autograd) two tensors outlive the call until the
backward: a = [a1 | a3] [R_max, 2H] in x.dtype (GEMM 1's pre-activations, stored by its epilogue)
and the plan packed into one int32 vector (plan.pack_plan, R_max + T*K + R_max/block_m + 2E + 1
entries). At T=16384, K=8, E=128, block_m=128 (R_max = 147,328): a is 432 MiB at the 30B shape
(H=768), 864 MiB at 235B (H=1536); the packed plan 1.1 MiB (docs/ARCHITECTURE.md, "Memory of the
bf16 backward", compares with stock).
"""

import torch

from torchtitan_megamoe.ops.hopper.heuristics import forward_configs
from torchtitan_megamoe.ops.hopper.tiles import plan_block_m
from torchtitan_megamoe.ops.options import ids_range_message
from torchtitan_megamoe.ops.hopper.kernels.combine import combine
from torchtitan_megamoe.ops.hopper.sides.gemm1_swiglu import gemm1_swiglu
from torchtitan_megamoe.ops.hopper.sides.gemm2 import gemm2
from torchtitan_megamoe.ops.hopper.plan import build_plan, max_rows, pack_plan, packed_plan_numel


def forward_bf16(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    block_m: int | None = None,
    gemm1_config: dict | None = None,
    gemm2_config: dict | None = None,
    save: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """out [T, D]; with ``save``, (out, saved) where saved = (a, packed_plan) is what
    bf16_backward.backward_bf16(..., saved=saved) reads instead of recomputing GEMM 1 and the
    plan. A saved tuple is only valid with the default block_m (the backward's)."""
    if x.shape[0] == 0:
        # No tokens: nothing to plan or launch (EP=1 only: an EP rank without tokens still
        # takes part in the exchange, ep_forward.py). saved_like's T = 0 shapes: empty.
        out = x.new_zeros(x.shape)
        return (out, tuple(saved_like(x, topk_ids, w1))) if save else out
    block_m = block_m or plan_block_m()
    gemm1_config, gemm2_config = forward_configs(gemm1_config, gemm2_config, block_m,
                                                 w1.shape[2], w1.shape[1])
    x = x.contiguous()
    w1, w2, w3 = w1.contiguous(), w2.contiguous(), w3.contiguous()
    E = w1.shape[0]
    plan = checked_plan(topk_ids, E, block_m)
    if save:
        h, a = gemm1_swiglu(x, w1, w3, plan, config=gemm1_config, save_a=True)
    else:
        h = gemm1_swiglu(x, w1, w3, plan, config=gemm1_config)
    y = gemm2(h, w2, plan, config=gemm2_config)
    del h
    out = combine(y, topk_weights.contiguous(), plan.slot_row, x.dtype)
    if not save:
        return out
    return out, (a, pack_plan(plan))


def checked_plan(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The EP=1 plan, with the id range checked on the device by the plan's count kernel (one
    async assert, no host sync)."""
    plan = build_plan(topk_ids, num_experts, block_m, id_limit=num_experts)
    torch._assert_async(plan.ids_ok, ids_range_message(num_experts, 1))
    return plan


def saved_like(x: torch.Tensor, topk_ids: torch.Tensor, w1: torch.Tensor,
               block_m: int | None = None) -> list[torch.Tensor]:
    """Empty tensors shaped like forward_bf16(..., save=True)'s saved tuple (fake impls, meta):
    every size is a static function of (T, K, E_local, H, block_m)."""
    block_m = block_m or plan_block_m()
    T, K = topk_ids.shape
    E, H, _ = w1.shape
    if T == 0:  # forward_bf16 returns at once: no pre-activations, no plan
        return [x.new_empty((0, 2 * H)), x.new_empty((0,), dtype=torch.int32)]
    R = max_rows(T * K, E, block_m)
    return [
        x.new_empty((R, 2 * H)),
        x.new_empty((packed_plan_numel(T, K, E, block_m),), dtype=torch.int32),
    ]
