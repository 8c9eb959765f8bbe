"""The EP token route in one Triton launch (the path of ep_dispatch.TokenRoute).

Receive layout: token t of source s sits at row t of region s on every rank it goes to (the
identity layout). Rows of tokens that do not go to a rank stay in place with "no slot"
metadata. A region is then a plain copy of the source's batch, so the dispatch can be one
contiguous copy per peer on the copy engines (no SMs, overlappable with the GEMMs), and every
position is known without a scan. It replaced a compacted layout (rows numbered by a scan in
token order): the same bytes on the copy-engine path at EP=2 (at top-8 of 128 experts a token
almost always has a slot on both ranks), more at EP=8, where the copy runs under compute.

    owner    [T, K] int64     expert's rank per slot (-1: dropped slot)
    ret_slot [T, K] int64     flat index of slot (t, k) in an [R, C, K] buffer of rows the
                              owners send back (d(topk_weights)): (owner*C + t)*K + k,
                              -1 for dropped slots
    pos      [T, R] int32     row of token t in its region on rank d: t, or -1 when t has no
                              expert on d
    meta     [R, C, 2K] int32 per destination d and row t < T: the K local ids of token t (-1
                              for slots d does not own), then the K routing weights' fp32 bit
                              patterns; rows t >= T: ids -1, weights 0 (the whole region
                              travels, so no stale ids show)

Grid = (R, C / BLOCK_T): program (d, b) owns destination d and rows [b*BLOCK_T, (b+1)*BLOCK_T)
(tiles [BLOCK_T, K_PAD] of ids and weights); rows >= T get "no token". It writes only its
destination's column of pos, region of meta and the ret_slot entries of the slots
d owns; programs of d = 0 also write owner and the ret_slot of slots no rank owns.
Waits on: nothing (stream order). Signals: nothing; the dispatch copies meta after it."""

import torch
import triton
import triton.language as tl

from torchtitan_megamoe.ops.hopper.kernels.tiling import cdiv, next_power_of_2


@triton.jit
def _ep_route_kernel(
    ids_ptr, w_ptr, owner_ptr, ret_slot_ptr, pos_ptr, meta_ptr, ok_ptr,
    T, C, E_local, stride_ids_t, stride_ids_k, stride_w_t, stride_w_k,
    R: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    CHECK: tl.constexpr,
):
    d = tl.program_id(0)
    kk = tl.arange(0, K_PAD)
    in_k = kk < K
    toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = toks < T
    m = in_t[:, None] & in_k[None, :]
    t64 = toks.to(tl.int64)
    g = tl.load(ids_ptr + t64[:, None] * stride_ids_t + kk[None, :] * stride_ids_k,
                mask=m, other=-1).to(tl.int32)  # global expert ids fit in int32
    own = tl.where(g >= 0, g // E_local, -1)
    slot = t64[:, None] * K + kk[None, :]
    if d == 0:
        if CHECK:
            # 1 when every id of the tile lies in [-1, R * E_local)
            bad = tl.sum(tl.sum(((g < -1) | (g >= R * E_local)).to(tl.int32), axis=1), axis=0)
            tl.store(ok_ptr + tl.program_id(1), (bad == 0).to(tl.int32))
        tl.store(owner_ptr + slot, own.to(tl.int64), mask=m)
        tl.store(ret_slot_ptr + slot, tl.full((BLOCK_T, K_PAD), -1, tl.int64),
                 mask=m & ((own < 0) | (own >= R)))
    mine = own == d
    goes = tl.max(mine.to(tl.int32), axis=1)  # [BLOCK_T]: 1 if t has a slot on d
    # slot (t, k) of d's expert: its d(topk_weight) comes back at dtw[d, t, k]
    ret = (d.to(tl.int64) * C + t64[:, None]) * K + kk[None, :]
    tl.store(ret_slot_ptr + slot, ret, mask=m & mine)
    p = tl.where(goes > 0, toks, -1)
    tl.store(pos_ptr + t64 * R + d, p, mask=in_t)
    wbits = tl.load(w_ptr + t64[:, None] * stride_w_t + kk[None, :] * stride_w_k,
                    mask=m, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    # rows t < T: token t's local ids (-1 for slots d does not own) and their weights; rows
    # T..C-1: no token this call
    in_c = (toks < C)[:, None] & in_k[None, :]
    dst = meta_ptr + (d.to(tl.int64) * C + t64[:, None]) * (2 * K) + kk[None, :]
    tl.store(dst, tl.where(mine, g - d * E_local, -1).to(tl.int32), mask=in_c)
    tl.store(dst + K, tl.where(mine, wbits, 0), mask=in_c)


def ep_route_tensors(topk_ids: torch.Tensor, topk_weights: torch.Tensor, E_local: int, R: int,
                     C: int, block_t: int | None = None, check_ids: bool = False):
    """(owner, ret_slot [T, K] int64, pos [T, R] int32, meta [R, C, 2K] int32, ids_ok; see the
    module docstring) of this rank's routing over R ranks of E_local experts
    each, C rows per region (C >= T). ``block_t`` (a power of two) overrides the token tile;
    tests lower it to cover many blocks. ``check_ids``: ids_ok is a 0-d int32, 1 when every id
    lies in [-1, R * E_local) (the tiles check in passing; one reduction launch, no host sync),
    else None."""
    T, K = topk_ids.shape
    if topk_weights.shape != (T, K):
        raise ValueError(f"ep_route: topk_weights {tuple(topk_weights.shape)} vs ids {(T, K)}")
    if C < T:
        raise ValueError(f"ep_route: {T} tokens do not fit regions of {C} rows")
    dev = topk_ids.device
    owner = torch.empty((T, K), dtype=torch.int64, device=dev)
    ret_slot = torch.empty((T, K), dtype=torch.int64, device=dev)
    pos = torch.empty((T, R), dtype=torch.int32, device=dev)
    meta = torch.empty((R, C, 2 * K), dtype=torch.int32, device=dev)
    K_PAD = next_power_of_2(K)
    # [BLOCK_T, K_PAD] tiles of ~4K elements; one program per (destination, token tile): the
    # identity layout needs no scan, so tiles are independent (one program per destination
    # walking all tokens is serial)
    BLOCK_T = block_t or max(16, min(1024, 4096 // K_PAD))
    blocks = cdiv(C, BLOCK_T)
    ok = torch.empty(blocks, dtype=torch.int32, device=dev) if check_ids else pos
    _ep_route_kernel[(R, blocks)](
        topk_ids, topk_weights, owner, ret_slot, pos, meta, ok,
        T, C, E_local, topk_ids.stride(0), topk_ids.stride(1),
        topk_weights.stride(0), topk_weights.stride(1),
        R=R, K=K, K_PAD=K_PAD, BLOCK_T=BLOCK_T, CHECK=check_ids, num_warps=8,
    )
    return owner, ret_slot, pos, meta, (ok.amin() if check_ids else None)
