"""The routing plan in three small Triton launches (GPU path of plan.build_plan).

The torch-op version of the plan is ~25 tiny launches; on the H200 machine the host needs
~1 ms to issue them while the GPU idles (measured: plan 1.16 ms of a 3.9 ms forward at the 30B
shape). These three kernels compute the same layout, bit for bit.

Slots are cut into chunks of SUB x BLOCK; each program of a launch owns one chunk and walks its
SUB sub-blocks in order.
  count  (grid = chunks): per-chunk histogram over local experts ([BLOCK, E_PAD] one-hot sum);
         also fills its share of row_slot with -1 (padding rows stay -1).
         Waits on: nothing. Signals: nothing (the next launch reads its output).
  scan   (grid = 1): exclusive prefix of the chunk histograms per expert (chunk_off), expert
         totals (count), padded segment starts (seg_start), tile_expert for every tile.
  place  (grid = chunks): rank of each slot among the earlier slots of its expert in its chunk
         (cumsum of the one-hot, plus a per-expert count carried across sub-blocks), row = seg_start[e] + chunk_off[chunk, e] + rank; writes
         slot_row and row_slot[row]. Increasing slot order inside each expert, as the torch path.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _local_key(ids_ptr, phase_ptr, slots, S, RANK_BASE, TOP_K, E: tl.constexpr,
               P: tl.constexpr):
    """Bin of each slot: its local expert, or with P phases the virtual expert
    local * P + phase[token]; E (= local experts * P) for slots not computed here."""
    g = tl.load(ids_ptr + slots, mask=slots < S, other=-1).to(tl.int64)
    local = g - RANK_BASE
    valid = (g >= 0) & (local >= 0) & (local < E // P)
    key = local
    if P > 1:
        key = local * P + tl.load(phase_ptr + slots // TOP_K, mask=valid, other=0)
    return tl.where(valid, key, E).to(tl.int32)


@triton.jit
def _plan_count_kernel(
    ids_ptr, phase_ptr, chunk_count_ptr, chunk_bad_ptr, row_slot_ptr, S, R_MAX, RANK_BASE,
    ROWS_PER_PROG, TOP_K, ID_LIMIT, E: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr,
    SUB: tl.constexpr, P: tl.constexpr, CHECK: tl.constexpr,
):
    c = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    hist = tl.zeros((E_PAD,), tl.int32)
    bad = tl.zeros((BLOCK,), tl.int32)
    for j in range(SUB):
        slots = (c * SUB + j) * BLOCK + tl.arange(0, BLOCK)
        key = _local_key(ids_ptr, phase_ptr, slots, S, RANK_BASE, TOP_K, E, P)
        hist += tl.sum((key[:, None] == experts[None, :]).to(tl.int32), axis=0)
        if CHECK:
            g = tl.load(ids_ptr + slots, mask=slots < S, other=-1).to(tl.int64)
            bad += ((g < -1) | (g >= ID_LIMIT)).to(tl.int32)
    tl.store(chunk_count_ptr + c * E_PAD + experts, hist)
    if CHECK:
        tl.store(chunk_bad_ptr + c, tl.sum(bad, axis=0))
    for r0 in range(0, ROWS_PER_PROG, BLOCK):
        rows = c * ROWS_PER_PROG + r0 + tl.arange(0, BLOCK)
        tl.store(row_slot_ptr + rows, tl.full((BLOCK,), -1, tl.int32), mask=rows < R_MAX)


@triton.jit
def _plan_scan_kernel(
    chunk_count_ptr, chunk_off_ptr, chunk_bad_ptr, ids_ok_ptr, count_ptr, seg_start_ptr,
    tile_expert_ptr, seg_real_ptr, count_real_ptr, phase_tiles_ptr,
    num_chunks, num_tiles,
    E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    CB: tl.constexpr, TB: tl.constexpr, P: tl.constexpr, ER_PAD: tl.constexpr,
    CHECK: tl.constexpr,
):
    experts = tl.arange(0, E_PAD)
    carry = tl.zeros((E_PAD,), tl.int32)
    bad = tl.zeros((CB,), tl.int32)
    for c0 in range(0, num_chunks, CB):
        chunks = c0 + tl.arange(0, CB)
        offs = chunks[:, None] * E_PAD + experts[None, :]
        m = (chunks < num_chunks)[:, None]
        cnt = tl.load(chunk_count_ptr + offs, mask=m, other=0)
        incl = tl.cumsum(cnt, axis=0)
        tl.store(chunk_off_ptr + offs, incl - cnt + carry[None, :], mask=m)
        carry += tl.sum(cnt, axis=0)
        if CHECK:
            bad += tl.load(chunk_bad_ptr + chunks, mask=chunks < num_chunks, other=0)
    if CHECK:
        # 1 when every id lies in [-1, ID_LIMIT): what torch._assert_async checks
        tl.store(ids_ok_ptr, (tl.sum(bad, axis=0) == 0).to(tl.int32))
    in_e = experts < E
    tl.store(count_ptr + experts, carry, mask=in_e)
    padded = (carry + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    seg_end = tl.cumsum(padded, axis=0)
    tl.store(seg_start_ptr + experts + 1, seg_end, mask=in_e)
    tl.store(seg_start_ptr + experts, seg_end - padded, mask=in_e)
    # expert of a tile = number of segment ends at or before its first row
    seg_end_e = tl.where(in_e, seg_end, 2147483647)
    for t0 in range(0, num_tiles, TB):
        tiles = t0 + tl.arange(0, TB)
        before = (seg_end_e[None, :] <= (tiles * BLOCK_M)[:, None]).to(tl.int32)
        e = tl.sum(before, axis=1)
        in_t = tiles < num_tiles
        # with phases, e is a virtual expert: real expert e // P, phase e % P
        real = tl.where(e < E, e // P, -1)
        tl.store(tile_expert_ptr + tiles, real, mask=in_t)
        if P > 1:
            for p in tl.static_range(P):
                tl.store(phase_tiles_ptr + p * num_tiles + tiles,
                         tl.where(e % P == p, real, -1), mask=in_t)
    if P > 1:
        # real experts' segments: [seg_start[e*P], seg_start[(e+1)*P]) (the virtual starts were
        # stored above; the barrier makes them visible to every thread of this program)
        tl.debug_barrier()
        er = tl.arange(0, ER_PAD)
        lo = tl.load(seg_start_ptr + er * P, mask=er <= E // P, other=0)
        hi = tl.load(seg_start_ptr + (er + 1) * P, mask=er < E // P, other=0)
        tl.store(seg_real_ptr + er, lo, mask=er <= E // P)
        tl.store(count_real_ptr + er, hi - lo, mask=er < E // P)


@triton.jit
def _plan_place_kernel(
    ids_ptr, phase_ptr, chunk_off_ptr, seg_start_ptr, slot_row_ptr, row_slot_ptr, S, RANK_BASE,
    TOP_K, E: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
    P: tl.constexpr,
):
    c = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    # rows this chunk already placed per expert, carried across its sub-blocks
    run = tl.zeros((E_PAD,), tl.int32)
    for j in range(SUB):
        slots = (c * SUB + j) * BLOCK + tl.arange(0, BLOCK)
        key = _local_key(ids_ptr, phase_ptr, slots, S, RANK_BASE, TOP_K, E, P)
        valid = key < E
        onehot = (key[:, None] == experts[None, :]).to(tl.int32)
        # the one-hot picks column key: rank = (inclusive count in this sub-block + run)[key] - 1
        rank = tl.sum((tl.cumsum(onehot, axis=0) + run[None, :]) * onehot, axis=1) - 1
        run += tl.sum(onehot, axis=0)
        base = tl.load(seg_start_ptr + key, mask=valid, other=0) + tl.load(
            chunk_off_ptr + c * E_PAD + key, mask=valid, other=0
        )
        row = tl.where(valid, base + rank, -1)
        tl.store(slot_row_ptr + slots, row, mask=slots < S)
        tl.store(row_slot_ptr + row, slots, mask=valid)


TARGET_CHUNKS = 256
"""Chunks (programs) per launch the sub-block count aims for; tests lower it to cover SUB > 1."""


def plan_tensors(topk_ids: torch.Tensor, E: int, block_m: int, rank: int, R_max: int,
                 phase: torch.Tensor | None = None, phases: int = 1, id_limit: int = 0):
    """(row_slot, slot_row, tile_expert, seg_start, count, phase_tiles, ids_ok) as int32
    tensors, same layout as the torch path of build_plan (phases = 1; phase_tiles is None) or of
    build_phased_plan (``phase`` [T] per token; phase_tiles [phases, num_tiles]).
    ``id_limit`` > 0: the count kernels also check every id against [-1, id_limit) and ids_ok
    (0-d) is 1 when all are in range, 0 otherwise (no host sync; the caller asserts on the
    device); ``id_limit`` 0: no check, ids_ok is None."""
    dev = topk_ids.device
    S = topk_ids.numel()
    K = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    ids = topk_ids.reshape(-1)
    P = phases
    EV = E * P  # bins of the histogram: (local expert, phase) pairs
    E_PAD = max(16, triton.next_power_of_2(EV))
    # keep the [BLOCK, E_PAD] one-hot at 16K int32 per program (64 registers a thread at 8 warps)
    BLOCK = max(16, min(128, 16384 // E_PAD))
    # a chunk = SUB sub-blocks of BLOCK slots; ~256 chunks keep the single-program scan short
    SUB = triton.next_power_of_2(max(1, min(16, triton.cdiv(S, BLOCK * TARGET_CHUNKS))))
    num_chunks = max(1, triton.cdiv(S, BLOCK * SUB))
    num_tiles = R_max // block_m
    rows_per_prog = triton.cdiv(triton.cdiv(R_max, num_chunks), BLOCK) * BLOCK

    i32 = torch.int32
    chunk_count = torch.empty((num_chunks, E_PAD), dtype=i32, device=dev)
    chunk_off = torch.empty((num_chunks, E_PAD), dtype=i32, device=dev)
    row_slot = torch.empty(R_max, dtype=i32, device=dev)
    slot_row = torch.empty(S, dtype=i32, device=dev)
    tile_expert = torch.empty(num_tiles, dtype=i32, device=dev)
    seg_virt = torch.empty(EV + 1, dtype=i32, device=dev)
    check = id_limit > 0
    chunk_bad = torch.empty(num_chunks, dtype=i32, device=dev) if check else chunk_count
    ids_ok = torch.empty((), dtype=i32, device=dev) if check else chunk_count
    count_virt = torch.empty(EV, dtype=i32, device=dev)
    if P > 1:
        seg_start = torch.empty(E + 1, dtype=i32, device=dev)
        count = torch.empty(E, dtype=i32, device=dev)
        phase_tiles = torch.empty((P, num_tiles), dtype=i32, device=dev)
        phase = phase.to(i32).contiguous()
    else:
        seg_start, count, phase_tiles, phase = seg_virt, count_virt, tile_expert, ids
    rank_base = rank * E
    _plan_count_kernel[(num_chunks,)](
        ids, phase, chunk_count, chunk_bad, row_slot, S, R_max, rank_base, rows_per_prog, K,
        id_limit, E=EV, E_PAD=E_PAD, BLOCK=BLOCK, SUB=SUB, P=P, CHECK=check, num_warps=8,
    )
    _plan_scan_kernel[(1,)](
        chunk_count, chunk_off, chunk_bad, ids_ok, count_virt, seg_virt, tile_expert, seg_start,
        count, phase_tiles, num_chunks, num_tiles,
        E=EV, E_PAD=E_PAD, BLOCK_M=block_m, CB=max(1, min(64, 8192 // E_PAD)),
        TB=max(1, min(128, 8192 // E_PAD)), P=P, ER_PAD=triton.next_power_of_2(E + 1),
        CHECK=check, num_warps=8,
    )
    if S:
        _plan_place_kernel[(num_chunks,)](
            ids, phase, chunk_off, seg_virt, slot_row, row_slot, S, rank_base, K,
            E=EV, E_PAD=E_PAD, BLOCK=BLOCK, SUB=SUB, P=P, num_warps=8,
        )
    return (row_slot, slot_row, tile_expert, seg_start, count, (phase_tiles if P > 1 else None),
            ids_ok if check else None)
