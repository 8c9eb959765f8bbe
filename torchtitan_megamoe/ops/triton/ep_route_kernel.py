"""The EP token route in one Triton launch (the path of ep_route.TokenRoute).

The torch-op version was ~17 tiny ops plus R x (3 ops + a scatter_rows launch) per call; on
the H200 the host needed ~0.3 ms for the ops plus ~75 us per Triton launch to issue them while
the GPU idled behind it (docs/PERF.md, "EP=2 with back-to-back timing"). This kernel writes the
same layout in one launch:

    owner    [T, K] int64     expert's rank per slot (-1: dropped slot)
    ret_slot [T, K] int64     flat index of slot (t, k) in an [R, C, K] buffer of rows the
                              owners send back (d(topk_weights)): (owner*C + pos[t, owner])*K + k,
                              -1 for dropped slots
    pos      [T, R] int32     row of token t in its region on rank d, -1: t has no expert on d
    pos_t    [R, T] int32     the same, one contiguous row per destination (scatter_rows' dst_row)
    meta     [R, C, 2K] int32 per destination d and row p < n_d: the K local ids of that row's
                              token (-1 for slots d does not own), then the K routing weights'
                              fp32 bit patterns; rows p >= n_d: ids -1, weights 0 (the whole
                              region travels, so no stale ids show)

Grid = (R,): program d owns destination d. It walks the tokens in blocks of BLOCK_T (tile
[BLOCK_T, K_PAD] of ids and weights), marks the tokens with a slot on d, and numbers them with
an in-block cumsum plus the count carried from the earlier blocks (so rows follow token order:
deterministic, the layout the receiver's plan and the backward's exchange rely on). After the
last block the carry is n_d, and the program fills rows n_d..C-1 of its region in tiles of
[BLOCK_C, K_PAD]. Every program reads all of topk_ids (R x T x K ids, L2-resident at these
sizes) and writes only its own column of pos, row of pos_t, region of meta and the ret_slot
entries of the slots it owns; program 0 also writes owner and ret_slot of slots no rank owns.
One program per destination keeps the scan sequential and simple: at T = 16384, K = 8 it is 32
blocks of 512 tokens, tens of microseconds (estimate, not measured), against the ~1 ms of
launches it replaces.
Waits on: nothing (stream order). Signals: nothing; dispatch copies meta after it."""

import torch
import triton
import triton.language as tl


@triton.jit
def _ep_route_kernel(
    ids_ptr, w_ptr, owner_ptr, ret_slot_ptr, pos_ptr, pos_t_ptr, meta_ptr,
    T, C, E_local, stride_ids_t, stride_ids_k, stride_w_t, stride_w_k,
    R: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    d = tl.program_id(0)
    kk = tl.arange(0, K_PAD)
    in_k = kk < K
    region = meta_ptr + d.to(tl.int64) * C * (2 * K)
    carry = d * 0  # rows of region d handed out so far (an int32 scalar tensor)
    for t0 in range(0, T, BLOCK_T):
        toks = t0 + tl.arange(0, BLOCK_T)
        in_t = toks < T
        m = in_t[:, None] & in_k[None, :]
        t64 = toks.to(tl.int64)
        g = tl.load(ids_ptr + t64[:, None] * stride_ids_t + kk[None, :] * stride_ids_k,
                    mask=m, other=-1).to(tl.int32)  # global expert ids fit in int32
        own = tl.where(g >= 0, g // E_local, -1)
        slot = t64[:, None] * K + kk[None, :]
        if d == 0:
            tl.store(owner_ptr + slot, own.to(tl.int64), mask=m)
            tl.store(ret_slot_ptr + slot, tl.full((BLOCK_T, K_PAD), -1, tl.int64),
                     mask=m & ((own < 0) | (own >= R)))
        mine = own == d
        goes = tl.max(mine.to(tl.int32), axis=1)  # [BLOCK_T]: 1 if t has a slot on d
        row = carry + tl.cumsum(goes, axis=0) - 1
        # slot (t, k) of d's expert: its d(topk_weight) comes back at dtw[d, row, k]
        ret = (d.to(tl.int64) * C + row.to(tl.int64)[:, None]) * K + kk[None, :]
        tl.store(ret_slot_ptr + slot, ret, mask=m & mine)
        p = tl.where(goes > 0, row, -1)
        tl.store(pos_ptr + t64 * R + d, p, mask=in_t)
        tl.store(pos_t_ptr + d.to(tl.int64) * T + t64, p, mask=in_t)
        lid = tl.where(mine, g - d * E_local, -1).to(tl.int32)
        wbits = tl.load(w_ptr + t64[:, None] * stride_w_t + kk[None, :] * stride_w_k,
                        mask=m, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
        dst = region + row.to(tl.int64)[:, None] * (2 * K) + kk[None, :]
        live = (goes > 0)[:, None] & in_k[None, :]
        tl.store(dst, lid, mask=live)
        tl.store(dst + K, wbits, mask=live)
        carry += tl.sum(goes, axis=0)
    # rows carry..C-1 of region d: no token this call
    for p0 in range(carry // BLOCK_C * BLOCK_C, C, BLOCK_C):
        rows = p0 + tl.arange(0, BLOCK_C)
        free = ((rows >= carry) & (rows < C))[:, None] & in_k[None, :]
        dst = region + rows.to(tl.int64)[:, None] * (2 * K) + kk[None, :]
        tl.store(dst, tl.full((BLOCK_C, K_PAD), -1, tl.int32), mask=free)
        tl.store(dst + K, tl.zeros((BLOCK_C, K_PAD), tl.int32), mask=free)


def ep_route_tensors(topk_ids: torch.Tensor, topk_weights: torch.Tensor, E_local: int, R: int,
                     C: int, block_t: int | None = None):
    """(owner, ret_slot [T, K] int64, pos [T, R] int32, pos_t [R, T] int32, meta [R, C, 2K]
    int32; see the module docstring) of this rank's routing over R ranks of E_local experts
    each, C rows per region (C >= T). ``block_t`` (a power of two) overrides the token tile;
    tests lower it to cover many blocks."""
    T, K = topk_ids.shape
    if topk_weights.shape != (T, K):
        raise ValueError(f"ep_route: topk_weights {tuple(topk_weights.shape)} vs ids {(T, K)}")
    if C < T:
        raise ValueError(f"ep_route: {T} tokens do not fit regions of {C} rows")
    dev = topk_ids.device
    owner = torch.empty((T, K), dtype=torch.int64, device=dev)
    ret_slot = torch.empty((T, K), dtype=torch.int64, device=dev)
    pos = torch.empty((T, R), dtype=torch.int32, device=dev)
    pos_t = torch.empty((R, T), dtype=torch.int32, device=dev)
    meta = torch.empty((R, C, 2 * K), dtype=torch.int32, device=dev)
    K_PAD = triton.next_power_of_2(K)
    # [BLOCK_T, K_PAD] tiles of ~4K elements, 16 per thread at 8 warps: no spills at sm_90 (the
    # 64-bit pointer tiles dominate; 185 registers); 32 loop trips at T = 16384, K = 8
    BLOCK_T = block_t or max(16, min(1024, 4096 // K_PAD))
    BLOCK_C = max(16, min(1024, 4096 // K_PAD))
    _ep_route_kernel[(R,)](
        topk_ids, topk_weights, owner, ret_slot, pos, pos_t, meta,
        T, C, E_local, topk_ids.stride(0), topk_ids.stride(1),
        topk_weights.stride(0), topk_weights.stride(1),
        R=R, K=K, K_PAD=K_PAD, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=8,
    )
    return owner, ret_slot, pos, pos_t, meta
