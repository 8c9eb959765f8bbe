"""The EP token route: where each of this rank's tokens lands on every rank (the path of
ep_dispatch.TokenRoute).

Receive layout. Region s of rank d holds the tokens source s sends to d:
- on a peer (d != s) COMPACTLY: the tokens with at least one expert on d, in token order, at
  rows 0..n_d-1 (selective dispatch: a token's row travels once per rank owning one of its
  experts, to no other);
- in the source's own region (d == s) at row t for token t (identity): it never leaves the GPU,
  and the combine then finds a token's own partial at its own row.
The sender tells each peer its row count n_d (exchange "cnt"); the receiver ignores rows past
it, which hold stale data of earlier calls.

    owner    [T, K] int64     expert's rank per slot (-1: dropped slot)
    ret_slot [T, K] int64     flat index of slot (t, k) in an [R, C, K] buffer of rows the
                              owners send back (d(topk_weights)): (owner*C + pos[t, owner])*K + k,
                              -1 for dropped slots
    pos      [T, R] int32     row of token t in its region on rank d, -1 when t has no expert on
                              d: the exclusive count of earlier tokens going to d (d != me), t
                              (d == me)
    counts   [R] int32        rows sent to each rank: n_d (d != me); T for the own region
    src_tok  [R, C] int32     token at each compact row (rows < n_d of d != me; the rest unset)
    meta     [R, C, 2K] int32 per destination d, at row pos[t, d]: the K local ids of token t
                              (-1 for slots d does not own), then the K routing weights' fp32
                              bit patterns; the own region's rows t >= T: ids -1, weights 0;
                              peers' rows >= n_d unset

Two launches around a cumsum: _ep_goes_kernel (owner, which ranks each token goes to [R, T], the id
check), torch.cumsum over tokens (the compact rows: a scan in token order, so repeatable), and
_ep_meta_kernel, grid (R, C / BLOCK_T), program (d, b) writing destination d's rows of the
tokens [b*BLOCK_T, (b+1)*BLOCK_T): meta, src_tok and the ret_slot entries of the slots d owns.
Waits on: nothing (stream order). Signals: nothing; the dispatch copies rows after it."""

import torch
import triton
import triton.language as tl

from torchtitan_megamoe.ops.hopper.kernels.tiling import cdiv, next_power_of_2


@triton.jit
def _ids_tile(ids_ptr, tile, T, stride_ids_t, stride_ids_k, K: tl.constexpr, K_PAD: tl.constexpr,
              BLOCK_T: tl.constexpr):
    """Token tile ``tile``'s [BLOCK_T, K_PAD] global expert ids (-1 outside the batch) and its
    index vectors and masks."""
    kk = tl.arange(0, K_PAD)
    in_k = kk < K
    toks = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = toks < T
    m = in_t[:, None] & in_k[None, :]
    t64 = toks.to(tl.int64)
    g = tl.load(ids_ptr + t64[:, None] * stride_ids_t + kk[None, :] * stride_ids_k,
                mask=m, other=-1).to(tl.int32)  # global expert ids fit in int32
    return kk, in_k, toks, in_t, m, t64, g


@triton.jit
def _ep_goes_kernel(
    ids_ptr, owner_ptr, ret_slot_ptr, goes_ptr, ok_ptr, T, E_local, stride_ids_t, stride_ids_k,
    R: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    CHECK: tl.constexpr,
):
    kk, in_k, toks, in_t, m, t64, g = _ids_tile(ids_ptr, tl.program_id(0), T, stride_ids_t,
                                                stride_ids_k, K, K_PAD, BLOCK_T)
    own = tl.where(g >= 0, g // E_local, -1)
    slot = t64[:, None] * K + kk[None, :]
    if CHECK:
        # 1 when every id of the tile lies in [-1, R * E_local)
        bad = tl.sum(tl.sum(((g < -1) | (g >= R * E_local)).to(tl.int32), axis=1), axis=0)
        tl.store(ok_ptr + tl.program_id(0), (bad == 0).to(tl.int32))
    tl.store(owner_ptr + slot, own.to(tl.int64), mask=m)
    tl.store(ret_slot_ptr + slot, tl.full((BLOCK_T, K_PAD), -1, tl.int64),
             mask=m & ((own < 0) | (own >= R)))
    for d in tl.static_range(R):
        goes = tl.max((own == d).to(tl.int32), axis=1)  # [BLOCK_T]: 1 if t has a slot on d
        tl.store(goes_ptr + d * T + t64, goes, mask=in_t)  # [R, T]: the scan runs along T


@triton.jit
def _ep_meta_kernel(
    ids_ptr, w_ptr, pos_ptr, ret_slot_ptr, meta_ptr, src_tok_ptr,
    T, C, E_local, ME, stride_ids_t, stride_ids_k, stride_w_t, stride_w_k,
    R: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    d = tl.program_id(0)
    kk, in_k, toks, in_t, m, t64, g = _ids_tile(ids_ptr, tl.program_id(1), T, stride_ids_t,
                                                stride_ids_k, K, K_PAD, BLOCK_T)
    mine = (g >= 0) & (g // E_local == d)
    p = tl.load(pos_ptr + d * T + t64, mask=in_t, other=-1)  # pos [R, T]: d's row, coalesced
    own_region = (toks * 0 + d) == ME  # [BLOCK_T] bool (a scalar compare would not mask)
    # the own region: every row < C (rows >= T: no token); a peer's: the tokens going there
    row = tl.where(own_region, toks, p)
    live = tl.where(own_region, toks < C, p >= 0)
    r64 = row.to(tl.int64)
    # slot (t, k) of d's expert: its d(topk_weight) comes back at dtw[d, pos[t, d], k]
    ret = (d.to(tl.int64) * C + r64[:, None]) * K + kk[None, :]
    tl.store(ret_slot_ptr + t64[:, None] * K + kk[None, :], ret, mask=m & mine)
    tl.store(src_tok_ptr + d.to(tl.int64) * C + r64, toks, mask=live & in_t & ~own_region)
    wbits = tl.load(w_ptr + t64[:, None] * stride_w_t + kk[None, :] * stride_w_k,
                    mask=m, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    sm = live[:, None] & in_k[None, :]
    dst = meta_ptr + (d.to(tl.int64) * C + r64[:, None]) * (2 * K) + kk[None, :]
    tl.store(dst, tl.where(mine, g - d * E_local, -1).to(tl.int32), mask=sm)
    tl.store(dst + K, tl.where(mine, wbits, 0), mask=sm)


def ep_route_tensors(topk_ids: torch.Tensor, topk_weights: torch.Tensor, E_local: int, R: int,
                     C: int, me: int = 0, block_t: int | None = None, check_ids: bool = False):
    """(owner, ret_slot [T, K] int64, pos [T, R] int32, counts [R] int32, src_tok [R, C] int32,
    meta [R, C, 2K] int32, ids_ok; see the module docstring) of rank ``me``'s routing over R
    ranks of E_local experts each, C rows per region (C >= T). ``block_t`` (a power of two)
    overrides the token tile; tests lower it to cover many blocks. ``check_ids``: ids_ok is a
    0-d int32, 1 when every id lies in [-1, R * E_local) (the tiles check in passing; one
    reduction launch, no host sync), else None."""
    T, K = topk_ids.shape
    if topk_weights.shape != (T, K):
        raise ValueError(f"ep_route: topk_weights {tuple(topk_weights.shape)} vs ids {(T, K)}")
    if C < T:
        raise ValueError(f"ep_route: {T} tokens do not fit regions of {C} rows")
    dev = topk_ids.device
    owner = torch.empty((T, K), dtype=torch.int64, device=dev)
    ret_slot = torch.empty((T, K), dtype=torch.int64, device=dev)
    goes = torch.empty((R, T), dtype=torch.int32, device=dev)
    meta = torch.empty((R, C, 2 * K), dtype=torch.int32, device=dev)
    src_tok = torch.empty((R, C), dtype=torch.int32, device=dev)
    K_PAD = next_power_of_2(K)
    # [BLOCK_T, K_PAD] tiles of ~4K elements
    BLOCK_T = block_t or max(16, min(1024, 4096 // K_PAD))
    t_blocks = cdiv(T, BLOCK_T)
    ok = torch.ones(max(t_blocks, 1), dtype=torch.int32, device=dev) if check_ids else goes
    if T:
        _ep_goes_kernel[(t_blocks,)](
            topk_ids, owner, ret_slot, goes, ok, T, E_local,
            topk_ids.stride(0), topk_ids.stride(1),
            R=R, K=K, K_PAD=K_PAD, BLOCK_T=BLOCK_T, CHECK=check_ids, num_warps=8,
        )
    # the compact rows: earlier tokens going to d (a scan in token order: repeatable). Along
    # the contiguous dim: torch's scan over dim 0 of a [T, R] tensor runs R threads (ms)
    ahead = torch.cumsum(goes, dim=1, dtype=torch.int32)
    pos_rt = torch.where(goes > 0, ahead - 1, -1).to(torch.int32)
    counts = (ahead[:, -1] if T else goes.new_zeros(R)).clone()
    counts[me:me + 1].fill_(T)  # a kernel: `counts[me] = T` is a host copy (breaks graphs)
    pos_rt[me] = torch.where(goes[me] > 0, torch.arange(T, dtype=torch.int32, device=dev), -1)
    _ep_meta_kernel[(R, cdiv(C, BLOCK_T))](
        topk_ids, topk_weights, pos_rt, ret_slot, meta, src_tok, T, C, E_local, me,
        topk_ids.stride(0), topk_ids.stride(1), topk_weights.stride(0), topk_weights.stride(1),
        R=R, K=K, K_PAD=K_PAD, BLOCK_T=BLOCK_T, num_warps=8,
    )
    pos = pos_rt.t().contiguous()  # [T, R]: a token's R rows together, as its readers want
    return owner, ret_slot, pos, counts, src_tok, meta, (ok.amin() if check_ids else None)
