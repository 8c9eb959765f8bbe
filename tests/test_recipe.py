"""Precision as a recipe (ops/recipe.py): each precision's fields say what it means, options
resolve it once, the developer switch still reaches the weight gradients through interned
options; and the options' fields are written once (ops/options.py): of / op_args / as_kwargs /
with_backend, mega_moe()'s keyword arguments and the converter's build_options follow them."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from test_house import import_graph

from torchtitan_megamoe import mega_moe
from torchtitan_megamoe.ops.options import MegaMoEOptions, capacity_error
from torchtitan_megamoe.ops.recipe import PRECISIONS, RECIPES, SCALE_BLOCK, recipe_named
from torchtitan_megamoe.settings import MegaMoEConfig

BF16, FP32 = torch.bfloat16, torch.float32
# what each precision means, field by field (docs/ARCHITECTURE.md, "Which GEMM runs in which
# precision" and "FP8 weights")
MEANING = {
    "bf16": dict(fp8_forward=False, fp8_dgrad=False, fp8_wgrad_switchable=False, block=None,
                 activation_scales=None, weight_scales=None, plan_block_m=None,
                 forward_copies=False, transposed_copies=False, stand_ins=False,
                 weight_dtypes=(BF16,)),
    "fp8": dict(fp8_forward=True, fp8_dgrad=True, fp8_wgrad_switchable=True, block=128,
                activation_scales=(1, 128), weight_scales=(128, 128), plan_block_m=128,
                forward_copies=True, transposed_copies=True, stand_ins=True,
                weight_dtypes=(BF16, FP32)),
    "fp8_bwd": dict(fp8_forward=False, fp8_dgrad=True, fp8_wgrad_switchable=True, block=128,
                    activation_scales=(1, 128), weight_scales=(128, 128), plan_block_m=128,
                    forward_copies=False, transposed_copies=True, stand_ins=False,
                    weight_dtypes=(BF16,)),
}


def test_every_precision_is_one_recipe_with_its_meaning():
    assert tuple(RECIPES) == PRECISIONS == tuple(MEANING) and SCALE_BLOCK == 128
    for name, meaning in MEANING.items():
        r = recipe_named(name)
        assert r is RECIPES[name] and r.name == name
        assert {k: getattr(r, k) for k in meaning} == meaning, name
        assert r.fp8 == (name != "bf16")
        # every field is stated above: a new one needs its meaning here too
        assert {f.name for f in dataclasses.fields(r)} == {"name", *meaning}


def test_unknown_precision_names_the_recipes():
    with pytest.raises(ValueError, match=r"unknown precision 'fp4'; pick one of bf16, fp8, "
                                         r"fp8_bwd"):
        recipe_named("fp4")
    with pytest.raises(ValueError, match=r"precision='fp4' is not one of 'bf16', 'fp8'"):
        MegaMoEOptions(precision="fp4")


def test_kept_copies_follow_the_recipe_and_fp8_keep_transposed():
    assert RECIPES["bf16"].kept_copies(True) == (False, False)
    assert RECIPES["fp8"].kept_copies(True) == (True, True)
    assert RECIPES["fp8"].kept_copies(False) == (True, False)
    # without forward copies the transposed ones cannot be made from them: always kept
    assert RECIPES["fp8_bwd"].kept_copies(False) == (False, True)


def test_options_resolve_the_recipe_once_and_the_switch_per_call(monkeypatch):
    from torchtitan_megamoe import settings

    for name in PRECISIONS:
        o = MegaMoEOptions.of(precision=name)
        assert o.recipe is RECIPES[name] and "recipe" not in o.as_kwargs()
        assert hash(o) == hash(MegaMoEOptions(precision=name)) and o == MegaMoEOptions(
            precision=name)
    o = MegaMoEOptions.of(precision="fp8")
    monkeypatch.setenv("MEGAMOE_FP8_WGRAD", "1")
    assert o.recipe.fp8_wgrad(settings.fp8_wgrad())
    assert not MegaMoEOptions.of().recipe.fp8_wgrad(settings.fp8_wgrad())
    monkeypatch.setenv("MEGAMOE_FP8_WGRAD", "0")
    assert MegaMoEOptions.of(precision="fp8") is o and not o.recipe.fp8_wgrad(
        settings.fp8_wgrad())


def test_options_methods_follow_the_fields():
    names = [f.name for f in dataclasses.fields(MegaMoEOptions)]
    a = MegaMoEOptions.of(backend="reference", precision="fp8", fp8_keep_transposed=False)
    assert list(a.as_kwargs()) == names and a.op_args() == tuple(a.as_kwargs().values())
    assert MegaMoEOptions.of(*a.op_args()) is a and MegaMoEOptions.of(**a.as_kwargs()) is a
    assert MegaMoEOptions.of("reference", precision="fp8", fp8_keep_transposed=False) is a
    h = a.with_backend("hopper")
    assert h.backend == "hopper" and h.as_kwargs() == {**a.as_kwargs(), "backend": "hopper"}
    with pytest.raises(TypeError, match=r"unknown option fp8=True; the options are backend, "
                                        r"precision, save_activations"):
        MegaMoEOptions.of(fp8=True)
    with pytest.raises(TypeError, match=r"option backend given twice"):
        MegaMoEOptions.of("reference", backend="hopper")
    with pytest.raises(TypeError, match=rf"{len(names) + 1} option values given"):
        MegaMoEOptions.of(*a.op_args(), True)


def test_mega_moe_takes_the_options_by_keyword_only():
    sig = inspect.signature(mega_moe)
    for f in dataclasses.fields(MegaMoEOptions):
        p = sig.parameters[f.name]
        assert p.kind is p.KEYWORD_ONLY and p.default == f.default, f.name
        assert f"{f.name} (default {f.default!r})" in mega_moe.__doc__
    assert not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    x, ids, tw = torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    w = torch.zeros(1, 8, 8)
    with pytest.raises(TypeError, match=r"unknown option precison='fp8'"):
        mega_moe(x, ids, tw, w, w, w, precison="fp8")
    out = mega_moe(x, ids, tw, w, w, w, group=None, backend="reference", precision="bf16")
    assert out.shape == x.shape


def test_every_option_is_a_megamoe_config_field_of_its_name():
    """converter.build_options takes each option from the [megamoe] field of its name."""
    from moe_testing import job_config
    from torchtitan_megamoe.converter import build_options

    config = {f.name for f in dataclasses.fields(MegaMoEConfig)}
    assert {f.name for f in dataclasses.fields(MegaMoEOptions)} <= config
    jc = job_config(backend="reference", precision="fp8_bwd", fp8_keep_transposed=False,
                    max_tokens_per_rank=64, save_activations="never")
    assert build_options(jc.megamoe, jc) == MegaMoEOptions(
        backend="reference", precision="fp8_bwd", save_activations="never",
        max_tokens_per_rank=64, fp8_keep_transposed=False)


def test_dependencies_point_from_the_backend_to_the_options():
    graph = import_graph()
    assert "torchtitan_megamoe.ops.options" not in graph["torchtitan_megamoe.settings"]
    for neutral in ("torchtitan_megamoe.ops.api", "torchtitan_megamoe.moe",
                    "torchtitan_megamoe.ops.options", "torchtitan_megamoe.ops.recipe",
                    "torchtitan_megamoe.ops.fp8_weights", "torchtitan_megamoe.ops.shapes"):
        assert not {m for m in graph[neutral] if ".ops.hopper" in m}, neutral


def test_the_exchange_raises_the_options_capacity_error():
    from torchtitan_megamoe.ops.hopper.ep_transport import Exchange

    ex = object.__new__(Exchange)
    ex.capacity = 8
    with pytest.raises(ValueError) as err:
        ex.check_tokens(9)
    assert str(err.value) == str(capacity_error(9, 8))
    ex.check_tokens(8)
