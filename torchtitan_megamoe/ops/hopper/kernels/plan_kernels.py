"""The routing plan in two small Triton launches (GPU path of plan.build_plan).

The torch-op version of the plan is ~25 tiny launches, whose issue keeps the GPU idle for a
large share of a forward. These two kernels compute the same layout, bit for bit.

Slots are cut into chunks of SUB x BLOCK; each program of a launch owns one chunk and walks its
SUB sub-blocks in order. Bins ("keys") are the local experts, plus bin E for slots not computed
here; E_PAD > E bins.
  count  (grid = chunks): per-chunk histogram of the keys (tl.histogram); fills its share of
         row_slot and tile_expert with -1, which the unused rows and tiles keep; with an id limit, counts the ids outside [-1, limit).
         Waits on: nothing. Signals: nothing (the next launch reads its output).
  place  (grid = chunks): first the scan, redone by every program (_chunk_prefix: the
         exclusive prefix of the chunk histograms per key up to its chunk, the totals, the
         padded segment starts; program 0 stores count, seg_start and the id check's verdict),
         then per sub-block it sorts key * BLOCK + lane (one tl.sort: slots of one key end up
         together, in increasing slot order), so the slot at sorted position p has rank
         p - (slots of smaller keys) in its key, and row = seg_start[key] + (the key's slots in
         earlier chunks and sub-blocks) + rank: one per-key base (through a per-chunk scratch
         row) plus p. Writes slot_row, row_slot[row], and tile_expert[row / block_m] at every
         row that starts a tile (a segment's first row of each tile is a real row: segments are
         padded to whole tiles, never by a whole tile). Increasing slot order inside each
         expert, as the torch path.
         Waits on: the count launch (stream order). Signals: nothing.
Every program redoes the scan instead of a one-program launch of its own: each launch before
the first GEMM costs the host tens of microseconds in a waited forward (tools/host_issue.py),
more than the redundant scans' reads from L2.
"""

import torch
import triton
import triton.language as tl

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.kernels.tiling import cdiv, next_power_of_2


@triton.jit
def _local_key(ids_ptr, slots, S, RANK_BASE, E: tl.constexpr):
    """Bin of each slot: its local expert; E for slots not computed here."""
    g = tl.load(ids_ptr + slots, mask=slots < S, other=-1).to(tl.int64)
    local = g - RANK_BASE
    valid = (g >= 0) & (local >= 0) & (local < E)
    return tl.where(valid, local, E).to(tl.int32)


@triton.jit
def _fill(ptr, n, first, count, BLOCK: tl.constexpr):
    """ptr[first : first + count] = -1 (clipped to n)."""
    for i0 in range(0, count, BLOCK):
        i = first + i0 + tl.arange(0, BLOCK)
        tl.store(ptr + i, tl.full((BLOCK,), -1, tl.int32), mask=(i < n) & (i < first + count))


@triton.jit
def _plan_count_kernel(
    ids_ptr, chunk_count_ptr, chunk_bad_ptr, row_slot_ptr, tiles_ptr, S, R_MAX,
    NUM_TILES, RANK_BASE, ROWS_PER_PROG, TILES_PER_PROG, ID_LIMIT, BSTRIDE,
    E: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
    CHECK: tl.constexpr,
):
    c = tl.program_id(0)
    # batch b: its ids, and its row of the plans' buffer (every output lies in it)
    b = tl.program_id(1).to(tl.int64)
    ids_ptr += b * S
    chunk_count_ptr += b * BSTRIDE
    chunk_bad_ptr += b * BSTRIDE
    row_slot_ptr += b * BSTRIDE
    tiles_ptr += b * BSTRIDE
    experts = tl.arange(0, E_PAD)
    hist = tl.zeros((E_PAD,), tl.int32)
    bad = tl.zeros((BLOCK,), tl.int32)
    for j in range(SUB):
        slots = (c * SUB + j) * BLOCK + tl.arange(0, BLOCK)
        key = _local_key(ids_ptr, slots, S, RANK_BASE, E)
        hist += tl.histogram(key, E_PAD)
        if CHECK:
            g = tl.load(ids_ptr + slots, mask=slots < S, other=-1).to(tl.int64)
            bad += ((g < -1) | (g >= ID_LIMIT)).to(tl.int32)
    tl.store(chunk_count_ptr + c * E_PAD + experts, hist)
    if CHECK:
        tl.store(chunk_bad_ptr + c, tl.sum(bad, axis=0))
    _fill(row_slot_ptr, R_MAX, c * ROWS_PER_PROG, ROWS_PER_PROG, BLOCK)
    _fill(tiles_ptr, NUM_TILES, c * TILES_PER_PROG, TILES_PER_PROG, BLOCK)


@triton.jit
def _chunk_prefix(chunk_count_ptr, chunk_bad_ptr, ids_ok_ptr, count_ptr, seg_start_ptr, c,
                  num_chunks, E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                  CB: tl.constexpr, CHECK: tl.constexpr):
    """First row of each key's slots in chunk c: seg_start[key] + the key's slots in chunks
    before c. Every program sums the chunk histograms itself (num_chunks x E_PAD int32 from L2:
    256 KiB at 30B), so no launch of its own sits between count and place; program 0 also
    stores the totals (count), the padded segment starts and the id check's verdict."""
    experts = tl.arange(0, E_PAD)
    total = tl.zeros((E_PAD,), tl.int32)
    before = tl.zeros((E_PAD,), tl.int32)
    bad = tl.zeros((CB,), tl.int32)
    for c0 in range(0, num_chunks, CB):
        chunks = c0 + tl.arange(0, CB)
        m = (chunks < num_chunks)[:, None]
        cnt = tl.load(chunk_count_ptr + chunks[:, None] * E_PAD + experts[None, :], mask=m,
                      other=0)
        total += tl.sum(cnt, axis=0)
        before += tl.sum(tl.where((chunks < c)[:, None], cnt, 0), axis=0)
        if CHECK:
            bad += tl.load(chunk_bad_ptr + chunks, mask=chunks < num_chunks, other=0)
    in_e = experts < E
    padded = tl.where(in_e, (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    seg_end = tl.cumsum(padded, axis=0)
    if c == 0:
        if CHECK:
            # 1 when every id lies in [-1, ID_LIMIT): what torch._assert_async checks
            tl.store(ids_ok_ptr, (tl.sum(bad, axis=0) == 0).to(tl.int32))
        tl.store(count_ptr + experts, total, mask=in_e)
        tl.store(seg_start_ptr + experts + 1, seg_end, mask=in_e)
        tl.store(seg_start_ptr + experts, seg_end - padded, mask=in_e)
    return tl.where(in_e, seg_end - padded + before, 0)


@triton.jit
def _plan_place_kernel(
    ids_ptr, chunk_count_ptr, chunk_bad_ptr, ids_ok_ptr, count_ptr, seg_start_ptr,
    num_chunks, base_ptr, slot_row_ptr, row_slot_ptr, tile_expert_ptr, S, RANK_BASE, BSTRIDE,
    E: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
    BLOCK_M: tl.constexpr, CB: tl.constexpr, CHECK: tl.constexpr,
):
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    ids_ptr += b * S
    chunk_count_ptr += b * BSTRIDE
    chunk_bad_ptr += b * BSTRIDE
    ids_ok_ptr += b * BSTRIDE
    count_ptr += b * BSTRIDE
    seg_start_ptr += b * BSTRIDE
    base_ptr += b * BSTRIDE
    slot_row_ptr += b * BSTRIDE
    row_slot_ptr += b * BSTRIDE
    tile_expert_ptr += b * BSTRIDE
    experts = tl.arange(0, E_PAD)
    lanes = tl.arange(0, BLOCK)
    # first row of each key in this chunk, advanced past each sub-block's rows
    first = _chunk_prefix(chunk_count_ptr, chunk_bad_ptr, ids_ok_ptr, count_ptr, seg_start_ptr,
                          c, num_chunks, E, E_PAD, BLOCK_M, CB, CHECK)
    for j in range(SUB):
        slots0 = (c * SUB + j) * BLOCK
        key = _local_key(ids_ptr, slots0 + lanes, S, RANK_BASE, E)
        hist = tl.histogram(key, E_PAD)
        # the row of sorted position p is base[key] + p, base = first - (slots of smaller keys)
        tl.store(base_ptr + c * E_PAD + experts, first - (tl.cumsum(hist, axis=0) - hist))
        tl.debug_barrier()  # the base row is read back by other threads
        v = tl.sort(key * BLOCK + lanes, 0)
        skey = v // BLOCK
        slot = slots0 + v % BLOCK
        valid = skey < E
        row = tl.load(base_ptr + c * E_PAD + skey, mask=valid, other=0) + lanes
        tl.store(slot_row_ptr + slot, tl.where(valid, row, -1), mask=slot < S)
        tl.store(row_slot_ptr + row, slot, mask=valid)
        # a row at a tile boundary starts a tile of its key's expert
        starts = valid & (row % BLOCK_M == 0)
        tl.store(tile_expert_ptr + row // BLOCK_M, skey, mask=starts)
        first += hist
        tl.debug_barrier()  # every thread has read the base row before the next store


TARGET_CHUNKS = 256
"""Chunks (programs) per launch the sub-block count aims for; tests lower it to cover SUB > 1."""

BLOCK_SLOTS = 512
"""Slots per sub-block (one tl.sort each); the interpreter uses 16 (several sub-blocks and
chunks at test sizes)."""


def plan_tensors(topk_ids: torch.Tensor, E: int, block_m: int, rank: int, R_max: int,
                 id_limit: int = 0):
    """(row_slot, slot_row, tile_expert, seg_start, count, ids_ok, packed) as int32 tensors,
    the layout of the torch path of build_plan. ``id_limit`` > 0: the count kernels also check
    every id against [-1, id_limit) and ids_ok (0-d) is 1 when all are in range, 0 otherwise
    (no host sync; the caller asserts on the device); ``id_limit`` 0: no check, ids_ok is None.
    ``packed``: the first five as one flat view, plan.pack_plan's layout.

    ``topk_ids`` [B, T, K]: B independent plans (R_max rows each) from the same two launches,
    each tensor then with a leading batch dimension (ids_ok [B])."""
    dev = topk_ids.device
    B = topk_ids.shape[0] if topk_ids.dim() == 3 else 1
    S = topk_ids.numel() // B
    ids = topk_ids.reshape(-1)
    E_PAD = max(16, next_power_of_2(E + 1))
    BLOCK = 16 if settings.triton_interpreting() else BLOCK_SLOTS
    # a chunk = SUB sub-blocks of BLOCK slots; ~TARGET_CHUNKS chunks keep each program's scan
    # short
    SUB = next_power_of_2(max(1, min(16, cdiv(S, BLOCK * TARGET_CHUNKS))))
    num_chunks = max(1, cdiv(S, BLOCK * SUB))
    num_tiles = R_max // block_m
    rows_per_prog = cdiv(R_max, num_chunks)
    tiles_per_prog = cdiv(num_tiles, num_chunks)

    # every int32 vector of a plan carved from one allocation (one row of it per batch): each
    # torch.empty costs host microseconds (tools/host_issue.py), and the plan needed ten before
    # the first GEMM. The plan's own vectors come first, back to back in plan.pack_plan's order
    # (the packed plan is a view, no copy); the scratch parts after them start 16-byte aligned.
    check = id_limit > 0
    main = [R_max, S, num_tiles, E + 1, E]
    scratch = [num_chunks * E_PAD] * 2 + [num_chunks if check else 0, 1 if check else 0]
    sizes = main + [-(-n // 4) * 4 for n in scratch]
    sizes.insert(len(main), -sum(main) % 4)
    buf = torch.empty((B, sum(sizes)), dtype=torch.int32, device=dev)
    parts = buf.split(sizes, dim=1)
    row_slot, slot_row, tile_expert, seg_start, count = parts[:5]
    chunk_count, base = parts[6:8]
    chunk_bad = parts[8] if check else chunk_count
    ids_ok = parts[9][:, 0] if check else chunk_count
    rank_base = rank * E
    grid = (num_chunks, B)
    _plan_count_kernel[grid](
        ids, chunk_count, chunk_bad, row_slot, tile_expert, S, R_max, num_tiles, rank_base,
        rows_per_prog, tiles_per_prog, id_limit, buf.stride(0), E=E, E_PAD=E_PAD, BLOCK=BLOCK,
        SUB=SUB, CHECK=check, num_warps=8,
    )
    # one launch after the count: its programs also take the scan's place (_chunk_prefix); it
    # runs even without slots, since program 0 writes seg_start, count and ids_ok
    _plan_place_kernel[grid](
        ids, chunk_count, chunk_bad, ids_ok, count, seg_start, num_chunks, base, slot_row,
        row_slot, tile_expert, S, rank_base, buf.stride(0), E=E, E_PAD=E_PAD, BLOCK=BLOCK,
        SUB=SUB, BLOCK_M=block_m, CB=max(1, min(64, 8192 // E_PAD)), CHECK=check, num_warps=8,
    )
    out = (row_slot, slot_row, tile_expert, seg_start, count, ids_ok if check else None,
           buf[:, :sum(main)])
    if topk_ids.dim() == 3:
        return out
    return tuple(None if t is None else t[0] for t in out)
