"""The TOMLs of an A/B (stock and megamoe) from one loaded config, the sides (two or more) and
what they need."""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass

DEFAULT_CONFIG = "train_configs/qwen3_moe_tiny_cpu.toml"
CONVERTER = "megamoe"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} value {v!r} to TOML")


def dump_toml(data: dict, prefix: str = "") -> str:
    """TOML text for the nested dict of a TorchTitan config (tables, scalars, lists)."""
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    out = []
    if prefix and (scalars or not tables):
        out.append(f"[{prefix}]")
    out += [f"{k} = {_toml_value(v)}" for k, v in scalars.items()]
    if out:
        out.append("")
    for k, v in tables.items():
        out.append(dump_toml(v, f"{prefix}.{k}" if prefix else k))
    return "\n".join(out)


def variant_configs(config: dict, converter: str = CONVERTER) -> tuple[dict, dict]:
    """(stock, converter) copies of a loaded TOML that differ only in [model] converters."""
    import copy

    stock, conv = copy.deepcopy(config), copy.deepcopy(config)
    base = list(config.get("model", {}).get("converters", []))
    stock.setdefault("model", {})["converters"] = [c for c in base if c != converter]
    conv.setdefault("model", {})["converters"] = (
        base if converter in base else base + [converter]
    )
    if not config.get("job", {}).get("custom_config_module"):
        raise ValueError(
            "the config has no [job] custom_config_module; set it to "
            '"torchtitan_megamoe.config" (it registers the megamoe converter)'
        )
    return stock, conv


@dataclass(frozen=True)
class Side:
    """One side of an A/B: ``label`` names its files (``<label>.toml``, ``<label>.log``, the dump
    folder ``<label>/``) and its column in the report; ``kind`` is ``"stock"`` (the config
    without the converter) or ``"megamoe"`` (with it); ``args`` are TorchTitan CLI arguments of
    this side only, given after the common ones (so they override them), e.g.
    ``("--megamoe.precision", "fp8")``."""

    label: str
    kind: str
    args: tuple[str, ...] = ()


KINDS = ("stock", CONVERTER)
DEFAULT_SIDES = (Side("stock", "stock"), Side(CONVERTER, CONVERTER))
"""Stock vs the converter: today's A/B."""

_LABEL = re.compile(r"^[A-Za-z0-9_.+-]+$")


def parse_side_args(items=()) -> dict[str, str]:
    """``--side-args 'LABEL=ARGS'`` (repeatable) as {label: args}: ARGS is one shell-quoted
    string of TorchTitan arguments for the side named LABEL, e.g.
    ``fp8=--megamoe.precision fp8 --megamoe.save_activations never``. A dict passes through."""
    if isinstance(items, dict):
        return dict(items)
    out: dict[str, str] = {}
    for item in items or ():
        label, eq, args = item.partition("=")
        label = label.strip()
        if not eq or not _LABEL.match(label):
            raise ValueError(f"--side-args takes LABEL=ARGS (LABEL a side's label), got {item!r}")
        if label in out:
            raise ValueError(f"--side-args: two values for side {label!r}; give its arguments "
                             "in one string")
        out[label] = args
    return out


def parse_sides(spec: str = "stock,megamoe", a_args: str = "", b_args: str = "",
                side_args=()) -> tuple:
    """The sides of ``--sides A,B[,C...]`` (each ``KIND`` or ``LABEL=KIND``, KIND ``stock`` or
    ``megamoe``), two or more, with their own TorchTitan arguments: ``--a-args`` / ``--b-args``
    (one shell-quoted string each) for the first and second side, ``side_args``
    (``--side-args 'LABEL=ARGS'``, see ``parse_side_args``) for any side by label.

    ``stock,megamoe`` with no side args is ``DEFAULT_SIDES``. Two sides of one label (e.g.
    ``megamoe,megamoe``) become ``<label>_a`` and ``<label>_b``; name them instead, e.g.
    ``fp8=megamoe,bf16=megamoe``. With three or more sides every label must be distinct."""
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) < 2 or not all(parts):
        raise ValueError(f"--sides takes two or more comma-separated sides (A,B[,C...]), got "
                         f"{spec!r}")
    sides = []
    for part in parts:
        label, eq, kind = part.partition("=")
        if not eq:
            kind = label
        label, kind = label.strip(), kind.strip()
        if kind not in KINDS:
            raise ValueError(f"side {part!r}: the kind must be one of {', '.join(KINDS)} "
                             f"(KIND or LABEL=KIND), got {kind!r}")
        if not _LABEL.match(label):
            raise ValueError(f"side {part!r}: the label {label!r} must be letters, digits or "
                             "_.+- (it names files)")
        sides.append([label, kind])
    labels = [s[0] for s in sides]
    if len(sides) == 2 and labels[0] == labels[1]:
        sides[0][0] += "_a"
        sides[1][0] += "_b"
    elif len(set(labels)) != len(labels):
        dup = sorted({x for x in labels if labels.count(x) > 1})
        raise ValueError(f"--sides: the label(s) {', '.join(dup)} name more than one side; "
                         "name each side (LABEL=KIND), e.g. fp8=megamoe,bf16=megamoe")
    by_label = parse_side_args(side_args)
    labels = [s[0] for s in sides]
    unknown = [k for k in by_label if k not in labels]
    if unknown:
        raise ValueError(f"--side-args names no side: {', '.join(unknown)} (the sides are "
                         f"{', '.join(labels)})")
    for i, args in ((0, a_args), (1, b_args)):
        if args and sides[i][0] in by_label:
            raise ValueError(f"side {sides[i][0]!r} has both --{'ab'[i]}-args and --side-args; "
                             "give one")
        if args:
            by_label[sides[i][0]] = args
    return tuple(Side(label, kind, tuple(shlex.split(by_label.get(label) or "")))
                 for label, kind in sides)


def baseline_index(sides, baseline: str | None = None) -> int:
    """Index of the side the others are compared against: ``baseline`` (a label), default the
    first side (A: a two-side A/B's differences are B - A)."""
    labels = [s.label for s in sides]
    if baseline is None:
        return 0
    if baseline not in labels:
        raise ValueError(f"--baseline {baseline!r} is not one of the sides ({', '.join(labels)})")
    return labels.index(baseline)


def side_configs(config: dict, sides: tuple = DEFAULT_SIDES, converter: str = CONVERTER) -> tuple:
    """The loaded TOML for each side: its stock or its converter variant (``variant_configs``)."""
    stock, conv = variant_configs(config, converter)
    return tuple(stock if s.kind == "stock" else conv for s in sides)


def cli_value(extra: list[str], key: str) -> str | None:
    """Value of ``--section.key`` in TorchTitan CLI args (``--a.b v``, ``--a.b=v``, dashes ok)."""
    names = {f"--{key}", f"--{key.replace('_', '-')}"}
    value = None
    for i, arg in enumerate(extra):
        name, eq, rest = arg.partition("=")
        if name in names:
            value = rest if eq else (extra[i + 1] if i + 1 < len(extra) else None)
    return value


def _maybe_make_assets(config: dict, extra: list[str]) -> None:
    from torchtitan_megamoe import assets

    tok = cli_value(extra, "model.hf_assets_path") or config.get("model", {}).get(
        "hf_assets_path"
    )
    data = cli_value(extra, "training.dataset_path") or config.get("training", {}).get(
        "dataset_path"
    )
    if not tok or not data:
        return
    root = os.path.dirname(os.path.normpath(tok))
    if os.path.normpath(tok) != os.path.normpath(assets.tokenizer_dir(root)):
        return
    if os.path.normpath(data) != os.path.normpath(assets.dataset_dir(root)):
        return
    if not (os.path.isdir(tok) and os.path.isdir(data)):
        assets.make_assets(root)
