"""Every MEGAMOE_* environment variable (or compile-time define) the repository names is one
README.md lists in its "## Settings" table, and the table lists only names still in use: a
measuring switch cannot come back undocumented, and a removed one cannot stay in the table.
The raw measurement files under docs/perf/ are history and not scanned."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"MEGAMOE_[A-Z0-9_]*[A-Z0-9]")


def _settings_table() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    return {m.group(1) for m in re.finditer(r"^\| `(MEGAMOE_[A-Z0-9_]+)` \|", section, re.M)}


def _named_in_repository() -> dict[str, list[str]]:
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                               check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout")
    names: dict[str, list[str]] = {}
    for f in files:
        if not f or f.startswith("docs/perf/") or f == "README.md":
            continue
        try:
            text = (ROOT / f).read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        for name in set(NAME.findall(text)):
            names.setdefault(name, []).append(f)
    return names


def test_every_setting_is_in_the_readme_table_and_only_those():
    table = _settings_table()
    assert table, "README.md has no '## Settings' table"
    named = _named_in_repository()
    undocumented = {n: fs for n, fs in named.items() if n not in table}
    assert not undocumented, f"not in README.md's Settings table: {undocumented}"
    unused = table - set(named)
    assert not unused, f"README.md's Settings table lists names nothing reads: {unused}"


def test_loopback_link_gbs(monkeypatch):
    from torchtitan_megamoe import settings

    monkeypatch.delenv(settings.LOOPBACK_LINK_GBS, raising=False)
    assert settings.loopback_link_gbs() == 0.0
    monkeypatch.setenv(settings.LOOPBACK_LINK_GBS, "326")
    assert settings.loopback_link_gbs() == 326.0
    for bad in ("fast", "-5"):
        monkeypatch.setenv(settings.LOOPBACK_LINK_GBS, bad)
        with pytest.raises(ValueError, match="MEGAMOE_LOOPBACK_LINK_GBS=.*GB/s"):
            settings.loopback_link_gbs()


def test_exchange_timeout(monkeypatch):
    from torchtitan_megamoe import settings

    monkeypatch.delenv(settings.EXCHANGE_TIMEOUT_S, raising=False)
    assert settings.exchange_timeout_ms() == 600_000
    monkeypatch.setenv(settings.EXCHANGE_TIMEOUT_S, "2.5")
    assert settings.exchange_timeout_ms() == 2500
    for bad in ("never", "0"):
        monkeypatch.setenv(settings.EXCHANGE_TIMEOUT_S, bad)
        with pytest.raises(ValueError, match="MEGAMOE_EXCHANGE_TIMEOUT_S=.*seconds"):
            settings.exchange_timeout_ms()
