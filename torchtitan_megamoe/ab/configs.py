"""The two TOMLs of an A/B (stock and megamoe) from one loaded config, and what they need."""

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


def parse_sides(spec: str = "stock,megamoe", a_args: str = "", b_args: str = "") -> tuple:
    """The two sides of ``--sides A,B`` (each ``KIND`` or ``LABEL=KIND``, KIND ``stock`` or
    ``megamoe``) with ``--a-args`` / ``--b-args`` (one shell-quoted string each).

    ``stock,megamoe`` with no side args is ``DEFAULT_SIDES``. Two sides of one label (e.g.
    ``megamoe,megamoe``) become ``<label>_a`` and ``<label>_b``; name them instead, e.g.
    ``fp8=megamoe,bf16=megamoe``."""
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"--sides takes two comma-separated sides (A,B), got {spec!r}")
    sides = []
    for part, args in zip(parts, (a_args, b_args)):
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
        sides.append([label, kind, tuple(shlex.split(args or ""))])
    if sides[0][0] == sides[1][0]:
        sides[0][0] += "_a"
        sides[1][0] += "_b"
    return tuple(Side(*s) for s in sides)


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
