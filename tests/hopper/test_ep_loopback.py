"""EP=R of backend ``hopper`` as R loopback ranks in one process (ops/loopback.py,
ops/loopback_moe.py): forward and every gradient vs the reference backend at EP=1 on the
concatenated batch with all experts, and vs the hopper kernels at EP=1 on that batch; repeated
runs bitwise equal; skewed routings; the loopback group's errors. On CPU the kernels run under
the interpreter; the GPU variants run R ranks on one GPU, one stream each."""

import pytest
import torch

from moe_testing import NAMES, make_inputs, make_weights, op_args, rel_err, same_bits
from torchtitan_megamoe.ops.api import mega_moe
from torchtitan_megamoe.ops.groups import group_from_name
from torchtitan_megamoe.ops.loopback import LoopbackError, run_ranks
from torchtitan_megamoe.ops.hopper.ep_dispatch import TRAFFIC
from torchtitan_megamoe.ops.loopback_moe import loopback_moe, shard
from torchtitan_megamoe.ops.recipe import recipe_named
from torchtitan_megamoe.timing import capture

K, D, H = 3, 32, 32  # D, H multiples of 16: the interpreter's tiles
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant is for CPU")
TOL = dict(out=1e-2, dx=1.5e-2, dtopk_weights=1e-2, dw1=1e-2, dw2=1e-2, dw3=1e-2)
"""vs the reference in fp32: dx is 1.5e-2 because the hopper bf16 backward's dx is ~1e-2 off
at these tiny shapes at EP=1 too (its bf16 intermediates); the EP=1 comparison below is tight."""


def _case(R, tokens, E, seed, skew=False):
    """One batch of sum(tokens) tokens with all E experts: uneven random routing, dropped slots
    (NaN weights), an expert of rank 1 empty and rank 0's first expert heavy; ``skew``: every
    slot on rank 0's experts."""
    T = sum(tokens)
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(T, K, E, D, H, generator=g)
    ids = inp["topk_ids"]
    el = E // R
    if skew:
        ids = torch.randint(0, el, (T, K), generator=g)
    ids[ids == el] = 0  # rank 1's first expert gets nothing, rank 0's first the most
    ids[torch.rand(T, K, generator=g) < 0.25] = -1
    inp["topk_ids"] = ids
    inp["topk_weights"][ids < 0] = float("nan")  # dropped slots must not leak
    return inp


def _per_rank(t, tokens):
    return list(torch.split(t, tokens))


def _loopback(R, inp, tokens, **kw):
    shards = shard(R, *op_args(inp), tokens=tokens)
    return loopback_moe(shards, _per_rank(inp["dy"], tokens), precision="bf16", **kw)


def _reference(inp):
    """Forward and gradients of the reference backend at EP=1, fp32 copies of the bf16 inputs."""
    leaves = [t.detach().float().requires_grad_() if t.is_floating_point() else t
              for t in op_args(inp)]
    out = mega_moe(*leaves, backend="reference")
    out.backward(inp["dy"].float())
    return [out.detach()] + [leaves[i].grad for i in (0, 2, 3, 4, 5)]


def _check(R, tokens, E, seed=0, skew=False, **kw):
    inp = _case(R, tokens, E, seed, skew)
    ranks = _loopback(R, inp, tokens, **kw)
    again = _loopback(R, inp, tokens, **kw)
    got = _gathered(ranks, R)
    ep1 = _gathered(_loopback(1, inp, [sum(tokens)], **kw), 1)
    ref = _reference(inp)
    for name, g, e, r in zip(("out", *NAMES), got, ep1, ref):
        assert not g.isnan().any(), name
        assert rel_err(g, r) <= TOL[name], f"{name}: rel err vs reference {rel_err(g, r):.2e}"
        assert rel_err(g, e) <= 5e-3, f"{name}: rel err vs hopper EP=1 {rel_err(g, e):.2e}"
    for r, (a, b) in enumerate(zip(ranks, again)):
        assert all(same_bits(x, y) for x, y in zip(a, b)), f"rank {r}: two runs differ"
    assert (got[2][inp["topk_ids"] < 0] == 0).all()  # d(topk_weights) of dropped slots
    if R > 1 and not skew:
        assert (ranks[1][3][0] == 0).all()  # rank 1's empty expert: dw1 exactly zero
    return ranks


def _rows(inp, tokens, E):
    """(sent, received) per rank: token rows a rank stores into its peers (one per token and
    other rank owning one of its experts) and rows its peers store into it."""
    R = len(tokens)
    el = E // R
    sent, received = [0] * R, [0] * R
    for r, ids in enumerate(_per_rank(inp["topk_ids"], tokens)):
        for row in ids.tolist():
            for d in {i // el for i in row if i >= 0} - {r}:
                sent[r] += 1
                received[d] += 1
    return sent, received


def _metered(fn):
    """fn() with the exchange's meter on: (result, {rank: {transfer: bytes}})."""
    TRAFFIC.take()
    TRAFFIC.on = True
    try:
        return fn(), TRAFFIC.take()
    finally:
        TRAFFIC.on = False


def _check_bytes(traffic, inp, tokens, E, x_row, dy_row):
    """Counted bytes per rank and transfer = the rows selective dispatch must move, times the
    row's bytes (x_row / dy_row: the dispatched rows' bytes in the recipe's precision)."""
    sent, received = _rows(inp, tokens, E)
    R = len(tokens)
    for r in range(R):
        want = {"dispatch": sent[r] * x_row, "combine": received[r] * D * 2,
                "dispatch dy": sent[r] * dy_row, "dispatch x": sent[r] * D * 2,
                "return dx": received[r] * (D * 2 + 4 * K),
                "dispatch meta": sent[r] * 8 * K + 4 * (R - 1),
                "dispatch dy meta": sent[r] * 8 * K + 4 * (R - 1)}
        got = traffic.get(r, {})
        assert {t: got.get(t, 0) for t in want} == want, f"rank {r}"


def _gathered(ranks, R):
    """[out, dx, dtw] over the ranks' tokens, [dw1, dw2, dw3] over their experts."""
    return [torch.cat([r[i] for r in ranks]) for i in range(6)]


@cpu_only
@pytest.mark.parametrize("R, tokens, E", [
    (2, [11, 7], 6),
    (4, [9, 0, 13, 5], 8),  # rank 1 brings no token
    (8, [5, 3, 0, 6, 2, 4, 1, 5], 8),  # one expert per rank
])
def test_loopback_matches_reference(R, tokens, E):
    _check(R, tokens, E)


@cpu_only
def test_loopback_moves_only_the_rows_selective_dispatch_needs():
    """Every transfer's counted bytes per rank: one row per token and other rank owning one of
    its experts (none for a token whose experts are all home), uneven routing, R = 4."""
    tokens, E = [9, 0, 13, 5], 8
    inp = _case(4, tokens, E, seed=3)
    _, traffic = _metered(lambda: _loopback(4, inp, tokens))
    _check_bytes(traffic, inp, tokens, E, D * 2, D * 2)


@cpu_only
@pytest.mark.parametrize("R", [2, 4])
def test_loopback_skewed_routing(R):
    """Every slot on rank 0's experts: rank 0 computes every token, the others none."""
    ranks = _check(R, [6] * R, 2 * R, seed=1, skew=True)
    for r in ranks[1:]:
        assert all((g == 0).all() for g in r[3:])


@cpu_only
def test_loopback_backward_sends_each_region_dx_before_its_dw13(monkeypatch):
    """Each region's dx partial rows leave (on the side stream, under symmetric memory) before
    that region's wgrad_dw13 runs, so the last region's return hides under it too."""
    import threading

    from torchtitan_megamoe.ops.hopper import bf16_backward, ep_dispatch

    events = []
    real_return, real_dw13 = ep_dispatch.TokenRoute.return_rows, bf16_backward.WeightGrads.dw13

    def spy_return(self, s, rows, transfer):
        if transfer == "return dx":
            events.append((threading.current_thread().name, "return", s))
        return real_return(self, s, rows, transfer)

    def spy_dw13(self, *args, **kw):
        events.append((threading.current_thread().name, "dw13"))
        return real_dw13(self, *args, **kw)

    monkeypatch.setattr(ep_dispatch.TokenRoute, "return_rows", spy_return)
    monkeypatch.setattr(bf16_backward.WeightGrads, "dw13", spy_dw13)
    tokens = [7, 5]
    _loopback(2, _case(2, tokens, 4, seed=2), tokens)
    for rank in ("rank0", "rank1"):
        mine = [e[1:] for e in events if e[0].endswith(rank)]
        me = int(rank[-1])
        assert mine == [("return", me), ("dw13",), ("return", 1 - me), ("dw13",)], (rank, mine)


@cpu_only
@pytest.mark.parametrize("skew", [False, True])
def test_loopback_saved_store_keeps_what_fits_and_recomputes_the_rest(monkeypatch, skew):
    """The forward's store of GEMM 1's pre-activations (kernels/row_store.py): at an even
    routing every region fits its slot and the backward recomputes no tile; with every slot on
    rank 0's experts and slots of one segment, rank 0's regions spill over theirs, and the
    backward recomputes those, with the same results (against the reference and EP=1) and
    bitwise repeatable."""
    from torchtitan_megamoe.ops.hopper import ep_backward, ep_forward

    monkeypatch.setattr(ep_forward, "keeps_saved", lambda *a: True)  # tiny shapes would not
    tiles = []
    real = ep_backward.recompute_a

    def spy(x, w1, w2, w3, plan, *a, **k):
        tiles.append(int((plan.tile_expert >= 0).sum()))  # tiles GEMM 1 computes again
        return real(x, w1, w2, w3, plan, *a, **k)

    monkeypatch.setattr(ep_backward, "recompute_a", spy)
    if skew:  # slots of one segment: a region with rows for both of rank 0's experts spills
        monkeypatch.setattr(ep_forward, "slot_rows", lambda R, C, K, E_local, bm: bm)
    R = 4
    _check(R, [6] * R, 2 * R, seed=1, skew=skew)
    assert len(tiles) == 2 * R * R  # two EP=4 runs: every rank's every region was restored
    if skew:
        # the other ranks receive nothing (kept, empty); rank 0 recomputes what spilled
        assert any(tiles) and tiles.count(0) >= 2 * R * (R - 1)
    else:
        assert not any(tiles)


@cpu_only
def test_loopback_forward_buffers_hold_one_region(monkeypatch):
    """Bounded memory: the forward's per-call row buffers (h, y, staged partial rows) hold one
    region's rows, max_rows(C*K), whatever R and the routing (here every slot on rank 0's
    experts), not the R*C*K of a batch of every region."""
    from torchtitan_megamoe.ops.hopper import ep_forward
    from torchtitan_megamoe.ops.hopper.plan import max_rows
    from torchtitan_megamoe.ops.hopper.tiles import plan_block_m

    R, tokens, E = 4, [6, 6, 6, 6], 8
    inp = _case(R, tokens, E, seed=1, skew=True)
    shapes = []
    real = torch.empty

    def spy(*size, **kw):
        t = real(*size, **kw)
        shapes.append(tuple(t.shape))
        return t

    monkeypatch.setattr(ep_forward.torch, "empty", spy)
    loopback_moe(shard(R, *op_args(inp), tokens=tokens), precision="bf16")
    monkeypatch.undo()
    C = max(tokens)
    one_region = max_rows(C * K, E // R, plan_block_m())
    rows = [s[0] for s in shapes if len(s) == 2 and s[1] in (D, H)]
    assert rows and max(rows) <= one_region < max_rows(R * C * K, E // R, plan_block_m())


@cpu_only
def test_loopback_paces_each_transfer_by_its_rows(monkeypatch):
    """The link emulation's plumbing (the spin itself is CUDA's, test_ep_layout.py): every copy
    into a peer asks to be paced once, named by its transfer, with its device row count and
    row bytes; MEGAMOE_LOOPBACK_PACED keeps the named transfers only."""
    from torchtitan_megamoe import settings
    from torchtitan_megamoe.ops.hopper.ep_transport import LoopbackExchange

    calls = []
    monkeypatch.setattr(LoopbackExchange, "pace", lambda self, rows, row_bytes, transfer:
                        calls.append((self.rank, transfer, int(rows), row_bytes)))
    tokens, E = [7, 9], 4
    inp = _case(2, tokens, E, seed=4)
    _loopback(2, inp, tokens)
    sent, received = _rows(inp, tokens, E)
    for r in range(2):
        got = {}
        for rank, transfer, rows, row_bytes in calls:
            if rank == r:
                got[transfer] = got.get(transfer, 0) + rows * row_bytes
        assert got == {"dispatch": sent[r] * 2 * D, "combine": received[r] * 2 * D,
                       "dispatch dy": sent[r] * 2 * D, "dispatch x": sent[r] * 2 * D,
                       "return dx": received[r] * (2 * D + 4 * K)}, r
    monkeypatch.setenv(settings.LOOPBACK_PACED, "combine, return dx")
    assert settings.loopback_paced_transfers() == {"combine", "return dx"}


@cpu_only
def test_loopback_registered_ops():
    """The registered forward and backward ops (group_name through torch.library), as CUDA runs
    them, equal the eager autograd path bitwise."""
    inp = _case(2, [7, 9], 4, seed=2)
    eager = _loopback(2, inp, [7, 9], autograd=True)
    ops = _loopback(2, inp, [7, 9], autograd=False)
    for a, b in zip(eager, ops):
        assert all(same_bits(x, y) for x, y in zip(a, b))


def test_loopback_group_names_resolve_to_their_rank():
    def rank_fn(g):
        assert group_from_name(g.group_name) is g
        return g.rank, max(g.gather(10 * g.rank))

    assert run_ranks(3, rank_fn) == [(0, 20), (1, 20), (2, 20)]


def test_loopback_errors_are_clear():
    handles = run_ranks(2, lambda g: g)
    with pytest.raises(LoopbackError, match="not running"):
        group_from_name(handles[0].group_name)
    with pytest.raises(LoopbackError, match="not its rank thread"):
        handles[0].barrier()

    def skips(g):  # rank 1 skips the collective rank 0 waits at
        if g.rank == 0:
            g.barrier()

    with pytest.raises(LoopbackError, match="finished after 0 collectives"):
        run_ranks(2, skips)

    def fails(g):
        if g.rank == 1:
            raise KeyError("boom")
        g.barrier()

    with pytest.raises(KeyError, match="boom"):
        run_ranks(2, fails)


def _fp8_reference(inp, precision, R, dtype=torch.bfloat16, keep_dtype=False):
    """The reference backend at EP=1 on the whole batch with the recipe's EP>1 rounding of dy
    (ops/reference.py: with FP8 data gradients dy crosses ranks as e4m3 rows): what its EP=R
    computes on the same routing; ``dtype`` float64 computes bf16 precision exactly. The
    results come as float64, or in ``dtype`` with ``keep_dtype`` (the GPU shapes' memory)."""
    from torchtitan_megamoe.ops.reference import ACT, quantize_dequantize_fp8

    dy = inp["dy"].to(dtype)
    if R > 1 and recipe_named(precision).fp8_dgrad:
        dy = quantize_dequantize_fp8(dy.float(), ACT).to(dtype)
    leaves = [t.detach().to(dtype).requires_grad_() if t.is_floating_point() else t
              for t in op_args(inp)]
    p = precision if dtype != torch.float64 else "bf16"  # float64: the exact values
    out = mega_moe(*leaves, backend="reference", precision=p)
    out.backward(dy)
    cast = (lambda t: t.detach()) if keep_dtype else (lambda t: t.detach().double())
    return [cast(out)] + [cast(leaves[i].grad) for i in (0, 2, 3, 4, 5)]


def _fp8_case(R, tokens, E):
    """(inputs, per-rank shards, per-rank dy) of the FP8 loopback tests."""
    T = sum(tokens)
    g = torch.Generator().manual_seed(R)
    inp = make_inputs(T, 2, E, 128, 128, generator=g)  # one scale block wide: the fastest
    inp["topk_ids"][torch.rand(T, 2, generator=g) < 0.2] = -1
    return inp, shard(R, *op_args(inp), tokens=tokens), _per_rank(inp["dy"], tokens)


@cpu_only
@pytest.mark.parametrize("R, tokens, E, precision", [
    (2, [5, 7], 4, "fp8_bwd"),
    (3, [3, 0, 5], 6, "fp8"),  # rank 1 brings no token; an odd R
])
def test_loopback_fp8_matches_reference(R, tokens, E, precision):
    """FP8 at EP=R: x (fp8) and dy (fp8, fp8_bwd) travel as e4m3 rows; forward and gradients vs
    the reference's emulation of the same recipe on the same routing, as close to float64 as
    the EP=1 FP8 kernels on the whole batch, and repeated runs bitwise equal."""
    inp, shards, dys = _fp8_case(R, tokens, E)
    ranks, traffic = _metered(lambda: loopback_moe(shards, dys, precision=precision))
    again = loopback_moe(shards, dys, precision=precision)
    got = [t.double() for t in _gathered(ranks, R)]
    emu = _fp8_reference(inp, precision, R)
    exact = _fp8_reference(inp, precision, R, torch.float64)
    ep1 = [t.double() for t in _gathered(loopback_moe(shard(1, *op_args(inp)), [inp["dy"]],
                                                      precision=precision), 1)]
    exact1 = _fp8_reference(inp, precision, 1, torch.float64)
    for name, g_, e, r, o, r1 in zip(("out", *NAMES), got, emu, exact, ep1, exact1):
        assert torch.isfinite(g_).all(), name
        tol = 1e-2 if name == "out" else 3e-2
        assert rel_err(g_, e) < tol, (precision, name, rel_err(g_, e))
        # as accurate as the emulated recipe or the EP=1 kernels (a lost row would be far off)
        bound = 1.15 * max(rel_err(e, r), rel_err(o, r1)) + 2e-3
        assert rel_err(g_, r) < bound, (name, rel_err(g_, r), bound)
    for r, (a, b) in enumerate(zip(ranks, again)):
        assert all(same_bits(x, y) for x, y in zip(a, b)), f"rank {r}: two runs differ"
    # e4m3 rows with one fp32 scale per 128 values where the recipe's GEMMs read FP8
    recipe = recipe_named(precision)
    fp8_row, bf16_row = 128 + 4, 128 * 2
    _check_fp8_bytes(traffic, inp, tokens, E, fp8_row if recipe.fp8_forward else bf16_row,
                     fp8_row if recipe.fp8_dgrad else bf16_row)


def _check_fp8_bytes(traffic, inp, tokens, E, x_row, dy_row):
    """_check_bytes at the FP8 test's row width (D = 128, K = 2)."""
    sent, received = _rows(inp, tokens, E)
    for r in range(len(tokens)):
        got = traffic.get(r, {})
        assert got.get("dispatch", 0) == sent[r] * x_row, r
        assert got.get("dispatch dy", 0) == sent[r] * dy_row, r
        assert got.get("combine", 0) == received[r] * 128 * 2, r


# ------------------------------------------------------------------------------ one GPU, R ranks

SHAPES = {"30b": (2048, 768), "235b": (4096, 1536)}


def _gpu_case(R, T, D, H, E=128, K_=8):
    g = torch.Generator(device="cuda").manual_seed(R)
    x = torch.randn(R * T, D, device="cuda", generator=g).bfloat16()
    dy = torch.randn(R * T, D, device="cuda", generator=g).bfloat16()
    w1, w2, w3 = make_weights(E, D, H, device="cuda", generator=g)
    logits = torch.randn(E, device="cuda", generator=g) * 1.5
    logits[5] = float("-inf")  # one empty expert
    ids = torch.multinomial(torch.softmax(logits, 0).expand(R * T, E), K_, generator=g)
    ids[::17, -1] = -1
    tw = torch.softmax(torch.randn(R * T, K_, device="cuda", generator=g), -1)
    return dict(x=x, topk_ids=ids, topk_weights=tw, w1=w1, w2=w2, w3=w3, dy=dy)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8_bwd"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("R", [2, 8])
def test_loopback_one_gpu_vs_reference(R, shape, precision):
    """R ranks of 4096 tokens on one GPU (a stream each) vs the reference backend's EP=R
    arithmetic (EP=1 on the whole batch, dy rounded as the exchange rounds it); bf16 within
    1e-2, FP8 within the EP=1 FP8 kernels' bounds (tests/hopper/test_fp8.py); the bytes each
    rank sends are the rows selective dispatch needs; repeated runs bitwise equal."""
    T = 4096
    D, H = SHAPES[shape]
    inp = _gpu_case(R, T, D, H)
    tokens = [T] * R
    shards = shard(R, *op_args(inp), tokens=tokens)
    dys = _per_rank(inp["dy"], tokens)
    # the fp32 reference first and one loopback result at a time: 235B at R = 8 fits 80 GB
    ref = _fp8_reference(inp, precision, R, torch.float32, keep_dtype=True)
    ranks, traffic = _metered(lambda: loopback_moe(shards, dys, precision=precision))
    again = loopback_moe(shards, dys, precision=precision)
    for r, (a, b) in enumerate(zip(ranks, again)):
        assert all(same_bits(x, y) for x, y in zip(a, b)), f"rank {r}: two runs differ"
    del again
    got = _gathered(ranks, R)
    del ranks
    for name, g, r in zip(("out", *NAMES), got, ref):
        assert torch.isfinite(g).all(), name
        tol = 1e-2 if precision == "bf16" or name == "out" else 3e-2
        if precision == "fp8" and name == "out":
            tol = 2e-2  # DeepGEMM's GEMM 1 quantizes h from the bf16 a (test_fp8.py)
        assert rel_err(g, r) <= tol, f"{name}: rel err {rel_err(g, r):.2e}"
    sent, _ = _rows(inp, tokens, 128)
    recipe = recipe_named(precision)
    fp8_row = D + 4 * (D // 128)
    for r in range(R):
        assert traffic[r]["dispatch"] == sent[r] * (fp8_row if recipe.fp8_forward else 2 * D)
        assert traffic[r]["dispatch dy"] == sent[r] * (fp8_row if recipe.fp8_dgrad else 2 * D)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_loopback_forward_backward_captures_in_one_cuda_graph():
    """EP=2 on one GPU, forward + backward of both ranks captured as one CUDA graph (the EP
    path has no host sync and no host-to-device copy): a replay gives the eager call's bits."""
    T, (D, H) = 1024, SHAPES["30b"]
    inp = _gpu_case(2, T, D, H)
    shards = shard(2, *op_args(inp), tokens=[T, T])
    dys = _per_rank(inp["dy"], [T, T])

    def call():
        return loopback_moe(shards, dys, precision="bf16")

    call()  # the first call at a shape tunes
    eager = call()
    graph, captured = capture(call)
    for t in (t for rank in captured for t in rank):
        t.fill_(float("nan"))  # the replay must write every output
    graph.replay()
    torch.cuda.synchronize()
    for r, (a, b) in enumerate(zip(eager, captured)):
        assert all(same_bits(x, y) for x, y in zip(a, b)), f"rank {r}: replay differs"


@cpu_only
def test_loopback_fp8_saved_store_with_a_region_recomputed(monkeypatch):
    """The FP8 forward's pre-activations through the store (kernels/row_store.py) with slots of
    one segment: a region with rows for both experts spills over its slot and its GEMM 1 runs
    again in the backward, in place or (as with DeepGEMM) into a buffer whose recomputed rows
    then go into their slots; both give the bits of the store that kept every region (the FP8
    test checks those against the reference)."""
    from torchtitan_megamoe.ops.hopper import ep_backward, ep_forward

    monkeypatch.setattr(ep_forward, "keeps_saved", lambda *a: True)
    _, shards, dys = _fp8_case(3, [3, 0, 5], 6)
    kept = loopback_moe(shards, dys, precision="fp8")
    monkeypatch.setattr(ep_forward, "slot_rows", lambda R, C, K, E_local, bm: bm)
    tiles = []
    real = ep_backward.recompute_a

    def spy(x, w1, w2, w3, plan, *a, **k):
        tiles.append(int((plan.tile_expert >= 0).sum()))
        return real(x, w1, w2, w3, plan, *a, **k)

    monkeypatch.setattr(ep_backward, "recompute_a", spy)
    for buffered in (False, True):
        monkeypatch.setattr(ep_backward, "recompute_writes_every_row", lambda *a: buffered)
        tiles.clear()
        got = loopback_moe(shards, dys, precision="fp8")
        assert any(tiles) and not all(tiles), tiles
        for r, (a, b) in enumerate(zip(kept, got)):
            assert all(same_bits(x, y) for x, y in zip(a, b)), f"rank {r}, buffered {buffered}"


def _kept_and_spilled_case(R, T=1024, E=32):
    """(shards, dys) at the 30B shape where half of rank 1's tokens send every slot to rank 0's
    experts: rank 0's region 1 spills over its slot and region 2's (recomputed, not kept),
    regions 0 and 3 are kept."""
    D, H = SHAPES["30b"]
    inp = _gpu_case(R, T, D, H, E=E)
    inp["topk_ids"][T:T + T // 2] = torch.arange(E // R, device="cuda")  # rank 0's experts
    return shard(R, *op_args(inp), tokens=[T] * R), _per_rank(inp["dy"], [T] * R)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_loopback_kept_regions_share_one_dw13_launch(monkeypatch, precision):
    """ep_wgrad.py: dw1|dw3 of the regions the store kept as one launch after the last region,
    the other regions' at once. Half of rank 1's tokens send every slot to rank 0's experts:
    rank 0's region 1 spills over its slot and region 2's, which are recomputed and not kept,
    while regions 0 and 3 are. Against the per-region sums (the one launch off): every output
    but dw1 and dw3 bitwise, those within fp32 summation order; one launch per rank; bitwise
    repeatable (da goes over the saved a: the loopback runs the eager backward)."""
    from torchtitan_megamoe.ops.hopper import ep_backward, ep_wgrad

    R = 4
    shards, dys = _kept_and_spilled_case(R)
    kept, launches = [], []
    real_kept, real_dw13 = ep_backward.kept_slots, ep_wgrad.KeptRows.dw13
    monkeypatch.setattr(ep_backward, "kept_slots",
                        lambda *a: kept.append(real_kept(*a)) or kept[-1])
    monkeypatch.setattr(ep_wgrad.KeptRows, "dw13",
                        lambda self, *a: launches.append(1) or real_dw13(self, *a))
    one = loopback_moe(shards, dys, precision=precision)
    again = loopback_moe(shards, dys, precision=precision)
    patterns = {tuple(k.tolist()) for k in kept}
    assert (True, False, False, True) in patterns and (True,) * R in patterns, patterns
    assert len(launches) == 2 * R
    monkeypatch.setattr(ep_backward._Restore, "defers_dw13", lambda self, *a: False)
    per_region = loopback_moe(shards, dys, precision=precision)
    for r in range(R):
        assert all(same_bits(x, y) for x, y in zip(one[r], again[r])), f"rank {r}: reruns"
        for i, name in enumerate(("out", *NAMES)):
            a, b = one[r][i], per_region[r][i]
            if name in ("dw1", "dw3"):
                assert torch.isfinite(a).all() and rel_err(a, b) <= 1e-3, (r, name, rel_err(a, b))
            else:
                assert same_bits(a, b), (r, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_loopback_fp8_fused_dgrad2_swiglu(monkeypatch):
    """MEGAMOE_FP8_FUSED_DGRAD2=1 at EP=4 with kept and recomputed regions (the skewed case
    above): a kept region's da goes over its saved a inside the fused launch. Every output as
    with the two launches (dh then in fp32, not rounded to bf16), bitwise repeatable."""
    from torchtitan_megamoe.ops.hopper import fp8_backward
    from torchtitan_megamoe.ops.hopper.cuda.sm90 import sm90_usable

    if not sm90_usable(torch.empty(1, device="cuda")):
        pytest.skip("needs the sm90 CUDA kernels (Hopper, nvcc)")
    R = 4
    shards, dys = _kept_and_spilled_case(R)
    two = loopback_moe(shards, dys, precision="fp8")
    monkeypatch.setenv("MEGAMOE_FP8_FUSED_DGRAD2", "1")
    calls = []
    fused = fp8_backward.fp8_dgrad2_swiglu_rows_sm90

    def spy(*a, **k):  # whether da goes over the saved a (a[4])
        calls.append(k.get("out") is not None and k["out"][0].data_ptr() == a[4].data_ptr())
        return fused(*a, **k)

    monkeypatch.setattr(fp8_backward, "fp8_dgrad2_swiglu_rows_sm90", spy)
    one = loopback_moe(shards, dys, precision="fp8")
    assert any(calls), calls
    again = loopback_moe(shards, dys, precision="fp8")
    for r in range(R):
        assert all(same_bits(x, y) for x, y in zip(one[r], again[r])), f"rank {r}: reruns"
        for i, name in enumerate(("out", *NAMES)):
            a, b = one[r][i], two[r][i]
            assert torch.isfinite(a).all() and rel_err(a, b) <= 1e-2, (r, name, rel_err(a, b))
