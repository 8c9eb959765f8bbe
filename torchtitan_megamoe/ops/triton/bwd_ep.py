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
import torch.distributed as dist


def _exchange(t: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = t.new_empty((sum(out_splits),) + tuple(t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=group)
    return out


def backward_ep(grad_out, x, topk_ids, topk_weights, w1, w2, w3, group, local_backward):
    """(dx, dtopk_weights, dw1, dw2, dw3) for an EP group; ``local_backward`` is the EP=1
    backward (same signature minus group/precision) run on the received rows."""
    R = dist.get_world_size(group)
    E_local = w1.shape[0]
    T, K = topk_ids.shape
    D = x.shape[1]

    flat = topk_ids.reshape(-1).long()
    slots = torch.nonzero(flat >= 0).squeeze(1)
    slots = slots[torch.argsort(flat[slots], stable=True)]
    expert = flat[slots]
    send_counts = torch.bincount(expert // E_local, minlength=R)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()

    tok = slots // K
    recv_x = _exchange(x[tok], recv_splits, send_splits, group)
    recv_dy = _exchange(grad_out[tok], recv_splits, send_splits, group)
    recv_w = _exchange(topk_weights.reshape(-1)[slots], recv_splits, send_splits, group)
    recv_e = _exchange(expert % E_local, recv_splits, send_splits, group)

    dx_rows, dw_rows, dw1, dw2, dw3 = local_backward(
        recv_dy, recv_x, recv_e.unsqueeze(1), recv_w.unsqueeze(1), w1, w2, w3
    )

    back_dx = _exchange(dx_rows, send_splits, recv_splits, group)
    back_dw = _exchange(dw_rows.reshape(-1), send_splits, recv_splits, group)
    dx_slot = torch.zeros(T * K, D, dtype=torch.float32, device=x.device)
    dx_slot.index_copy_(0, slots, back_dx.float())
    dx = dx_slot.view(T, K, D).sum(1).to(x.dtype)
    dtw = torch.zeros(T * K, dtype=topk_weights.dtype, device=x.device)
    dtw.index_copy_(0, slots, back_dw.to(topk_weights.dtype))
    return dx, dtw.view(T, K), dw1, dw2, dw3
