"""Expert-parallel (EP > 1) backward: re-dispatch x and dy to the experts' owners, run the EP=1
kernels there on the received rows, return dx rows and d(topk_weights) to their source slots.

    1. valid slots (t, k) sorted by global expert id (stable): grouped by destination rank, then
       by local expert, in slot order (deterministic);
    2. all_to_all of x[t], dy[t], w[t,k] and the local expert id of every slot (split sizes
       exchanged first; this path syncs with the host once for them);
    3. each rank treats its received rows as tokens with one slot each (K = 1) and runs the EP=1
       backward (kernels A, B, C): dw1/dw2/dw3 of its local experts are complete there, since
       every row of its experts arrives at it;
    4. the reverse all_to_all returns each slot's dx row and d(topk_weight) to its source; dx[t] =
       sum_k of the slot rows in fp32 in fixed k order (a unique-index scatter plus a sum, so it is
       deterministic).

Communication is not overlapped with the GEMMs here (it is plain NCCL/gloo all_to_all between
the launches); the fused, overlapped exchange belongs with the forward's EP dispatch.
Memory on a receiver: x and dy rows (2 * N_recv * D, x.dtype) plus the EP=1 transients for
T = N_recv, K = 1.
"""

import torch

from torchtitan_megamoe.ops.route import AllToAllRoute, slot_rows


def backward_ep(grad_out, x, topk_ids, topk_weights, w1, w2, w3, group, local_backward):
    """(dx, dtopk_weights, dw1, dw2, dw3) for an EP group; ``local_backward`` is the EP=1
    backward (same signature minus group/precision) run on the received rows."""
    E_local = w1.shape[0]
    T, K = topk_ids.shape
    D = x.shape[1]

    route = AllToAllRoute(topk_ids, E_local, group)
    recv_x = route.dispatch(slot_rows(x, K, route.slots))
    recv_dy = route.dispatch(slot_rows(grad_out, K, route.slots))
    recv_w = route.dispatch(topk_weights.reshape(-1)[route.slots])
    recv_e = route.local_expert

    dx_rows, dw_rows, dw1, dw2, dw3 = local_backward(
        recv_dy, recv_x, recv_e.unsqueeze(1), recv_w.unsqueeze(1), w1, w2, w3
    )

    dx_slot = route.to_slots(route.combine(dx_rows).float(), T * K)
    dx = dx_slot.view(T, K, D).sum(1).to(x.dtype)
    dtw = route.to_slots(route.combine(dw_rows.reshape(-1)).to(topk_weights.dtype), T * K)
    return dx, dtw.view(T, K), dw1, dw2, dw3
