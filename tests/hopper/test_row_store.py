"""kernels/row_store.py: blocks of device-counted rows into a bounded store and back."""

import pytest
import torch

from torchtitan_megamoe.ops.hopper.kernels.row_store import kept, stash_rows, unstash_rows

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype,W", [(torch.bfloat16, 96), (torch.float32, 5)])
def test_blocks_that_fit_come_back_and_the_others_are_not_kept(dtype, W):
    g = torch.Generator().manual_seed(0)
    counts = [7, 0, 12, 9, 3]  # the store holds 7 + 0 + 12 + 3 = 22: block 3 (9) does not fit
    cap = 24
    store = torch.full((cap, W), float("nan"), dtype=dtype, device=DEV)
    offs = torch.zeros(len(counts) + 1, dtype=torch.int32, device=DEV)
    blocks = [torch.randn(13, W, generator=g).to(dtype).to(DEV) for _ in counts]
    for i, (b, n) in enumerate(zip(blocks, counts)):
        stash_rows(b, store, offs, i, torch.tensor(n, dtype=torch.int32, device=DEV))
    assert offs.tolist() == [0, 7, 7, 19, 19, 22]
    for i, (b, n) in enumerate(zip(blocks, counts)):
        cnt = torch.tensor([n], dtype=torch.int32, device=DEV)
        dst = torch.full_like(b, -3.0)  # poisoned: rows past n and unkept blocks stay so
        unstash_rows(store, dst, offs, i, cnt)
        assert bool(kept(offs, i, cnt)) == (i != 3)
        if i == 3:
            assert (dst == -3).all()
        else:
            assert torch.equal(dst[:n], b[:n]) and (dst[n:] == -3).all()


def test_rows_must_be_whole_words_and_offs_int32():
    with pytest.raises(ValueError, match="32-bit"):
        stash_rows(torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(4, 3, dtype=torch.bfloat16),
                   torch.zeros(2, dtype=torch.int32), 0, torch.tensor(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        stash_rows(torch.zeros(2, 4), torch.zeros(4, 4), torch.zeros(2, dtype=torch.int64), 0,
                   torch.tensor(1, dtype=torch.int32))


@pytest.mark.parametrize("R", [2, 8])
@pytest.mark.parametrize("D, H", [(2048, 768), (4096, 1536)])  # Qwen3-30B-A3B, -235B-A22B
def test_ep_forward_keeps_the_qwen3_pre_activations_below_stock(R, D, H):
    """At 16384 tokens per rank, top-8 of 128 experts, the EP forward's store of GEMM 1's
    pre-activations is kept (ep_forward.keeps_saved) for both recipes' plan rows, and holds
    at least SAVE_MARGIN x the slots a rank receives at uniform routing."""
    from torchtitan_megamoe.ops.hopper.ep_forward import SAVE_MARGIN, keeps_saved, saved_rows

    C, K, E_local = 16384, 8, 128 // R
    for block_m in (64, 128):
        assert keeps_saved(R, C, K, E_local, D, H, block_m)
        rows = saved_rows(R, C, K, E_local, block_m)
        assert rows >= SAVE_MARGIN * C * K and rows % block_m == 0
        assert rows * 2 * H * 2 < C * K * (D + 3 * H) * 2  # bytes: ours < stock's saved
