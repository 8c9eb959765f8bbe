"""Where each token goes in an EP group, and the moves of the exchange protocol.

A token travels once per destination rank, not once per slot (at top-8 over 2 ranks a token
has ~4 slots on each rank, so per-slot dispatch would move ~4x the bytes). It lands at its own
row t of its source's region (the identity layout of kernels/ep_layout.py), so a source sends its
whole batch to every rank as one contiguous copy (copy engines): the rows of tokens without a
slot there travel too (~1% of them at EP=2 and top-8 of 128 experts, ~1/3 at EP=8) and are
marked "no slot" by the metadata. On the receiver a token has K slots whose ids are that rank's
local expert ids, -1 for slots owned elsewhere; the EP=1 kernels then run on the receive buffer as if it were a batch of
R*C tokens. The receiver returns ONE partial row per token (its weighted sum over the token's
experts there) to row t of its region on the source, and the source sums the partials of the
ranks it sent the token to, in fp32 and fixed rank order.

The forward (ep_forward.py) and the backward (ep_backward.py) overlap these moves with their GEMMs
(``ex`` from ops/hopper/ep_transport.py; a transport that cannot overlap runs the same steps in order):
    dispatch   the batch's rows -> send_region(d, ·) for every d; metadata (local ids,
               weights) as whole regions, so rows a source did not fill read as "no slot";
               rows needed later go on the side stream (dispatch_async, barrier on channel 1)
    exchange   barrier #1: the receive buffers are complete
    compute    EP=1 kernels on recv
    return     each source's region of partial rows -> send_region(source, "ret") (the
               forward's on the side stream under its last GEMM; the backward's after its
               combine)
    exchange   barrier #2 (current stream, after the last read of recv): partial rows are
               complete; also orders this call's reads of recv before any peer's next
               dispatch (which follows barrier #2 of this call)
    sum        sum_partials over recv["ret"]
Everything has a static shape; nothing waits on the host.
"""

from __future__ import annotations

import torch

from torchtitan_megamoe.ops.hopper.ep_transport import get_exchange
from torchtitan_megamoe.ops.hopper.kernels.ep_layout import ep_route_tensors
from torchtitan_megamoe.ops.hopper.kernels.sum_partials import sum_partials
from torchtitan_megamoe.ops.options import ids_range_message


def exchange_widths(D: int, K: int, dtype: torch.dtype) -> dict:
    """Receive buffers of the protocol: token rows (x, dy), metadata (K local ids and K fp32
    weight bit patterns per row, int32), returned partial rows and d(topk_weights)."""
    return {
        "x": (D, dtype),
        "dy": (D, dtype),
        "meta": (2 * K, torch.int32),
        "ret": (D, dtype),
        "dtw": (K, torch.float32),
    }


class TokenRoute:
    """The routing of this rank's tokens [T, K] over an EP group of R ranks with E_local experts
    each: ``pos[t, d]`` = row of token t in its region on rank d (-1: t has no expert on d)."""

    def __init__(self, topk_ids, topk_weights, E_local, group, D, dtype, check_ids=False,
                 max_tokens_per_rank=0):
        T, K = topk_ids.shape
        self.T, self.K, self.E_local = T, K, E_local
        self.ex = get_exchange(group, T, exchange_widths(D, K, dtype), topk_ids.device,
                               max_tokens_per_rank)
        R, C = self.ex.R, self.ex.capacity
        self.R, self.C = R, C
        # One launch (kernels/ep_layout.py) for owner, pos (token t at row t of its region, -1
        # where it does not go) and the metadata regions: local ids of the slots d owns (-1 elsewhere and in unused rows) and the
        # routing weights' bit patterns. Whole regions travel (C x 2K int32, ~1 MB at
        # C = 16384, K = 8), so rows a source did not fill this call never show stale ids.
        self.owner, self._ret_slot, self.pos, self.meta, ids_ok = ep_route_tensors(
            topk_ids, topk_weights, E_local, R, C, check_ids=check_ids
        )
        if check_ids:
            # check_ids: the forward's (mega_moe leaves the id range to this kernel on CUDA)
            torch._assert_async(ids_ok, ids_range_message(E_local * R, R))

    def send_meta(self) -> None:
        """Store every destination's metadata region (no barrier)."""
        for d in range(self.R):
            self.ex.send_region(d, "meta").copy_(self.meta[d])

    def _send_rows(self, rows: dict) -> None:
        """Store token rows (name -> [T, W]) in every destination's region (no barrier): the
        whole batch as one contiguous copy each (copy engines; identity layout), rows of
        tokens without a slot on d travel too and are never read there."""
        for d in range(self.R):
            for name, t in rows.items():
                self.ex.send_region(d, name)[: self.T].copy_(t)

    def dispatch(self, rows: dict) -> None:
        """Send token rows (name -> [T, W]) and the metadata; then barrier #1."""
        self.send_meta()
        self._send_rows(rows)
        self.ex.exchange(["meta", *rows])

    def received(self):
        """(ids [R*C, K] local expert ids or -1, weights [R*C, K] fp32) of the received tokens.
        The weights are a strided view of the metadata (unit column stride: the combines read
        them so, the backward's kernels flatten them), one copy launch less than a contiguous
        copy; the plan kernels read the ids flat, so those are copied."""
        meta = self.ex.recv["meta"].view(self.R * self.C, 2 * self.K)
        return meta[:, : self.K].contiguous(), meta[:, self.K:].view(torch.float32)

    def recv_rows(self, name) -> torch.Tensor:
        return self.ex.recv[name].view(self.R * self.C, -1)

    def dispatch_async(self, rows: dict):
        """Send token rows (name -> [T, W]) under the compute: on the exchange's side stream,
        followed by the group barrier on channel 1 (``wait`` before reading them here). A
        transport that does not overlap sends them now, exchange included. The caller's
        earlier dispatch carried the metadata."""
        ex = self.ex
        if ex.overlaps:
            return ex.run_async(lambda: self._send_rows(rows), barrier=True), rows
        self._send_rows(rows)
        ex.exchange(list(rows))
        return None

    def give_back(self, rows: dict) -> None:
        """Return per-received-token rows (name -> [R*C, W]) to their sources; barrier #2."""
        for s in range(self.R):
            for name, t in rows.items():
                # whole regions (identity layout): rows of tokens that had no slot here are
                # never read by the source
                self.ex.send_region(s, name).copy_(t.view(self.R, self.C, -1)[s])
        self.ex.exchange(list(rows))

    def wait(self, pending) -> None:
        """The current stream waits for a dispatch_async (a no-op for transports that do not
        overlap). ``pending`` also holds the rows' tensors alive until here, so the caching
        allocator cannot hand their memory out while the side stream still reads them."""
        if pending is not None:
            torch.cuda.current_stream(self.ex.device).wait_event(pending[0])

    def sum_returned(self, name, out_dtype) -> torch.Tensor:
        """out[t] = sum over the ranks t went to of their returned row, fp32, rank order."""
        return sum_partials(self.ex.recv[name], self.pos, out_dtype)

    def pick_returned_dtw(self, dtype) -> torch.Tensor:
        """d(topk_weights)[t, k] from the rank owning slot (t, k); 0 for dropped slots."""
        # _ret_slot: flat index of dtw[owner, pos[t, owner], k] in the [R, C, K] buffer
        got = self.ex.recv["dtw"].view(-1)[self._ret_slot.clamp(min=0)]
        return torch.where(self._ret_slot >= 0, got, 0.0).to(dtype)
