"""Expert-parallel (EP > 1) forward: token exchange (ep_route.py) around the EP=1 kernels.

    1. TokenRoute: each token's row goes once to every rank owning one of its experts, stored
       straight into that rank's receive buffer (symmetric memory: NVLink peer stores; other
       groups: all_to_all with static splits), with its local expert ids and weights;
    2. the EP=1 forward (plan, GEMM 1 + SwiGLU, GEMM 2, weighted combine) runs on the R*C
       received token rows; a received token's output row is its partial sum over the experts
       this rank owns;
    3. each partial row is stored back into the source rank's "ret" region, and the source sums
       the partials of the ranks the token went to (fp32, fixed rank order: deterministic).
No host sync and no data-dependent shape anywhere, so the call is capturable.

Not yet overlapped: the GEMMs start after the whole dispatch (barrier #1), and the return
follows the combine. The overlapped design (per-tile arrival counters, GEMM 2 storing into the
source slots) would hide the exchange under the GEMMs.

Saved for backward. The EP=1 forward's saved pre-activations live in the receive layout,
which the backward's exchange reproduces exactly (it depends only on topk_ids and C), so the
backward can skip GEMM 1 here too. Their size is static: R_max rows for R*C received tokens of
K slots, i.e. about R times what the rank really computes. They are kept only while that is at
most what stock TorchTitan saves per MoE layer (T*K*(D + 3H) bf16 values: permuted input, a1,
a3, h); otherwise the backward recomputes GEMM 1. At T = C = 16384, K = 8, E = 128, EP=2:
30B 0.77 GiB kept (stock 1.06 GiB); 235B 1.55 GiB kept (stock 2.13 GiB); at EP=8 they exceed
stock's and are not kept.

Memory. Exchange buffers, shared by all layers (ops/exchange.py): 3 x [R, C, D] x.dtype + small
metadata, C = tokens per rank. Per call, the EP=1 workspace for R*C tokens (h [R_max, H] and the
per-slot rows [R*C*K, D]) and the partial rows [R*C, D].
"""

from torchtitan_megamoe.ops.exchange import capacity_hint
from torchtitan_megamoe.ops.triton.ep_route import TokenRoute
from torchtitan_megamoe.ops.triton.forward import forward_ep1, saved_like
from torchtitan_megamoe.ops.triton.plan import max_rows


def keeps_saved(R, C, K, E_local, D, H, block_m) -> bool:
    """Whether the EP forward keeps GEMM 1's pre-activations: only while their static size is
    at most stock TorchTitan's saved routed activations per layer."""
    ours = max_rows(R * C * K, E_local, block_m) * 2 * H
    stock = C * K * (D + 3 * H)
    return ours <= stock


def forward_ep(x, topk_ids, topk_weights, w1, w2, w3, group, block_m, gemm1_config=None,
               gemm2_config=None, save=False):
    """out, or (out, saved list) with ``save`` (empty when the backward must recompute)."""
    route = TokenRoute(topk_ids, topk_weights, w1.shape[0], group, x.shape[1], x.dtype)
    route.dispatch({"x": x.contiguous()})
    ids, weights = route.received()
    E_local, H, D = w1.shape
    keep = save and keeps_saved(route.R, route.C, route.K, E_local, D, H, block_m)
    res = forward_ep1(route.recv_rows("x"), ids, weights, w1, w2, w3, block_m=block_m,
                      gemm1_config=gemm1_config, gemm2_config=gemm2_config, save=keep)
    partial, saved = res if keep else (res, ())
    route.give_back({"ret": partial})
    out = route.sum_returned("ret", x.dtype)
    return (out, list(saved)) if save else out


def saved_like_ep(x, topk_ids, w1, group, block_m):
    """Empty tensors shaped like forward_ep(..., save=True)'s saved list (fake impls)."""
    import torch.distributed as dist

    R = dist.get_world_size(group)
    T, K = topk_ids.shape
    E_local, H, D = w1.shape
    C = capacity_hint(group, T)
    if not keeps_saved(R, C, K, E_local, D, H, block_m):
        return []
    return saved_like(x.new_empty((R * C, D)), topk_ids.new_empty((R * C, K)), w1)
