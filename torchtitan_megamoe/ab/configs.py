"""The two TOMLs of an A/B (stock and megamoe) from one loaded config, and what they need."""

from __future__ import annotations

import json
import os

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
