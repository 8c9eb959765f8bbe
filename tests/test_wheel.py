"""The wheel: it carries the CUDA sources, and it ships the library without the tools' extras.

csrc/ sits at the top of the repository; setup.py copies its .cu/.cuh/.h files (with
their subfolders) into the wheel's package (torchtitan_megamoe/csrc/), and ops/hopper/cuda/build.find_csrc() looks in the checkout
first, then in the package. The wheel is built once per module from a copy of the sources (so no
build/ or egg-info lands in the checkout); one test installs it into a scratch target and asks
find_csrc from there, in a fresh interpreter run elsewhere; another reads its metadata and
resolves what ``pip install torchtitan-megamoe`` would install, through the distributions
installed here, to show matplotlib is not among them. Offline: pip neither resolves dependencies
nor reaches an index (--no-deps, --no-index), and builds without isolation when setuptools is
installed here (else it must fetch setuptools>=64 for an isolated build).
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
CSRC = sorted(str(p.relative_to(REPO / "csrc")) for p in (REPO / "csrc").rglob("*")
              if p.is_file() and p.suffix in (".cu", ".cuh", ".h"))


def _pip(*args, cwd):
    offline = ["--no-index"]
    if importlib.util.find_spec("setuptools") is not None:
        offline.append("--no-build-isolation")
    else:  # an isolated build fetches setuptools: an index is needed
        offline = []
    cmd = [sys.executable, "-m", "pip", *args, "--no-deps", "--disable-pip-version-check",
           "-q", *offline]
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"


def test_checkout_finds_the_top_level_csrc():
    from torchtitan_megamoe.ops.hopper.cuda import build

    assert CSRC and "gemm1_swiglu.cu" in CSRC and "include/launch_params.h" in CSRC
    assert Path(build.__file__).resolve().is_relative_to(REPO), "not the checkout's package"
    assert build.find_csrc() == REPO / "csrc"
    assert build.CSRC == REPO / "csrc"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy2(REPO / name, src / name)
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("csrc", "torchtitan_megamoe"):
        shutil.copytree(REPO / name, src / name, ignore=junk)
    wheels = tmp / "wheels"
    _pip("wheel", "--wheel-dir", str(wheels), str(src), cwd=tmp)
    (built,) = wheels.glob("torchtitan_megamoe-*.whl")
    return built


def test_installed_wheel_carries_and_finds_csrc(wheel, tmp_path):
    names = zipfile.ZipFile(wheel).namelist()
    assert sorted(n.removeprefix("torchtitan_megamoe/csrc/") for n in names
                  if n.startswith("torchtitan_megamoe/csrc/")) == CSRC, names
    assert not any(n.startswith(("tests/", "tools/", "experiments/", "csrc/")) for n in names)

    target = tmp_path / "target"
    _pip("install", "--target", str(target), str(wheel), cwd=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = (
        "import json, torchtitan_megamoe\n"
        "from torchtitan_megamoe.ops.hopper.cuda import build\n"
        "print(json.dumps({'package': torchtitan_megamoe.__file__, "
        "'csrc': str(build.find_csrc()), 'CSRC': str(build.CSRC)}))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    done = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    installed = (target / "torchtitan_megamoe").resolve()
    assert Path(found["package"]).resolve().parent == installed, found
    assert Path(found["csrc"]) == Path(found["CSRC"]) == installed / "csrc", found
    for name in CSRC:
        assert (installed / "csrc" / name).read_bytes() == (REPO / "csrc" / name).read_bytes()


def _requires_dist(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        headers = Parser().parsestr(z.read(meta).decode())
    return [Requirement(r) for r in headers.get_all("Requires-Dist") or []]


def _wanted(req: Requirement, extras: set[str]) -> bool:
    """Whether ``req`` applies on this Python when its owner is installed with ``extras``."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in (extras or {""}))


def _closure(reqs: list[Requirement]) -> tuple[set[str], set[str]]:
    """What installing ``reqs`` pulls in, followed through the distributions installed here:
    (every project name reached, the names not installed here and so not followed)."""
    import importlib.metadata as md

    seen: set[tuple[str, frozenset]] = set()
    names: set[str] = set()
    missing: set[str] = set()
    todo = list(reqs)
    while todo:
        req = todo.pop()
        name, extras = canonicalize_name(req.name), frozenset(req.extras)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        names.add(name)
        try:
            deps = md.requires(req.name) or []
        except md.PackageNotFoundError:
            missing.add(name)
            continue
        todo += [d for d in map(Requirement, deps) if _wanted(d, set(extras))]
    return names, missing


def test_plain_install_pulls_no_matplotlib_and_the_extras_do(wheel):
    reqs = _requires_dist(wheel)
    core = [r for r in reqs if _wanted(r, set())]
    by_extra = {e: {canonicalize_name(r.name) for r in reqs
                    if r.marker is not None and r.marker.evaluate({"extra": e})}
                for e in ("ab", "bench", "tools", "test")}
    core_names = {canonicalize_name(r.name) for r in core}
    # The library and what TorchTitan itself needs stay; the tools' own dependencies do not.
    assert {"torch", "torchtitan", "triton", "tokenizers", "torchdata"} <= core_names
    assert "matplotlib" not in core_names and "torchao" not in core_names
    assert "matplotlib" in by_extra["ab"] and "torchao" in by_extra["bench"]
    assert "torchtitan-megamoe" in by_extra["tools"]  # [tools] = [ab,bench]
    # Nothing a plain install brings pulls matplotlib in either (TorchTitan's own dependencies
    # followed through what is installed here; the test environment has them all).
    names, missing = _closure(core)
    assert not missing, f"not installed here, so not followed: {sorted(missing)}"
    assert "matplotlib" not in names, "a dependency of a plain install pulls matplotlib"
    assert {"datasets", "tensorboard"} <= names  # the walk does reach TorchTitan's own needs
    # The extra does bring it.
    tools = [r for r in reqs if not _wanted(r, set()) and _wanted(r, {"ab"})]
    assert "matplotlib" in _closure(tools)[0]
