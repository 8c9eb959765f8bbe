"""Expert-parallel (EP > 1) forward, not overlapped: exchange rows around the EP=1 kernels.

    1. valid slots (t, k) sorted by global expert id (stable): grouped by destination rank, then
       by local expert, in slot order (deterministic);
    2. all_to_all of x[t] and the local expert id of every slot (split sizes exchanged first:
       this path syncs with the host once per call for them);
    3. each rank treats its received rows as tokens with one slot each (K = 1) and runs the EP=1
       plan, GEMM 1 + SwiGLU and GEMM 2 on them;
    4. the reverse all_to_all returns each slot's expert output row to its source, where the
       combine kernel sums them with the routing weights in fp32, fixed k order.

This is the functional EP path (same layout as bwd_ep.py, so forward and backward agree). The
design's fused version (symmetric-memory peer stores with per-tile arrival counters, GEMM 2
storing straight into the source rank's combine slot, communication hidden under the GEMMs) is
not built yet; here NCCL all_to_all runs between the launches.
Memory on a receiver: received x rows and expert outputs (2 * N_recv * D, x.dtype) plus the
EP=1 workspace for T = N_recv, K = 1; on the source, [T*K, D] slot rows.
"""

import torch

from torchtitan_megamoe.ops.route import AllToAllRoute, slot_rows
from torchtitan_megamoe.ops.triton.combine import combine
from torchtitan_megamoe.ops.triton.gemm1_swiglu import gemm1_swiglu
from torchtitan_megamoe.ops.triton.gemm2_scatter import gemm2_scatter
from torchtitan_megamoe.ops.triton.plan import build_plan


def expert_rows(x, local_ids, w1, w2, w3, block_m, gemm1_config=None, gemm2_config=None):
    """y[n] = w2[e] @ swiglu(x[n]) for rows x [N, D] with local expert ids [N] (one slot each)."""
    N, D = x.shape
    if N == 0:
        return x.new_empty((0, D))
    plan = build_plan(local_ids.view(N, 1), w1.shape[0], block_m)
    h = gemm1_swiglu(x.contiguous(), w1, w3, plan, config=gemm1_config)
    return gemm2_scatter(h, w2, plan, config=gemm2_config)


def forward_ep(x, topk_ids, topk_weights, w1, w2, w3, group, block_m, gemm1_config=None,
               gemm2_config=None):
    E_local = w1.shape[0]
    T, K = topk_ids.shape
    D = x.shape[1]
    w1, w2, w3 = w1.contiguous(), w2.contiguous(), w3.contiguous()

    route = AllToAllRoute(topk_ids, E_local, group)
    recv_x = route.dispatch(slot_rows(x, K, route.slots))
    y_rows = expert_rows(recv_x, route.local_expert, w1, w2, w3, block_m, gemm1_config, gemm2_config)
    back = route.combine(y_rows)

    # Slot rows of dropped slots stay unwritten; the combine skips them by the -1 marker.
    ybuf = torch.empty((T * K, D), dtype=x.dtype, device=x.device)
    ybuf.index_copy_(0, route.slots, back)
    live = torch.where(topk_ids.reshape(-1) >= 0, 0, -1).to(torch.int32)
    return combine(ybuf, topk_weights.contiguous(), live, x.dtype)
