"""The JIT build finds the CUDA sources from a checkout and from an installed wheel.

csrc/ sits at the top of the repository; setup.py copies its .cu/.cuh/.h files (with their
subfolders) into the wheel's package (torchtitan_megamoe/csrc/), and
ops/hopper/cuda/build.find_csrc() looks in the checkout first, then in the package. The wheel test builds the wheel from a copy of the sources (so no
build/ or egg-info lands in the checkout), installs it into a scratch target and asks find_csrc
from there, in a fresh interpreter run elsewhere. Offline: pip neither resolves dependencies nor
reaches an index (--no-deps, --no-index), and builds without isolation when setuptools is
installed here (else it must fetch setuptools>=64 for an isolated build).
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

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


def test_installed_wheel_carries_and_finds_csrc(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy2(REPO / name, src / name)
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("csrc", "torchtitan_megamoe"):
        shutil.copytree(REPO / name, src / name, ignore=junk)
    wheels = tmp_path / "wheels"
    _pip("wheel", "--wheel-dir", str(wheels), str(src), cwd=tmp_path)
    (wheel,) = wheels.glob("torchtitan_megamoe-*.whl")
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
