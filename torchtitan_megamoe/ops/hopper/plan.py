"""Routing plan: where each (token, k) slot's row lives in the expert-grouped row space.

The grouped GEMMs walk a row space in which every local expert owns one contiguous segment,
padded to a multiple of the GEMM tile height, so that each tile belongs to exactly one expert.
``build_plan`` computes that layout on the device with plain torch ops and NO host sync: every
shape is a static function of (T, K, E_local, block_m), so the kernels launch a fixed grid and
tiles past the real end exit early. That keeps the op capturable (CUDA graphs, torch.compile)
and free of the per-layer ``.item()`` stalls stock TorchTitan pays.

Slot s = t * K + k. Rows inside an expert's segment are in increasing slot order, which makes
every downstream reduction order (and so the result) deterministic.
"""

from dataclasses import dataclass

import torch


@dataclass
class Plan:
    """Layout of one call's rows. Tensors are int32 on the routing's device unless noted."""

    row_slot: torch.Tensor
    """[R_max] slot feeding each row; -1 for padding rows (which load zeros and whose outputs
    are never read)."""

    slot_row: torch.Tensor
    """[T*K] row of each slot; -1 when the slot is dropped (id -1) or its expert is not local."""

    tile_expert: torch.Tensor
    """[num_tiles] local expert of each block_m-row tile; -1 for tiles past the used rows."""

    seg_start: torch.Tensor
    """[E_local + 1] first row of each expert's segment (exclusive cumsum of padded counts);
    seg_start[E_local] is the number of rows in use."""

    count: torch.Tensor
    """[E_local] real (unpadded) rows per local expert."""

    num_rows_used: torch.Tensor
    """0-d: rows in use, padding included (== seg_start[E_local])."""

    num_tokens: int
    """T."""

    top_k: int
    """K."""

    num_local_experts: int
    """E_local."""

    block_m: int
    """Tile height every segment is padded to."""

    ids_ok: torch.Tensor | None = None
    """0-d int32, 1 when every id lay in [-1, id_limit) (build_plan's ``id_limit``), else 0;
    None when the plan was built without the check."""

    packed: torch.Tensor | None = None
    """The first five vectors as one flat view in pack_plan's layout, where they were allocated
    that way (the plan kernels); None: pack_plan copies them."""

    @property
    def max_rows(self) -> int:
        """R_max: static upper bound of rows in use."""
        return self.row_slot.numel()

    @property
    def num_tiles(self) -> int:
        return self.tile_expert.numel()

    def with_tiles(self, tile_expert: torch.Tensor) -> "Plan":
        """This plan with another tile map (a GEMM launched with it skips the tiles at -1)."""
        return self.replaced(tile_expert=tile_expert)

    def replaced(self, **fields) -> "Plan":
        """This plan with ``fields`` replaced (e.g. count: a weight gradient walks count[e]
        rows of expert e's segment, 0 skips it; row_slot[:n]: a gather writes rows < n only).
        A shallow copy: dataclasses.replace re-runs __init__ and its field handling, host time
        on the way to the GEMMs."""
        other = object.__new__(Plan)
        other.__dict__.update(self.__dict__)
        other.__dict__.update(fields)
        return other


def max_rows(num_slots: int, num_local_experts: int, block_m: int) -> int:
    """R_max = T*K + E_local*(block_m-1), rounded up to block_m: the most rows any routing of
    ``num_slots`` slots can need once every expert's segment is padded."""
    r = num_slots + num_local_experts * (block_m - 1)
    return (r + block_m - 1) // block_m * block_m


def build_plan(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    block_m: int,
    rank: int = 0,
    ep_size: int = 1,
    use_kernels: bool = False,
    id_limit: int = 0,
) -> Plan:
    """Lay out the slots of ``topk_ids`` [T, K] (global expert ids, -1 = dropped) that belong to
    this rank's experts [rank*E_local, (rank+1)*E_local), grouped by local expert.

    Everything runs on ``topk_ids.device`` with fixed output shapes; no host synchronization.
    CUDA inputs (or ``use_kernels=True``, e.g. under TRITON_INTERPRET=1) take the Triton path
    (plan_kernels.py); CPU inputs the torch-op path. Both give identical tensors.
    ``id_limit`` > 0: also check every id against [-1, id_limit) on the device, into
    plan.ids_ok (the count kernels do it in passing: no extra launch, no host sync).
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if num_local_experts < 1 or block_m < 1:
        raise ValueError(
            f"num_local_experts ({num_local_experts}) and block_m ({block_m}) must be >= 1"
        )
    if not 0 <= rank < ep_size:
        raise ValueError(f"rank {rank} is outside the EP group of size {ep_size}")

    T, K = topk_ids.shape
    E = num_local_experts
    S = T * K
    R_max = max_rows(S, E, block_m)
    if topk_ids.is_cuda or use_kernels:
        # Same layout from three Triton launches: the ~25 torch ops below keep the GPU idle
        # while the host issues them.
        from torchtitan_megamoe.ops.hopper.kernels.plan_kernels import plan_tensors

        row_slot, slot_row, tile_expert, seg_start, count, ids_ok, packed = plan_tensors(
            topk_ids.contiguous(), E, block_m, rank, R_max, id_limit=id_limit
        )
        return Plan(
            row_slot=row_slot, slot_row=slot_row, tile_expert=tile_expert,
            seg_start=seg_start, count=count, num_rows_used=seg_start[E],
            num_tokens=T, top_k=K, num_local_experts=E, block_m=block_m, ids_ok=ids_ok,
            packed=packed,
        )

    dev = topk_ids.device
    num_tiles = R_max // block_m

    local = topk_ids.reshape(-1).to(torch.int64) - rank * E
    valid = (topk_ids.reshape(-1) >= 0) & (local >= 0) & (local < E)
    # Invalid slots get the key E so they sort after every real expert and fall in bin E.
    key = torch.where(valid, local, torch.full_like(local, E))

    count_all = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    count_all.scatter_add_(0, key, torch.ones_like(key))
    count = count_all[:E]
    padded = (count + block_m - 1) // block_m * block_m
    seg_start = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    seg_start[1:] = torch.cumsum(padded, 0)
    # First sorted position of each key, to turn sorted positions into ranks within an expert.
    key_first = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    key_first[1:] = torch.cumsum(count_all[:E], 0)

    # A stable sort keeps slots of one expert in increasing slot order (deterministic layout).
    _, order = torch.sort(key, stable=True)
    sorted_key = key[order]
    rank_in_expert = torch.arange(S, device=dev) - key_first[sorted_key]
    # Padded seg_start extended with a dummy base for the invalid key; its rows are discarded.
    base = torch.cat([seg_start[:E], seg_start.new_zeros(1)])
    row_sorted = base[sorted_key] + rank_in_expert
    row_sorted = torch.where(sorted_key < E, row_sorted, torch.full_like(row_sorted, -1))

    slot_row = torch.empty(S, dtype=torch.int64, device=dev)
    slot_row.scatter_(0, order, row_sorted)

    # Invalid slots scatter into a dummy row R_max that is cut off afterwards (no boolean
    # indexing, which would need the host to learn the output size).
    row_slot = torch.full((R_max + 1,), -1, dtype=torch.int64, device=dev)
    dest = torch.where(slot_row >= 0, slot_row, torch.full_like(slot_row, R_max))
    row_slot.scatter_(0, dest, torch.arange(S, device=dev))
    row_slot = row_slot[:R_max]

    # Expert of each tile: the number of segment ends at or before the tile's first row.
    tile_start = torch.arange(num_tiles, device=dev, dtype=torch.int64) * block_m
    tile_expert = torch.searchsorted(seg_start[1:].contiguous(), tile_start, right=True)
    tile_expert = torch.where(tile_expert < E, tile_expert, torch.full_like(tile_expert, -1))

    i32 = torch.int32
    ids_ok = None
    if id_limit > 0:
        ids = topk_ids.reshape(-1)
        ids_ok = ((ids >= -1) & (ids < id_limit)).all().to(i32)
    return Plan(
        ids_ok=ids_ok,
        row_slot=row_slot.to(i32),
        slot_row=slot_row.to(i32),
        tile_expert=tile_expert.to(i32),
        seg_start=seg_start.to(i32),
        count=count.to(i32),
        num_rows_used=seg_start[E].to(i32),
        num_tokens=T,
        top_k=K,
        num_local_experts=E,
        block_m=block_m,
    )


def build_plans(topk_ids: torch.Tensor, num_local_experts: int, block_m: int,
                use_kernels: bool = False) -> tuple[list[Plan], torch.Tensor]:
    """build_plan of each batch of ``topk_ids`` [B, T, K] (LOCAL expert ids, -1: not here):
    B independent plans, on CUDA (or ``use_kernels``) from the same two launches (the EP
    forward's regions: one launch pair per call instead of one per region, host time that
    the small regions' GEMMs do not cover). Also returns their packed plans as ONE [B, N]
    tensor (what the EP forward saves: a custom op's outputs may not alias each other)."""
    if topk_ids.dim() != 3:
        raise ValueError(f"topk_ids must be [B, T, K], got shape {tuple(topk_ids.shape)}")
    if not (topk_ids.is_cuda or use_kernels):
        plans = [build_plan(ids, num_local_experts, block_m) for ids in topk_ids]
        return plans, torch.stack([pack_plan(p) for p in plans])
    from torchtitan_megamoe.ops.hopper.kernels.plan_kernels import plan_tensors

    B, T, K = topk_ids.shape
    E = num_local_experts
    R_max = max_rows(T * K, E, block_m)
    row_slot, slot_row, tile_expert, seg_start, count, _, packed = plan_tensors(
        topk_ids.contiguous(), E, block_m, 0, R_max)
    return [Plan(row_slot=row_slot[b], slot_row=slot_row[b], tile_expert=tile_expert[b],
                 seg_start=seg_start[b], count=count[b], num_rows_used=seg_start[b, E],
                 num_tokens=T, top_k=K, num_local_experts=E, block_m=block_m,
                 packed=packed[b]) for b in range(B)], packed


def pack_plan(plan: Plan) -> torch.Tensor:
    """The plan's int32 tensors as one flat int32 tensor (what the forward saves for the
    backward): [row_slot R_max | slot_row T*K | tile_expert R_max/block_m | seg_start E+1 |
    count E]. Its length is a static function of (T, K, E_local, block_m). A view of the plan's
    own storage where the plan kernels laid it out so (no copy kernel in the forward)."""
    if plan.packed is not None:
        return plan.packed
    return torch.cat([plan.row_slot, plan.slot_row, plan.tile_expert, plan.seg_start, plan.count])


def packed_plan_numel(num_tokens: int, top_k: int, num_local_experts: int, block_m: int) -> int:
    """Length of pack_plan's tensor (also what a fake impl allocates)."""
    r = max_rows(num_tokens * top_k, num_local_experts, block_m)
    return r + num_tokens * top_k + r // block_m + 2 * num_local_experts + 1


def unpack_plan(
    packed: torch.Tensor, num_tokens: int, top_k: int, num_local_experts: int, block_m: int
) -> Plan:
    """Inverse of pack_plan: views into ``packed`` (no copy, no host sync). The static
    arguments must be those of the build_plan call that made it; a length that does not fit
    raises."""
    T, K, E = num_tokens, top_k, num_local_experts
    want = packed_plan_numel(T, K, E, block_m)
    if packed.dim() != 1 or packed.numel() != want or packed.dtype != torch.int32:
        raise ValueError(
            f"packed plan has shape {tuple(packed.shape)} / {packed.dtype}; expected [{want}] "
            f"int32 for T={T}, K={K}, E_local={E}, block_m={block_m} (was it saved with "
            "another block_m?)"
        )
    r = max_rows(T * K, E, block_m)
    row_slot, slot_row, tile_expert, seg_start, count = torch.split(
        packed, [r, T * K, r // block_m, E + 1, E]
    )
    return Plan(
        row_slot=row_slot, slot_row=slot_row, tile_expert=tile_expert, seg_start=seg_start,
        count=count, num_rows_used=seg_start[E], num_tokens=T, top_k=K, num_local_experts=E,
        block_m=block_m,
    )
