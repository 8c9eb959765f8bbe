"""csrc/include/launch_params.h and its ctypes mirror (ops/hopper/cuda/params.py) agree: the same
structs, each with the same fields in the same order and of matching C types, and every extern
"C" entry point of csrc/<family>.cu takes a pointer to the struct params.ENTRY_POINTS names for
it. CPU only: the header is parsed as text, no compiler involved."""

import ctypes
import re

import pytest

from torchtitan_megamoe.ops.hopper.cuda import build, params

HEADER = build.CSRC / "include" / "launch_params.h"
C_TYPES = {"int": ctypes.c_int, "long long": ctypes.c_longlong}


def header_structs() -> dict[str, list[tuple[str, str]]]:
    """{struct name: [(C type, field name), ...]} of the header's typedef structs."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    structs = {}
    for name, body, alias in re.findall(r"typedef struct (\w+) \{(.*?)\} (\w+);", text, re.S):
        assert name == alias, f"typedef struct {name} ... {alias}"
        fields = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            m = re.fullmatch(r"(.+?)\s*(\*?)\s*(\w+)", decl)
            assert m, f"{name}: cannot read the field {decl!r} (one field per declaration)"
            fields.append((m.group(1).strip() + m.group(2), m.group(3)))
        structs[name] = fields
    return structs


def mirrors() -> dict[str, type]:
    return {n: c for n, c in vars(params).items()
            if isinstance(c, type) and issubclass(c, ctypes.Structure) and c is not ctypes.Structure}


def test_the_header_declares_structs():
    assert len(header_structs()) == 8


def test_every_struct_has_its_mirror_and_no_more():
    assert set(header_structs()) == set(mirrors())


@pytest.mark.parametrize("name", sorted(header_structs()))
def test_fields_agree_in_name_type_and_order(name):
    c_fields = header_structs()[name]
    py_fields = mirrors()[name]._fields_
    assert [f for _, f in c_fields] == [f for f, _ in py_fields], name
    for (c_type, field), (_, py_type) in zip(c_fields, py_fields):
        expected = ctypes.c_void_p if c_type.endswith("*") else C_TYPES[c_type]
        assert py_type is expected, f"{name}.{field}: C {c_type}, Python {py_type.__name__}"


def test_entry_points_take_the_named_struct():
    for family, entries in params.ENTRY_POINTS.items():
        source = (build.CSRC / f"{family}.cu").read_text()
        declared = dict(re.findall(r'extern "C" int (megamoe_\w+)\(const (\w+)\* \w+\)', source))
        assert declared == {entry: struct.__name__ for entry, struct in entries.items()}, family

