"""Stock TorchTitan's token-choice router with the top-k selection in one Triton launch.

``route(router, x, expert_bias)`` returns what ``router(x, expert_bias)`` returns (TorchTitan
0.2.2's ``TokenChoiceTopKRouter.forward``: gate, softmax or sigmoid in fp32, top-k of the
biased scores, gating values gathered from the unbiased scores, optional normalization, scale,
tokens per expert). Eager calls run everything after the gate as one launch: softmax routers
hand the gate's raw logits to ops/hopper/kernels/topk.topk_softmax_gate (fp32 cast, softmax, selection,
gating values, normalization, scale, counts), sigmoid routers their fp32 sigmoid scores to
topk_gate (the same minus the softmax). Each launch before the MoE layer's first big GEMM costs
~30-40 us of host time that the GPU waits out in a waited forward, so the softmax router issues
three (gate, the counts' zero fill, the kernel) rather than five. A traced graph replaces only
``torch.topk`` (~115 us at 16384 tokens x 128 experts) by the ``megamoe::router_topk`` custom
op and leaves the rest to compile. TorchTitan's compile wraps ``moe.router`` in torch.compile
(apply_compile); an eager call unwraps it and takes the fast path too: the compiled region's
several launches and per-call wrapper cost host time the step's host-bound forward waits for.

Only the plain configuration takes this path: the router is exactly TokenChoiceTopKRouter, no
node-limited (grouped) routing, no debug load-balance override, a CUDA input (or ``kernel=True``
under the Triton interpreter, for tests), at most ops/hopper/kernels/topk.MAX_EXPERTS experts. Anything
else calls the stock router unchanged. The selected set equals torch.topk's up to the order of
tied scores (ties go to the lower expert index), so routing and losses match stock's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchtitan.models.moe.moe import TokenChoiceTopKRouter

from torchtitan_megamoe.ops.hopper.kernels.topk import (MAX_EXPERTS, router_topk, topk_gate,
                                                topk_softmax_gate)


def fast_path_ok(router, x: torch.Tensor, kernel: bool | None = None) -> bool:
    if type(router) is not TokenChoiceTopKRouter:
        return False
    if router.num_expert_groups is not None or getattr(router, "_debug_force_load_balance", False):
        return False
    if router.score_func not in ("softmax", "sigmoid") or router.num_experts > MAX_EXPERTS:
        return False
    return x.is_cuda if kernel is None else kernel


def route(router, x: torch.Tensor, expert_bias: torch.Tensor | None = None,
          kernel: bool | None = None):
    """(top_scores [T, K], selected_experts_indices [T, K] int64, num_tokens_per_expert [E]).
    ``kernel``: None picks the Triton top-k on CUDA inputs; True/False forces it on/off."""
    inner = getattr(router, "_orig_mod", None)
    if (isinstance(router, torch._dynamo.eval_frame.OptimizedModule)
            and not torch.compiler.is_compiling() and fast_path_ok(inner, x, kernel)):
        router = inner  # a compiled router's own module, on the eager fast path
    if not fast_path_ok(router, x, kernel):
        return router(x, expert_bias)
    scores = router.gate(x)
    bias = None if expert_bias is None else expert_bias.detach().to(torch.float32).contiguous()
    eager = not torch.compiler.is_compiling()
    if eager and router.score_func == "softmax":
        # the fp32 cast, the softmax and all that follows in one launch (saves two launches)
        if scores.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            scores = scores.to(torch.float32)  # what stock's cast would give the softmax
        return topk_softmax_gate(scores, router.top_k, bias, router.route_norm,
                                 router.route_scale)
    # fp32, as stock does, to avoid loss explosions
    if router.score_func == "sigmoid":
        scores = torch.sigmoid(scores.to(torch.float32))
    else:
        scores = F.softmax(scores.to(torch.float32), dim=1)
    if eager:
        # eager: selection, gating values, normalization, scale and counts in one launch
        return topk_gate(scores, router.top_k, bias, router.route_norm, router.route_scale)
    # a traced graph: the top-k as one opaque custom op, the rest as torch ops compile fuses
    with torch.no_grad():
        selected = router_topk(scores.detach(), router.top_k, bias)
    # the gating values come from the unbiased scores (the bias only steers the choice)
    top_scores = scores.gather(dim=1, index=selected)
    if router.route_norm:
        top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
    top_scores = top_scores * router.route_scale
    num_tokens_per_expert = torch.histc(
        selected.view(-1), bins=router.num_experts, min=0, max=router.num_experts
    )
    return top_scores, selected, num_tokens_per_expert
