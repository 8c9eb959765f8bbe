"""The op's settings: one frozen, validated object that travels from the caller (mega_moe()'s
keyword arguments; the converter builds one per model) through the registered op, whose schema
carries each field as a typed argument, to the backend's forward and backward."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Literal

import torch

Backend = Literal["auto", "hopper", "reference"]
Precision = Literal["bf16", "fp8", "fp8_bwd"]
SaveActivations = Literal["keep", "never"]

BACKENDS = typing.get_args(Backend)
PRECISIONS = typing.get_args(Precision)
SAVE_MODES = typing.get_args(SaveActivations)
FP8_PRECISIONS = ("fp8", "fp8_bwd")


def check_fields(obj, where: str) -> None:
    """Raise for any field of the ``@checked`` dataclass ``obj`` whose value does not fit its
    annotation, naming the field, the value and what it must be: a ``Literal`` of strings takes
    one of them, ``bool`` takes True or False (a string such as "false" is refused, not read as
    truthy), ``int`` takes a whole number >= 0 (every int setting is a count; bools and floats
    are refused). TOML values reach the dataclass unchecked, so this runs at construction."""
    for name, wanted, allowed, expected in obj._field_specs:
        value = getattr(obj, name)
        # exact types: bool is an int in Python, so True must not pass as a count
        if type(value) is not wanted:
            raise TypeError(
                f"{where} {name}={value!r} is {_article(type(value).__name__)}, expected "
                f"{expected}"
            )
        if allowed and value not in allowed:
            raise ValueError(
                f"{where} {name}={value!r} is not one of {', '.join(map(repr, allowed))}"
            )
        if wanted is int and value < 0:
            raise ValueError(f"{where} {name}={value} must be >= 0")


def checked(cls):
    """Class decorator (outside ``@dataclass``): resolve the annotations into what check_fields
    compares, once, when the class is made (torch.compile traces the options' construction,
    and cannot trace ``typing.get_type_hints``)."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if typing.get_origin(kind) is Literal:
            allowed = typing.get_args(kind)
            specs.append((f.name, str, allowed,
                          "a str: one of " + ", ".join(map(repr, allowed))))
        else:
            expected = {bool: "a bool (true or false)", int: "an int (a count >= 0)"}[kind]
            specs.append((f.name, kind, (), expected))
    cls._field_specs = tuple(specs)
    return cls


@checked
@dataclass(frozen=True)
class MegaMoEOptions:
    backend: Backend = "auto"
    """``auto`` (the Hopper kernels on SM90 GPUs, else reference), ``hopper`` or
    ``reference``. Inside the op it is never ``auto``: mega_moe() resolves it per call."""

    precision: Precision = "bf16"
    """``bf16``, ``fp8`` (blockwise FP8 forward and data gradients, bf16 weight gradients) or
    ``fp8_bwd`` (BF16 forward, FP8 data gradients)."""

    save_activations: SaveActivations = "keep"
    """``keep``: the forward keeps what its backward can reuse; ``never``: the backward
    recomputes (less memory, more time)."""

    max_tokens_per_rank: int = 0
    """EP capacity: the most tokens any rank of the group brings to one call (sizes the
    hopper backend's receive buffers; both backends raise on a call above it). 0: the hopper
    backend sizes its buffers from the first call, the reference backend sets no bound."""

    fp8_weight_cache: bool = True
    """FP8 precisions on the hopper backend: the module owning the expert weights
    (moe.MegaExperts) makes their FP8 copies once per optimizer step, keeps them across calls
    and passes them to the op (``fp8_weights``); off, the op quantizes the weights on every
    call (less memory: ops/hopper/fp8_weights.py says how much the copies hold). The op itself
    reads only ``fp8_weights``."""

    def __post_init__(self):
        check_fields(self, "mega_moe:")

    @classmethod
    def of(cls, backend="auto", precision="bf16", save_activations="keep",
           max_tokens_per_rank=0, fp8_weight_cache=True) -> "MegaMoEOptions":
        """The options for these values, validated once per distinct set: later calls are a
        cache lookup (the op runs on the host's path to every layer's first kernel)."""
        values = (backend, precision, save_activations, max_tokens_per_rank, fp8_weight_cache)
        if torch.compiler.is_compiling():  # traced once per graph; dynamo skips lru_cache
            return cls(*values)
        try:
            return _interned(*values)
        except TypeError:  # an unhashable value: the constructor's own error names it
            return cls(*values)

    def op_args(self) -> tuple:
        """The fields in declaration order: the trailing arguments of the op's schema."""
        return (self.backend, self.precision, self.save_activations, self.max_tokens_per_rank,
                self.fp8_weight_cache)

    def as_kwargs(self) -> dict:
        """The fields as mega_moe()'s keyword arguments (what a module passes on each call)."""
        return {"backend": self.backend, "precision": self.precision,
                "save_activations": self.save_activations,
                "max_tokens_per_rank": self.max_tokens_per_rank,
                "fp8_weight_cache": self.fp8_weight_cache}

    def with_backend(self, backend: str) -> "MegaMoEOptions":
        return MegaMoEOptions.of(backend, *self.op_args()[1:])


def op_schema() -> str:
    """The fields as typed arguments of a torch.library op schema, in declaration order (a
    plain ``int``, not the ``SymInt`` torch infers from an annotation: the capacity is a
    setting, never a traced size)."""
    return ", ".join(f"{wanted.__name__} {name}"
                     for name, wanted, _, _ in MegaMoEOptions._field_specs)


@functools.lru_cache(maxsize=256, typed=True)  # typed: True and 1 stay apart
def _interned(*values) -> MegaMoEOptions:
    return MegaMoEOptions(*values)


def _article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def capacity_error(tokens: int, capacity: int, who: str = "this rank") -> ValueError:
    """The error of an EP call that brings more tokens to a rank than the exchange's capacity
    (``max_tokens_per_rank``, or what the hopper backend sized from the first call): the same
    from every backend, naming the value that would fit."""
    return ValueError(
        f"mega_moe: {who} has {tokens} tokens but the EP exchange takes at most {capacity} per "
        f"rank; set [megamoe] max_tokens_per_rank (mega_moe(max_tokens_per_rank=...)) to at "
        f"least {tokens} before the first step"
    )
