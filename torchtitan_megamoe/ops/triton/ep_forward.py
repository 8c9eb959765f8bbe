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

Memory. Exchange buffers, shared by all layers (ops/exchange.py): 3 x [R, C, D] x.dtype + small
metadata, C = tokens per rank. Per call, the EP=1 workspace for R*C tokens (h [R_max, H] and the
per-slot rows [R*C*K, D]) and the partial rows [R*C, D].
"""

import torch

from torchtitan_megamoe.ops.triton.ep_route import TokenRoute
from torchtitan_megamoe.ops.triton.forward import forward_ep1


def forward_ep(x, topk_ids, topk_weights, w1, w2, w3, group, block_m, gemm1_config=None,
               gemm2_config=None):
    route = TokenRoute(topk_ids, topk_weights, w1.shape[0], group, x.shape[1], x.dtype)
    route.dispatch({"x": x.contiguous()})
    ids, weights = route.received()
    partial = forward_ep1(route.recv_rows("x"), ids, weights, w1, w2, w3, block_m=block_m,
                          gemm1_config=gemm1_config, gemm2_config=gemm2_config)
    route.give_back({"ret": partial})
    return route.sum_returned("ret", x.dtype)
