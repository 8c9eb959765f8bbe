"""The op's settings: one frozen, validated object that travels from the caller (mega_moe()'s
keyword arguments; the converter builds one per model) through the registered op, whose schema
carries each field as a typed argument, to the backend's forward and backward.

The fields are declared once, below: ``of``, ``op_args``, ``as_kwargs``, ``with_backend``, the
op's schema (``op_schema``) and mega_moe()'s keyword arguments (``keyword_parameters``,
``keyword_doc``) all come from ``dataclasses.fields``. ``precision`` is resolved once, at
construction, into its recipe (``options.recipe``, ops/recipe.py)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from dataclasses import dataclass, field

import torch

from torchtitan_megamoe.checked import check_fields, checked
from torchtitan_megamoe.ops.recipe import Precision, recipe_named
from torchtitan_megamoe.settings import Backend, SaveActivations

BACKENDS = typing.get_args(Backend)
SAVE_MODES = typing.get_args(SaveActivations)


def _option(default, doc: str):
    """A field and its documentation, which mega_moe()'s docstring repeats (keyword_doc)."""
    return field(default=default, metadata={"doc": inspect.cleandoc(doc)})


@checked
@dataclass(frozen=True)
class MegaMoEOptions:
    """The op's settings, one field each; ``recipe`` (not a field): what ``precision`` means,
    resolved at construction (ops/recipe.py)."""

    backend: Backend = _option("auto", """
        ``auto`` (the Hopper kernels on SM90 GPUs, else reference), ``hopper`` or
        ``reference``. Inside the op it is never ``auto``: mega_moe() resolves it per call.""")

    precision: Precision = _option("bf16", """
        The recipe (ops/recipe.py): ``bf16``, ``fp8`` (blockwise FP8 forward and data
        gradients, bf16 weight gradients) or ``fp8_bwd`` (bf16 forward, FP8 data gradients).""")

    save_activations: SaveActivations = _option("keep", """
        ``keep``: the forward keeps what its backward can reuse; ``never``: the backward
        recomputes (less memory, more time).""")

    max_tokens_per_rank: int = _option(0, """
        EP capacity: the most tokens any rank of the group brings to one call (sizes the
        hopper backend's receive buffers; both backends raise on a call above it). 0: the
        hopper backend sizes its buffers from the first call, the reference backend sets no
        bound.""")

    fp8_weight_cache: bool = _option(True, """
        FP8 recipes on the hopper backend: the module owning the expert weights
        (moe.MegaExperts) makes their FP8 copies once per optimizer step, keeps them while
        needed (``fp8_free_after_backward``) and passes them to the op (``fp8_weights``); off, the op quantizes the weights on
        every call (less memory: ops/fp8_weights.py says how much the copies hold). The op
        itself reads only ``fp8_weights``.""")

    fp8_keep_transposed: bool = _option(True, """
        With ``fp8_weight_cache``, in a recipe with FP8 forward copies (``fp8``): the module
        keeps the transposed copies too; off, only the forward ones (half the memory) and the
        backward makes the transposed ones from them by a byte transpose on every call. The op
        itself does not read it.""")

    fp8_free_after_backward: bool = _option(True, """
        With ``fp8_weight_cache``: each layer frees its FP8 copies once its backward has read
        them (their last use in the step) and makes them again at its next forward, so the end
        of the step's backward holds one layer's copies, not every layer's. Off: they stay from
        one optimizer step to the next (one quantization per step, however many micro-batches
        it runs). The op itself does not read it.""")

    bf16_weight_cache: bool = _option(True, """
        A bf16 forward (``bf16``, ``fp8_bwd``) on the hopper backend at EP=1 under a bf16
        autocast over fp32 weights (TorchTitan on one GPU, no FSDP): the module owning the
        weights casts them to bf16 once per step, at the start of the model's forward, passes
        the casts to the op (``weight_casts``) and frees them once its backward has read them;
        off, the op casts them in every forward and recompute. The op itself reads only
        ``weight_casts``.""")

    def __post_init__(self):
        check_fields(self, "mega_moe:")
        # not a field (equality, hashing and the schema stay the settings'), resolved once
        object.__setattr__(self, "recipe", recipe_named(self.precision))

    @classmethod
    def of(cls, *args, **kwargs) -> "MegaMoEOptions":
        """The options for these values (positional in field order, or by field name),
        validated once per distinct set: later calls are a cache lookup (the op runs on the
        host's path to every layer's first kernel)."""
        values = _bind(args, kwargs)
        if torch.compiler.is_compiling():  # traced once per graph; dynamo skips lru_cache
            return cls(*values)
        try:
            return _interned(*values)
        except TypeError:  # an unhashable value: the constructor's own error names it
            return cls(*values)

    def op_args(self) -> tuple:
        """The fields in declaration order: the trailing arguments of the op's schema."""
        return tuple(getattr(self, name) for name in _NAMES)

    def as_kwargs(self) -> dict:
        """The fields as mega_moe()'s keyword arguments (what a module passes on each call)."""
        return {name: getattr(self, name) for name in _NAMES}

    def with_backend(self, backend: str) -> "MegaMoEOptions":
        """The same options on ``backend`` (what ``auto`` resolved to for a call)."""
        return MegaMoEOptions.of(**{**self.as_kwargs(), "backend": backend})


_FIELDS = dataclasses.fields(MegaMoEOptions)
_NAMES = tuple(f.name for f in _FIELDS)
_DEFAULTS = tuple(f.default for f in _FIELDS)
_INDEX = {name: i for i, name in enumerate(_NAMES)}


def _bind(args: tuple, kwargs: dict) -> tuple:
    """``args`` then ``kwargs`` as one value per field, in declaration order, defaults filled."""
    if not kwargs and len(args) == len(_NAMES):  # the op's path: every field, in order
        return args
    if len(args) > len(_NAMES):
        raise TypeError(f"mega_moe: {len(args)} option values given; the options are "
                        f"{', '.join(_NAMES)}")
    values = list(args) + list(_DEFAULTS[len(args):])
    for name, value in kwargs.items():
        i = _INDEX.get(name)
        if i is None:
            raise TypeError(f"mega_moe: unknown option {name}={value!r}; the options are "
                            f"{', '.join(_NAMES)} (ops/options.py)")
        if i < len(args):
            raise TypeError(f"mega_moe: option {name} given twice (by position and by name)")
        values[i] = value
    return tuple(values)


def op_schema() -> str:
    """The fields as typed arguments of a torch.library op schema, in declaration order (a
    plain ``int``, not the ``SymInt`` torch infers from an annotation: the capacity is a
    setting, never a traced size)."""
    return ", ".join(f"{wanted.__name__} {name}"
                     for name, wanted, _, _ in MegaMoEOptions._field_specs)


def keyword_parameters() -> list[inspect.Parameter]:
    """The fields as keyword-only parameters with their defaults and types (mega_moe()'s
    signature)."""
    hints = typing.get_type_hints(MegaMoEOptions)
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                              annotation=hints[f.name]) for f in _FIELDS]


def keyword_doc(indent: str = "    ") -> str:
    """Each field's name, default and documentation, as docstring lines."""
    lines = []
    for f in _FIELDS:
        lines.append(f"{indent}{f.name} (default {f.default!r}):")
        lines.extend(f"{indent}    {line}" for line in f.metadata["doc"].splitlines())
    return "\n".join(lines)


@functools.lru_cache(maxsize=256, typed=True)  # typed: True and 1 stay apart
def _interned(*values) -> MegaMoEOptions:
    return MegaMoEOptions(*values)


def capacity_error(tokens: int, capacity: int, who: str = "this rank") -> ValueError:
    """The error of an EP call that brings more tokens to a rank than the exchange's capacity
    (``max_tokens_per_rank``, or what the hopper backend sized from the first call): the same
    from every backend, naming the value that would fit."""
    return ValueError(
        f"mega_moe: {who} has {tokens} tokens but the EP exchange takes at most {capacity} per "
        f"rank; set [megamoe] max_tokens_per_rank (mega_moe(max_tokens_per_rank=...)) to at "
        f"least {tokens} before the first step"
    )


def ids_range_message(num_experts: int, ep_size: int) -> str:
    """The message of a topk_ids entry outside [-1, num_experts), the same from every check
    (mega_moe's on the host, the hopper backend's device asserts)."""
    return (
        f"mega_moe: topk_ids must lie in [-1, {num_experts}) (-1 drops a slot; "
        f"{num_experts} = local experts x group size {ep_size})"
    )
