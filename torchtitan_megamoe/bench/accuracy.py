"""Op-level accuracy at one shape (``--accuracy``): ours at each precision, stock bf16 and stock +
torchao's rowwise FP8 grouped GEMMs, each against a float64 reference on the same inputs.

Inputs: stock's MoE block with the benchmark's weights (seed 0), x and the output gradient drawn
from seed 2, and stock's router on x for the routing (ids, fp32 weights), which stock's own layer
recomputes identically. The reference is the reference backend (ops/reference.py) on the same
values cast to float64: its math then runs in float64, per expert, on the same device.

Errors are relative Frobenius norms, ``||got - ref|| / ||ref||``, for the output and the
gradients of x, w1, w2, w3 and the routing weights. Ours: mega_moe on those inputs. Stock's layer
routes inside, so its dx also carries the router's gradient and its routing weights' gradient is
not exposed: for stock only the output and the expert weights' gradients compare ('-' in the
table for the others).
"""

from __future__ import annotations
from torchtitan_megamoe.ops.options import MegaMoEOptions

import torch

from torchtitan_megamoe.bench.shapes import SHAPES, build_stock_moe
from torchtitan_megamoe.bench.stock import (FP8_TOKEN_GROUP_ALIGNMENT, convert_torchao_fp8,
                                            note_for, plain, token_group_alignment)

GRADS = ("dx", "dw1", "dw2", "dw3", "dtopk_weights")
"""The gradients compared, in the table's column order (after the output)."""


def rel_err64(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 (``ref`` is float64 already)."""
    got = plain(got).to(torch.float64)
    return float((got - ref).norm() / ref.norm())


def float64_reference(x, ids, weights, grad, w1, w2, w3) -> dict:
    """The reference backend's output and gradients on the inputs cast to float64."""
    from torchtitan_megamoe.ops import reference

    with torch.no_grad():
        x64, tw64, g64 = x.double(), weights.double(), grad.double()
        w64 = [plain(w).double() for w in (w1, w2, w3)]
        out = reference.forward(x64, ids, tw64, *w64, None, MegaMoEOptions(precision="bf16"))
        dx, dtw, dw1, dw2, dw3 = reference.backward(g64, x64, ids, tw64, *w64, None, MegaMoEOptions(precision="bf16"))
    return {"out": out, "dx": dx, "dtopk_weights": dtw, "dw1": dw1, "dw2": dw2, "dw3": dw3}


def _ours(x, ids, weights, grad, ex, ref, backend: str, precision: str) -> dict:
    from torchtitan_megamoe import mega_moe

    xl = x.detach().clone().requires_grad_(True)
    tw = weights.detach().clone().requires_grad_(True)
    ws = [plain(getattr(ex, n)).clone().requires_grad_(True) for n in ("w1", "w2", "w3")]
    entry: dict = {}
    try:
        out = mega_moe(xl, ids, tw, *ws, backend=backend, precision=precision)
    except Exception as err:  # noqa: BLE001 - NotImplementedError: not yet in this backend
        return {"note": note_for(err)}
    entry["out"] = rel_err64(out, ref["out"])
    try:
        out.backward(grad)
    except Exception as err:  # noqa: BLE001 - e.g. a forward without its backward yet
        entry["grad_note"] = note_for(err)
        return entry
    got = {"dx": xl.grad, "dw1": ws[0].grad, "dw2": ws[1].grad, "dw3": ws[2].grad,
           "dtopk_weights": tw.grad}
    for k in GRADS:
        entry[k] = rel_err64(got[k], ref[k])
    return entry


def _stock(moe, x, grad, ref) -> dict:
    T, D = x.shape
    moe.zero_grad(set_to_none=True)
    out = moe(x.view(1, T, D)).view(T, D)
    entry = {"out": rel_err64(out, ref["out"])}
    out.backward(grad)
    ex = moe.experts
    for k, w in (("dw1", ex.w1), ("dw2", ex.w2), ("dw3", ex.w3)):
        entry[k] = rel_err64(w.grad, ref[k])
    moe.zero_grad(set_to_none=True)
    return entry


def accuracy_shape(key: str, tokens: int, precisions, backend: str, torchao: bool = True) -> dict:
    """{"ours_<precision>": {...}, "stock": {...}, "stock_torchao_fp8": {...}}: each entry the
    relative errors by name ("out" and GRADS), or "note" (nothing ran), or "grad_note" (the
    output ran, its backward not)."""
    shape = SHAPES[key]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    moe = build_stock_moe(shape, dev)
    T, D = tokens, shape["dim"]
    torch.manual_seed(2)
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    ex = moe.experts
    with torch.no_grad():
        weights, ids, _ = moe.router(x, moe.expert_bias)
    ref = float64_reference(x, ids, weights, grad, ex.w1, ex.w2, ex.w3)
    res: dict = {"tokens": T}
    for p in dict.fromkeys(["bf16", *precisions]):
        res[f"ours_{p}"] = _ours(x, ids, weights, grad, ex, ref, backend, p)
        torch.cuda.empty_cache()
    try:
        res["stock"] = _stock(moe, x, grad, ref)
    except Exception as err:  # noqa: BLE001 - reported in the table
        res["stock"] = {"note": note_for(err)}
    if torchao:
        # eager (no compilation in this pass); the compiled layer's output difference from
        # stock's is the timing run's stock_fp8_rel_err_vs_stock
        try:
            with token_group_alignment(FP8_TOKEN_GROUP_ALIGNMENT):
                convert_torchao_fp8(moe)
                res["stock_torchao_fp8"] = _stock(moe, x, grad, ref)
        except Exception as err:  # noqa: BLE001 - reported in the table
            res["stock_torchao_fp8"] = {"note": note_for(err)}
    del moe, ref
    torch.cuda.empty_cache()
    return res
