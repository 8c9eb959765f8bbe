"""Typed settings dataclasses, checked at construction: the ``@checked`` class decorator reads
each field's annotation once, ``check_fields`` holds a value to it. Used by the ``[megamoe]``
section (settings.MegaMoEConfig) and the op's options (ops/options.MegaMoEOptions)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal


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


def _article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun
