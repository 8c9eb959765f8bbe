"""kernels/row_store.py: the saved store's static slots, which regions the backward finds in
them, and the copy of a recomputed region's rows into its slot."""

import pytest
import torch

from torchtitan_megamoe.ops.hopper.kernels.row_store import copy_unkept, kept_slots, slot_view

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _kept_by_hand(used, S):
    reach, kept = 0, []
    for i, n in enumerate(used):
        keep = n <= S and reach <= i * S
        kept.append(keep)
        if not keep:
            reach = max(reach, i * S + n)
    return kept


@pytest.mark.parametrize("used", [
    [5, 8, 0, 7],            # every region fits its slot of 8
    [5, 12, 3, 4, 9, 2],     # 12 spills into slot 2 (3 is lost), 9 into slot 5
    [20, 1, 1, 1],           # one region's spill reaches past two slots
    [0, 9, 0, 0],
])
def test_regions_spilled_over_are_not_kept(used):
    got = kept_slots(torch.tensor(used, dtype=torch.int32, device=DEV), 8).tolist()
    assert got == _kept_by_hand(used, 8)
    if used == [5, 12, 3, 4, 9, 2]:
        assert got == [True, False, False, True, False, False]
    if used == [20, 1, 1, 1]:
        assert got == [False, False, False, True]


@pytest.mark.parametrize("dtype,W", [(torch.bfloat16, 96), (torch.float32, 5)])
@pytest.mark.parametrize("kept", [False, True])
def test_copy_unkept_moves_count_rows_unless_kept(dtype, W, kept):
    g = torch.Generator().manual_seed(0)
    src = torch.randn(13, W, generator=g).to(dtype).to(DEV)
    dst = torch.full((13, W), -3.0, dtype=dtype, device=DEV)  # poisoned
    copy_unkept(src, dst, torch.tensor(9, dtype=torch.int32, device=DEV),
                torch.tensor(kept, device=DEV))
    if kept:
        assert (dst == -3).all()
    else:
        assert torch.equal(dst[:9], src[:9]) and (dst[9:] == -3).all()


def test_slot_views_stay_inside_the_store_and_errors_are_clear():
    store = torch.zeros(3 * 8 + 20, 4)
    assert slot_view(store, 3, 8, 20).data_ptr() == store[24].data_ptr()
    with pytest.raises(ValueError, match="past the store"):
        slot_view(store, 4, 8, 20)
    with pytest.raises(ValueError, match="32-bit"):
        copy_unkept(torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(4, 3, dtype=torch.bfloat16),
                    torch.tensor(1, dtype=torch.int32), torch.tensor(False))
    with pytest.raises(ValueError, match="int32"):
        kept_slots(torch.zeros(3, dtype=torch.int64), 8)


@pytest.mark.parametrize("R", [2, 8])
@pytest.mark.parametrize("D, H", [(2048, 768), (4096, 1536)])  # Qwen3-30B-A3B, -235B-A22B
def test_ep_forward_keeps_the_qwen3_pre_activations_below_stock(R, D, H):
    """At 16384 tokens per rank, top-8 of 128 experts, the EP forward's store of GEMM 1's
    pre-activations is kept (ep_forward.keeps_saved) for both recipes' plan rows: each slot
    holds SAVE_MARGIN x a region's slots at uniform routing plus its padding, and every
    region's view of the most rows it can use lies inside the store."""
    from torchtitan_megamoe.ops.hopper.ep_forward import (
        SAVE_MARGIN, keeps_saved, saved_rows, slot_rows,
    )
    from torchtitan_megamoe.ops.hopper.plan import max_rows

    C, K, E_local = 16384, 8, 128 // R
    for block_m in (64, 128):
        assert keeps_saved(R, C, K, E_local, D, H, block_m)
        S, rows = slot_rows(R, C, K, E_local, block_m), saved_rows(R, C, K, E_local, block_m)
        assert S >= SAVE_MARGIN * C * K / R + E_local * (block_m - 1) and S % block_m == 0
        M = max_rows(C * K, E_local, block_m)
        slot_view(torch.empty(rows, 0), R - 1, S, M)  # the last region's view fits
        assert rows * 2 * H * 2 < C * K * (D + 3 * H) * 2  # bytes: ours < stock's saved
