"""kernels/fp8_transpose.transpose_blocks: the transposed FP8 weight copies made from the FP8
copy are bitwise what quant_weight writes from the bf16 weight (q^T and s^T), for w2^T and for
the shared [w1 | w3]^T operand, whole or by a range of experts. Under TRITON_INTERPRET=1 on CPU,
compiled on a GPU."""

import pytest
import torch

from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import quant_weight, weight_blocks
from torchtitan_megamoe.ops.hopper.kernels.fp8_transpose import transpose_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(E, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * torch.logspace(-3, 3, E)[:, None, None]
    w[0, :128, :128] = 0  # an all-zero block: its scale is the floor, its values stay 0
    w[-1, -1, -1] = 1e4  # one outlier: its block's other values go subnormal or to 0
    return w.to(torch.bfloat16).to(DEVICE)


def _same(a, b):
    """Bitwise equal e4m3 tensors (compared as bytes: no float comparison)."""
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("E,N,K", [(3, 256, 128), (2, 128, 384)])
def test_transpose_matches_quantizing_into_the_transposed_layout(E, N, K):
    w = _weight(E, N, K, seed=E + N)
    q, s = weight_blocks(E, N, K, w.device)
    quant_weight(w, q=q, s=s)
    want_q, want_s = weight_blocks(E, N, K, w.device, transposed_n=N)
    quant_weight(w, qt=want_q, st=want_s)
    got_q, got_s = weight_blocks(E, N, K, w.device, transposed_n=N)
    transpose_blocks(q, s, got_q, got_s)
    assert _same(got_q, want_q) and torch.equal(got_s, want_s)


def test_w13_shared_operand_and_expert_ranges():
    E, H, D = 4, 128, 256
    w1, w3 = _weight(E, H, D, seed=1), _weight(E, H, D, seed=2)
    want_q, want_s = weight_blocks(E, H, D, w1.device, transposed_n=2 * H)
    quant_weight(w1, qt=want_q, st=want_s, t_col0=0)
    quant_weight(w3, qt=want_q, st=want_s, t_col0=H)
    fwd = []
    for w in (w1, w3):
        q, s = weight_blocks(E, H, D, w.device)
        quant_weight(w, q=q, s=s)
        fwd.append((q, s))
    got_q, got_s = weight_blocks(E, H, D, w1.device, transposed_n=2 * H)
    for (q, s), col in zip(fwd, (0, H)):
        transpose_blocks(q, s, got_q, got_s, t_col0=col)
    assert _same(got_q, want_q) and torch.equal(got_s, want_s)
    lo, hi = 1, 3  # a group of experts, as the backward's dgrad 1 takes them
    part_q, part_s = weight_blocks(hi - lo, H, D, w1.device, transposed_n=2 * H)
    for (q, s), col in zip(fwd, (0, H)):
        transpose_blocks(q[lo:hi], s[lo:hi], part_q, part_s, t_col0=col)
    assert _same(part_q, want_q[lo:hi]) and torch.equal(part_s, want_s[lo:hi])


def test_no_experts_is_a_no_op():
    q, s = weight_blocks(0, 128, 128, DEVICE)
    qt, st = weight_blocks(0, 128, 128, DEVICE, transposed_n=128)
    transpose_blocks(q, s, qt, st)
