"""Where each token goes in an EP group, and the moves of the exchange protocol.

Selective dispatch: a token's row travels once to each rank owning at least one of its experts,
and to no other (not once per slot: at top-8 a token has several slots on a rank). On a peer the
rows a source sends sit compactly in token order at rows 0..n_d-1 of the source's region; the
source's own region keeps token t at row t (kernels/ep_layout.py). Row counts are known on the
device only, so the rows move by SM stores of exactly n_d rows (kernels/ep_copy.py), and every
source also stores n_d into the peer's "cnt" region: the receiver reads rows < n_d only (rows past
it hold stale data of earlier calls). On a receiver a token has K slots whose ids are that rank's
local expert ids, -1 for slots owned elsewhere; the EP=1 kernels then run on the receive buffer as
if it were a batch of R*C tokens. The receiver returns ONE partial row per received token (its
weighted sum over the token's experts there), the n_s rows of region s to source s, in the
order they came; the source sums the partials of the ranks it sent the token to, in fp32 and
fixed rank order.

Row names and their precision (``exchange_widths``, from the recipe): "x" bf16 token rows, or
with an FP8 forward "xq" e4m3 rows + "xs" their 1x128 scales (the FP8 GEMM 1 quantizes x per
token anyway, so the rows it reads are the same); "dy" bf16, or with FP8 data gradients "dyq" +
"dys"; the returned partial rows "ret" stay bf16; "dtw" fp32 d(topk_weights); "meta" the local
ids and routing weights; "cnt" the row counts.

The forward (ep_forward.py) and the backward (ep_backward.py) overlap these moves with their GEMMs
(``ex`` from ops/hopper/ep_transport.py; a transport that cannot overlap runs the same steps in order):
    meta       counts and metadata to every rank (send_meta), own rows home (send_own)
    exchange   barrier #1: metadata everywhere
    rows       token rows to the peers they go to (send_peers), on the side stream, then the
               group barrier on channel 1 (``wait`` before reading them)
    compute    EP=1 kernels, region by region, the own first
    return     each region's partial rows -> its source's "ret" region (return_rows), on the
               side stream under the next region
    exchange   barrier #2 (current stream, after the last read of recv): partial rows are
               complete; also orders this call's reads of recv before any peer's next
               dispatch (which follows barrier #2 of this call)
    sum        sum_partials over recv["ret"]
Everything has a static shape; nothing waits on the host.

``TRAFFIC`` counts, when switched on (the bench), the bytes each rank stores into its peers per
transfer, from the same device-side counts the copies use.
"""

from __future__ import annotations

import torch

from torchtitan_megamoe.ops.hopper.ep_transport import get_exchange
from torchtitan_megamoe.ops.hopper.kernels.ep_copy import copy_rows
from torchtitan_megamoe.ops.hopper.kernels.ep_layout import ep_route_tensors
from torchtitan_megamoe.ops.hopper.kernels.sum_partials import sum_partials
from torchtitan_megamoe.ops.options import ids_range_message
from torchtitan_megamoe.ops.recipe import SCALE_BLOCK

FP8_ROWS = torch.uint8  # e4m3 rows travel as bytes (any transport moves them)


def exchange_widths(D: int, K: int, dtype: torch.dtype, recipe) -> dict:
    """Receive buffers of the protocol for ``recipe`` (ops/recipe.py): token rows, metadata
    (K local ids and K fp32 weight bit patterns per row, int32), returned partial rows,
    d(topk_weights) and the row counts."""
    widths = {
        "meta": (2 * K, torch.int32),
        "ret": (D, dtype),
        "dtw": (K, torch.float32),
        "cnt": (1, torch.int32),
        # the backward's x: its weight gradients read unrounded x
        "x": (D, dtype),
    }
    if recipe.fp8_forward:
        widths.update(xq=(D, FP8_ROWS), xs=(D // SCALE_BLOCK, torch.float32))
    if recipe.fp8_dgrad:
        widths.update(dyq=(D, FP8_ROWS), dys=(D // SCALE_BLOCK, torch.float32))
    else:
        widths["dy"] = (D, dtype)
    return widths


class Traffic:
    """Bytes each rank stores into its peers' buffers, per transfer, from the device-side row
    counts (no host sync while recording; ``take`` syncs). Off unless a bench switches it on."""

    def __init__(self):
        self.on = False
        self._rows: list = []

    def add(self, rank: int, transfer: str, rows: torch.Tensor, row_bytes: int) -> None:
        if self.on:
            self._rows.append((rank, transfer, rows.to(torch.int64), row_bytes))

    def take(self) -> dict:
        """{rank: {transfer: bytes}} recorded since the last take; clears."""
        out: dict = {}
        for rank, transfer, rows, row_bytes in self._rows:
            per = out.setdefault(rank, {})
            per[transfer] = per.get(transfer, 0) + int(rows) * row_bytes
        self._rows.clear()
        return out


TRAFFIC = Traffic()


def _rows_of(t) -> torch.Tensor:
    """The rows of a send_peers entry: a tensor, or (transfer name, tensor)."""
    return t[1] if isinstance(t, tuple) else t


def _row_bytes(t: torch.Tensor) -> int:
    return t.shape[-1] * t.element_size()


class TokenRoute:
    """The routing of this rank's tokens [T, K] over an EP group of R ranks with E_local experts
    each: ``pos[t, d]`` = row of token t in its region on rank d (-1: t has no expert on d)."""

    def __init__(self, topk_ids, topk_weights, E_local, group, D, dtype, recipe, check_ids=False,
                 max_tokens_per_rank=0):
        T, K = topk_ids.shape
        self.T, self.K, self.E_local = T, K, E_local
        self.ex = get_exchange(group, T, exchange_widths(D, K, dtype, recipe), topk_ids.device,
                               max_tokens_per_rank)
        R, C, me = self.ex.R, self.ex.capacity, self.ex.rank
        self.R, self.C, self.me = R, C, me
        self._own: dict = {}  # name -> the own region's rows where send_own kept them in place
        # sends in shift order, me-1, me-2, ...: at step i every rank sends to the rank i below
        # and receives from the rank i above, which computes its regions in order me+1, me+2
        # (ep_forward.region_order)
        self.peers = [(me - i) % R for i in range(1, R)]
        self.owner, self._ret_slot, self.pos, self.counts, self.src_tok, self.meta, ids_ok = (
            ep_route_tensors(topk_ids, topk_weights, E_local, R, C, me=me, check_ids=check_ids))
        if check_ids:
            # check_ids: the forward's (mega_moe leaves the id range to this kernel on CUDA)
            torch._assert_async(ids_ok, ids_range_message(E_local * R, R))
        # rows this rank sends its peers, per row name (the traffic meter's count)
        self._sent = self.counts.sum() - self.counts[me] if TRAFFIC.on else None

    def _count(self, d: int) -> torch.Tensor:
        return self.counts[d:d + 1]

    def recv_count(self, s: int) -> torch.Tensor:
        """[1] int32 on the device: rows source s sent here this call."""
        return self.ex.recv["cnt"][s, 0]

    def live_rows(self, s: int) -> torch.Tensor | None:
        """What region s's combines must make: a peer's n_s sent rows (the ones that go home;
        [1] int32 on the device), or None for the own region (token t at row t, all of them)."""
        return None if s == self.me else self.recv_count(s)

    def send_meta(self, transfer: str = "dispatch") -> None:
        """Store every destination's row count and metadata rows (no barrier)."""
        ex, me = self.ex, self.me
        for d in range(self.R):
            ex.send_region(d, "cnt")[0].copy_(self._count(d))
            if d == me:  # whole own region: its rows past T read as "no token"
                ex.send_region(d, "meta").copy_(self.meta[d])
            else:
                copy_rows([(self.meta[d], ex.send_region(d, "meta"))], self._count(d))
        if self._sent is not None:  # the metadata rows, and one count per peer
            TRAFFIC.add(me, f"{transfer} meta", self._sent, _row_bytes(self.meta[0]))
            TRAFFIC.add(me, f"{transfer} meta", self._sent.new_tensor(len(self.peers)), 4)

    def send_own(self, rows: dict) -> None:
        """The own region's token rows (name -> [T, W], row t; no transfer): read where they
        are when they fill the region (T = C: no copy), else stored in it."""
        for name, t in rows.items():
            if self.T == self.C and t.is_contiguous():
                self._own[name] = t
            else:
                self.ex.send_region(self.me, name)[: self.T].copy_(t)

    def region_rows(self, name: str, s: int) -> torch.Tensor:
        """[C, W] rows ``name`` of region s: the received ones, or the own ones (send_own)."""
        if s == self.me and name in self._own:
            return self._own[name]
        return self.ex.recv[name][s]

    def send_peers(self, rows: dict, transfer: str = "dispatch", signal: bool = False) -> None:
        """Store token rows (name -> [T, W]) in every peer's region, the n_d rows of the tokens
        going there only (SM stores; no barrier); with ``signal``, signal each peer once its
        rows are stored (it then ``wait_from``s this rank before reading them). ``rows`` may
        hold several transfers: name -> (transfer, [T, W])."""
        per_transfer: dict = {}  # transfer -> bytes of one row
        for t in rows.values():
            label = t[0] if isinstance(t, tuple) else transfer
            per_transfer[label] = per_transfer.get(label, 0) + _row_bytes(_rows_of(t))
        for d in self.peers:
            copy_rows([(_rows_of(t), self.ex.send_region(d, name)) for name, t in rows.items()],
                      self._count(d), self.src_tok[d])
            for label, row_bytes in per_transfer.items():
                self.ex.pace(self._count(d), row_bytes, label)
            if signal:
                self.ex.signal(d)
        if self._sent is not None:
            for label, row_bytes in per_transfer.items():
                TRAFFIC.add(self.me, label, self._sent, row_bytes)

    def received(self):
        """(ids [R*C, K] local expert ids or -1, weights [R*C, K] fp32) of the received tokens:
        rows past a source's count read as "no slot". The weights are a strided view of the
        metadata (unit column stride: the combines read them so, the backward's kernels
        flatten them); rows whose ids are -1 are never read."""
        R, C, K = self.R, self.C, self.K
        meta = self.ex.recv["meta"].view(R, C, 2 * K)
        live = (torch.arange(C, device=meta.device, dtype=torch.int32)[None, :]
                < self.ex.recv["cnt"].view(R, C)[:, :1])
        ids = torch.where(live[..., None], meta[..., :K], -1).view(R * C, K)
        return ids, meta.view(R * C, 2 * K)[:, K:].view(torch.float32)

    def return_rows(self, s: int, rows: dict, transfer: str) -> None:
        """Store partial rows (name -> [C, W], region s's received order) into source s's
        region: its n_s received rows only (no barrier); ``transfer`` names the move."""
        if s == self.me:
            for name, t in rows.items():
                self.ex.send_region(s, name)[: self.T].copy_(t[: self.T])
        else:
            copy_rows([(t, self.ex.send_region(s, name)) for name, t in rows.items()],
                      self.recv_count(s))
            self.ex.pace(self.recv_count(s), sum(_row_bytes(t) for t in rows.values()), transfer)

    def returned_rows(self) -> torch.Tensor:
        """[] int64 on the device: rows this rank returns to its peers (the traffic meter's)."""
        cnt = self.ex.recv["cnt"].view(self.R, -1)[:, 0]
        return cnt.sum() - cnt[self.me]

    def count_returned(self, row_bytes: int, transfer: str) -> None:
        """Record the bytes of returning every received row (``row_bytes`` each) to its peer
        source (TRAFFIC)."""
        if TRAFFIC.on:
            TRAFFIC.add(self.me, transfer, self.returned_rows(), row_bytes)

    def sum_returned(self, name, out_dtype) -> torch.Tensor:
        """out[t] = sum over the ranks t went to of their returned row, fp32, rank order."""
        return sum_partials(self.ex.recv[name], self.pos, out_dtype)

    def pick_returned_dtw(self, dtype) -> torch.Tensor:
        """d(topk_weights)[t, k] from the rank owning slot (t, k); 0 for dropped slots."""
        # _ret_slot: flat index of dtw[owner, pos[t, owner], k] in the [R, C, K] buffer
        got = self.ex.recv["dtw"].view(-1)[self._ret_slot.clamp(min=0)]
        return torch.where(self._ret_slot >= 0, got, 0.0).to(dtype)
