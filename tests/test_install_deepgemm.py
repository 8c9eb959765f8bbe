"""The optional DeepGEMM extra: scripts/install_deepgemm.sh and gpu_check.sh's DeepGEMM set-up.

On CPU, with stand-ins on a PATH of their own: a fake ``torch`` module (the version and CUDA build
a test asks for), a fake nvcc that reports a release, a fake g++ that "compiles" <format> only
from version 13 on and finds elfutils/libdwfl.h only where a test puts one, and a tiny sdist
named like DeepGEMM's whose setup.py records the environment it was built in. The checks must
name what is missing and its fix; a full install must build offline with DeepGEMM's build
switches and leave an env file that still works after its folder moves; gpu_check.sh must build
from .dgsdist/, pack the result and the JIT cache, and use a carried .dgsite/ and .dgjit/. The
libdwfl.h stub itself is compiled by a real g++ where there is one. No network.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "install_deepgemm.sh"
# the full installs build the stand-in sdist offline, without isolation: setuptools must be here
needs_setuptools = pytest.mark.skipif(importlib.util.find_spec("setuptools") is None,
                                      reason="needs setuptools in this environment")
TOOLS = ("bash sh env sed grep head tail cat tee dirname basename readlink realpath mktemp rm "
         "mkdir cut tr find timeout tar gzip stat chmod cp mv ls sort uname xargs sha256sum wc "
         "touch id nproc").split()


def _exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _loaded_libstdcxx() -> str | None:
    """The libstdc++ a python process maps once something loads it (the fake torch does)."""
    probe = ("import ctypes, os\nctypes.CDLL('libstdc++.so.6')\n"
             "print(next(os.path.realpath(l.split()[-1]) for l in open('/proc/self/maps')"
             " if '/libstdc++.so' in l))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return done.stdout.strip() or None if done.returncode == 0 else None


class Box:
    """A scratch machine: fake tools, a fake CUDA toolkit and a fake torch; ``run`` the script."""

    def __init__(self, root: Path):
        self.root = root
        self.sysbin = root / "sysbin"
        self.fakebin = root / "fakebin"
        self.sysbin.mkdir()
        self.fakebin.mkdir()
        for tool in TOOLS:
            if (found := shutil.which(tool)):
                (self.sysbin / tool).symlink_to(found)
        self.sysinc = root / "sysinc"  # where the fake g++ finds system headers
        self.sysinc.mkdir()
        self.libstdcxx = _loaded_libstdcxx() or "/nonexistent/libstdc++.so.6"
        self.cuda_home = self.cuda("13.0")
        self.torch("2.11.0+cu130", "13.0")
        self.gxx("g++", "13.2.0")
        self.dwfl(True)

    def cuda(self, release: str, headers=("cuda_runtime.h", "cublasLt.h", "cusparse.h",
                                          "cusolverDn.h")) -> Path:
        home = self.root / f"cuda-{release}"
        _exe(home / "bin" / "nvcc",
             f'#!/bin/sh\necho "Cuda compilation tools, release {release}, V{release}.1"\n')
        (home / "include").mkdir(exist_ok=True)
        for h in headers:
            (home / "include" / h).write_text("")
        return home

    def torch(self, version: str, cuda: str | None):
        pkg = self.root / "faketorch" / "torch"
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text(
            "import ctypes, types\n"
            "try:\n    ctypes.CDLL('libstdc++.so.6')  # a real torch maps one\n"
            "except OSError:\n    pass\n"
            f"__version__ = {version!r}\nversion = types.SimpleNamespace(cuda={cuda!r})\n")

    def gxx(self, name: str, version: str, lib: str | None = None):
        _exe(self.fakebin / name, f"""#!/bin/bash
for a in "$@"; do
  case $a in
    -dumpfullversion|-dumpversion) echo {version}; exit 0 ;;
    -print-file-name=*) echo {lib or self.libstdcxx}; exit 0 ;;
  esac
done
src=$(cat)
case $src in *"<format>"*) [ {version.split('.')[0]} -ge 13 ] || exit 1 ;; esac
case $src in *libdwfl.h*)
  IFS=: read -ra inc <<<"{self.sysinc}:${{CPLUS_INCLUDE_PATH:-}}"
  for d in "${{inc[@]}}"; do [ -f "$d/elfutils/libdwfl.h" ] && exit 0; done
  exit 1 ;;
esac
exit 0
""")

    def dwfl(self, present: bool):
        header = self.sysinc / "elfutils" / "libdwfl.h"
        if present:
            header.parent.mkdir(exist_ok=True)
            header.write_text("/* libdw-dev's */\n")
        elif header.exists():
            header.unlink()

    def env(self, **extra) -> dict:
        env = {"PATH": f"{self.fakebin}:{self.sysbin}", "HOME": str(self.root),
               "PYTHON": sys.executable, "PYTHONPATH": str(self.root / "faketorch"),
               "CUDA_HOME": str(self.cuda_home), "LANG": "C.UTF-8"}
        for k, v in extra.items():  # None: unset
            env.pop(k, None) if v is None else env.__setitem__(k, str(v))
        return env

    def run(self, *args, script=SCRIPT, cwd=None, **extra) -> subprocess.CompletedProcess:
        done = subprocess.run(["bash", str(script), *map(str, args)], env=self.env(**extra),
                              cwd=cwd or self.root, capture_output=True, text=True, timeout=300)
        done.out = done.stdout + done.stderr
        return done


@pytest.fixture
def box(tmp_path) -> Box:
    return Box(tmp_path)


def _sdist(where: Path) -> Path:
    """A stand-in for deepinfer_gemm-2.8.2.tar.gz: pure Python, records its build environment."""
    src = where / "deepinfer_gemm-2.8.2"
    (src / "deep_gemm").mkdir(parents=True)
    (src / "deep_gemm" / "__init__.py").write_text('__version__ = "2.8.2"\n')
    (src / "setup.py").write_text(
        "import json, os\nfrom setuptools import setup\n"
        "keys = ['DG_FORCE_BUILD', 'DG_PACKAGE_NAME', 'TORCH_CUDA_ARCH_LIST', 'CXX', 'CC',\n"
        "        'LDSHARED', 'CUDA_HOME', 'DG_JIT_CACHE_DIR']\n"
        "with open('deep_gemm/build_env.json', 'w') as f:\n"
        "    json.dump({k: os.environ.get(k) for k in keys}, f)\n"
        "setup(name=os.environ.get('DG_PACKAGE_NAME', 'deepgemm'), version='2.8.2',\n"
        "      packages=['deep_gemm'], package_data={'deep_gemm': ['build_env.json']})\n")
    out = where / "deepinfer_gemm-2.8.2.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        tar.add(src, arcname=src.name)
    shutil.rmtree(src)
    return out


def _errors(out: str) -> list[str]:
    return re.findall(r"^install_deepgemm: error: (.*)$", out, re.MULTILINE)


# --------------------------------------------------------------------------------------------
# The checks (--check-only: nothing is built)


def test_all_present_passes_and_prints_the_build_command(box):
    done = box.run("--check-only", "--sdist", _sdist(box.root), "--target", box.root / "site")
    assert done.returncode == 0, done.out
    assert not _errors(done.out)
    line = next(l for l in done.out.splitlines() if "checks passed" in l)
    for part in ("DG_FORCE_BUILD=1", "DG_PACKAGE_NAME=deepinfer_gemm", "TORCH_CUDA_ARCH_LIST=9.0",
                 "CXX=g++", "--no-build-isolation", "--no-deps", "--no-index",
                 f"--target {box.root / 'site'}", "deepinfer_gemm-2.8.2.tar.gz"):
        assert part in line, (part, line)
    assert not (box.root / "site").exists(), "--check-only created the target"
    assert "nvcc 13.0" in done.out and "torch 2.11.0+cu130" in done.out


def test_without_an_sdist_it_installs_the_pinned_release_from_the_index(box):
    done = box.run("--check-only")
    assert done.returncode == 0, done.out
    line = next(l for l in done.out.splitlines() if "checks passed" in l)
    assert "deepinfer-gemm==2.8.2" in line and "--no-index" not in line and "--target" not in line


def test_cuda_home_without_nvcc(box):
    (box.root / "empty").mkdir()
    done = box.run("--check-only", CUDA_HOME=box.root / "empty")
    assert done.returncode == 1
    assert _errors(done.out) == [(f"CUDA_HOME={box.root / 'empty'} has no bin/nvcc: set CUDA_HOME "
                                  "to a CUDA toolkit >= 12.9")]
    assert "1 problem(s) above; nothing installed" in done.out


@pytest.mark.skipif(Path("/usr/local/cuda/bin/nvcc").exists(),
                    reason="this machine has /usr/local/cuda, which the script falls back to")
def test_no_nvcc_anywhere(box):
    done = box.run("--check-only", CUDA_HOME=None)
    assert done.returncode == 1
    (err,) = _errors(done.out)
    assert err.startswith("no nvcc") and "install the CUDA toolkit and set CUDA_HOME" in err


def test_nvcc_on_path_names_its_toolkit(box):
    (box.fakebin / "nvcc").symlink_to(box.cuda_home / "bin" / "nvcc")
    done = box.run("--check-only", CUDA_HOME=None)
    assert done.returncode == 0, done.out
    assert f"nvcc 13.0 in {box.cuda_home}" in done.out


def test_old_nvcc(box):
    box.torch("2.6.0+cu124", "12.4")
    done = box.run("--check-only", CUDA_HOME=box.cuda("12.4"))
    assert done.returncode == 1
    (err,) = _errors(done.out)
    assert "nvcc 12.4" in err and "older than 12.9" in err and "CUDA toolkit >= 12.9" in err


def test_nvcc_of_another_major_version_than_torch(box):
    box.torch("2.9.0+cu129", "12.9")
    done = box.run("--check-only")
    assert done.returncode == 1
    (err,) = _errors(done.out)
    assert "nvcc 13.0 vs torch built for CUDA 12.9" in err and "CUDA 12.x toolkit" in err


def test_missing_cuda_library_headers(box):
    done = box.run("--check-only", CUDA_HOME=box.cuda("13.1", headers=("cuda_runtime.h",)))
    assert done.returncode == 1
    assert [e.split(":")[0] for e in _errors(done.out)] == [
        f"no {h} in {box.root / 'cuda-13.1'}/include nor in pip's nvidia packages"
        for h in ("cublasLt.h", "cusparse.h", "cusolverDn.h")]


def test_old_gxx_only(box):
    box.gxx("g++", "12.2.0")
    done = box.run("--check-only")
    assert done.returncode == 1
    assert _errors(done.out) == [
        ("no C++ compiler with C++20 <format> (tried: g++ 12.2.0): DeepGEMM needs g++ >= 13; "
         "install one (Debian/Ubuntu: apt-get install g++-13) or set CXX to it")]


def test_old_gxx_with_a_newer_one_beside_it(box):
    box.gxx("g++", "12.2.0")
    box.gxx("g++-13", "13.3.0")
    done = box.run("--check-only")
    assert done.returncode == 0, done.out
    assert "C++ compiler: g++-13 13.3.0" in done.out and "CXX=g++-13 " in done.out


def test_cpu_torch(box):
    box.torch("2.11.0+cpu", None)
    done = box.run("--check-only")
    assert done.returncode == 1
    (err,) = _errors(done.out)
    assert "torch 2.11.0+cpu" in err and "CPU-only build" in err and "CUDA build of torch" in err


def test_this_environments_torch_through_the_real_probe(box):
    torch = pytest.importorskip("torch")
    if torch.version.cuda:
        pytest.skip("this environment's torch is a CUDA build")
    done = box.run("--check-only", PYTHONPATH=None)
    assert done.returncode == 1
    (err,) = _errors(done.out)
    assert f"torch {torch.__version__}" in err and "CPU-only build" in err


def test_every_problem_is_named_at_once(box):
    box.torch("2.11.0+cpu", None)
    box.gxx("g++", "11.4.0")
    (box.root / "empty").mkdir()
    done = box.run("--check-only", "--sdist", box.root / "nope.tar.gz",
                   CUDA_HOME=box.root / "empty")
    assert done.returncode == 1
    errs = _errors(done.out)
    assert len(errs) == 4, done.out
    assert "CPU-only build" in errs[0] and "has no bin/nvcc" in errs[1]
    assert "tried: g++ 11.4.0" in errs[2] and errs[3] == f"no sdist at {box.root / 'nope.tar.gz'}"
    assert "4 problem(s) above; nothing installed" in done.out


def test_missing_libdwfl_header_gets_the_stub(box):
    box.dwfl(False)
    done = box.run("--check-only")
    assert done.returncode == 0, done.out
    assert "no elfutils/libdwfl.h (Debian: libdw-dev): building with a declaration-only stub" \
        in done.out
    box.dwfl(True)
    assert "stub" not in box.run("--check-only").out


def test_preload_hint_when_python_loads_another_libstdcxx(box):
    if not Path(box.libstdcxx).is_file():
        pytest.skip("no libstdc++ to load here")
    own = box.root / "gcc-14" / "libstdc++.so.6"
    own.parent.mkdir()
    shutil.copy(box.libstdcxx, own)
    box.gxx("g++", "14.1.0", lib=str(own))
    done = box.run("--check-only")
    assert done.returncode == 0, done.out
    hints = [l for l in done.out.splitlines() if l.startswith("export LD_PRELOAD=")]
    assert hints == [(f"export LD_PRELOAD={own}  # DeepGEMM: python loads {box.libstdcxx}; "
                      "its JIT needs g++'s")]
    box.gxx("g++", "14.1.0")  # the compiler's is the one python loads: no hint
    assert "LD_PRELOAD" not in box.run("--check-only").out


def test_the_libdwfl_stub_declares_what_deepjit_takes_from_libdw(tmp_path):
    """The stub, compiled for real, against the uses DeepJIT makes of it: each function's
    address taken into a pointer of its own type, and the callbacks filled in."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ here")
    text = SCRIPT.read_text()
    stub = text.split("<<'STUB'\n", 1)[1].split("\nSTUB\n", 1)[0]
    (tmp_path / "elfutils").mkdir()
    (tmp_path / "elfutils" / "libdwfl.h").write_text(stub + "\n")
    (tmp_path / "use.cpp").write_text("""
#include <elfutils/libdwfl.h>
#include <elfutils/libdwfl.h>
struct Api {
  decltype(&::dwfl_begin) begin = ::dwfl_begin;
  decltype(&::dwfl_linux_proc_report) report = ::dwfl_linux_proc_report;
  decltype(&::dwfl_report_end) end = ::dwfl_report_end;
  decltype(&::dwfl_addrmodule) addrmodule = ::dwfl_addrmodule;
  decltype(&::dwfl_module_addrname) addrname = ::dwfl_module_addrname;
  decltype(&::dwfl_module_getsrc) getsrc = ::dwfl_module_getsrc;
  decltype(&::dwfl_lineinfo) lineinfo = ::dwfl_lineinfo;
  decltype(&::dwfl_linux_proc_find_elf) find_elf = ::dwfl_linux_proc_find_elf;
  Dwfl_Callbacks callbacks = {};
  Dwfl *dwfl = nullptr;
  Api() {
    callbacks.find_elf = find_elf;
    callbacks.find_debuginfo = +[](Dwfl_Module *, void **, const char *, Dwarf_Addr,
                                   const char *, const char *, GElf_Word, char **) { return -1; };
    dwfl = begin(&callbacks);
    report(dwfl, 0);
    end(dwfl, nullptr, nullptr);
    int line = 0;
    Dwfl_Module *m = addrmodule(dwfl, Dwarf_Addr{0});
    const char *name = addrname(m, GElf_Addr{0});
    const char *file = lineinfo(getsrc(m, 0), nullptr, &line, nullptr, nullptr, nullptr);
    (void)name; (void)file;
  }
};
""")
    done = subprocess.run([gxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Werror",
                           f"-I{tmp_path}", str(tmp_path / "use.cpp")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------------------------
# A full install, offline, of a stand-in sdist


@needs_setuptools
def test_install_into_a_target_builds_with_deepgemms_switches(box):
    sdist = _sdist(box.root)
    target = box.root / "site"
    # PYTHON relative to the working directory, as `make deepgemm` passes .venv/bin/python
    done = box.run("--sdist", sdist, "--target", target, DG_JIT_CACHE_DIR=box.root / "jit",
                   TORCH_CUDA_ARCH_LIST=None, PYTHON=os.path.relpath(sys.executable, box.root))
    assert done.returncode == 0, done.out
    assert f"installed deep_gemm into {target}" in done.out
    built = json.loads((target / "deep_gemm" / "build_env.json").read_text())
    assert built == {"DG_FORCE_BUILD": "1", "DG_PACKAGE_NAME": "deepinfer_gemm",
                     "TORCH_CUDA_ARCH_LIST": "9.0", "CXX": "g++", "CC": "g++",
                     "LDSHARED": "g++ -shared", "CUDA_HOME": str(box.cuda_home),
                     "DG_JIT_CACHE_DIR": None}  # set at build time, it would be baked in
    assert list(target.glob("deepinfer_gemm-2.8.2.dist-info"))

    # The env file works from wherever the folder is moved to, e.g. a checkout's .dgsite/.
    moved = box.root / "repo" / ".dgsite"
    moved.parent.mkdir()
    target.rename(moved)
    show = ("source .dgsite/deepgemm_env.sh && source .dgsite/deepgemm_env.sh && "
            "python -c 'import deep_gemm; print(deep_gemm.__file__)' && "
            'echo "PYTHONPATH=$PYTHONPATH" && echo "JIT=$DG_JIT_CACHE_DIR" && '
            'echo "PRELOAD=${LD_PRELOAD:-}" && echo "CUDA_HOME=$CUDA_HOME"')
    env = box.env(CUDA_HOME=None, PATH=f"{Path(sys.executable).parent}:{box.sysbin}")
    got = subprocess.run(["bash", "-c", show], cwd=moved.parent, env=env,
                         capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    lines = dict(l.split("=", 1) for l in got.stdout.splitlines()[1:])
    assert got.stdout.splitlines()[0] == str(moved / "deep_gemm" / "__init__.py")
    assert lines["PYTHONPATH"].split(":").count(str(moved)) == 1  # sourced twice, added once
    assert lines["JIT"] == f"{box.root}/.dj"  # DeepJIT's own default, under $HOME
    assert lines["CUDA_HOME"] == str(box.cuda_home)
    if Path(box.libstdcxx).is_file():
        assert lines["PRELOAD"] == box.libstdcxx


def test_pyproject_offers_the_extra_and_a_plain_install_does_not_pull_it():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert meta["optional-dependencies"]["deepgemm"] == ["deepinfer-gemm==2.8.2"]
    every = meta["dependencies"] + [r for name, reqs in meta["optional-dependencies"].items()
                                    if name != "deepgemm" for r in reqs]
    assert not [r for r in every if "gemm" in r.lower()], every


# --------------------------------------------------------------------------------------------
# gpu_check.sh's DeepGEMM set-up (SKIP_TESTS=1 SKIP_BENCH=1: the set-up and the report only)


def _checkout(box) -> Path:
    repo = box.root / "repo"
    shutil.copytree(REPO / "scripts", repo / "scripts")
    return repo


def _gpu_check(box, repo, out, **extra):
    extra = {"DEEPGEMM_SITE": box.root / "dgsite", **extra}
    done = box.run(script=repo / "scripts" / "gpu_check.sh", cwd=repo, OUT=out, SKIP_TESTS=1,
                   SKIP_BENCH=1, WHEELS=0, **extra)
    assert done.returncode == 0, done.out
    return done


def _names(tgz: Path) -> set[str]:
    with tarfile.open(tgz) as tar:
        return {n.removeprefix("./") for n in tar.getnames()}


@needs_setuptools
def test_gpu_check_builds_from_dgsdist_then_uses_the_carried_dgsite_and_dgjit(box):
    repo = _checkout(box)
    (repo / ".dgsdist").mkdir()
    _sdist(repo / ".dgsdist")
    out = box.root / "out1"
    done = _gpu_check(box, repo, out, DG_JIT_CACHE_DIR=box.root / "jit1")
    assert "DeepGEMM: building .dgsdist/deepinfer_gemm-2.8.2.tar.gz" in done.out
    assert f"DeepGEMM: 2.8.2 {box.root}/dgsite/deep_gemm/__init__.py" in done.out
    assert "DeepGEMM: 2.8.2" in (out / "env.log").read_text()
    names = _names(out / "dgsite.tgz")
    assert {"deep_gemm/__init__.py", "deepgemm_env.sh"} <= names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert not (out / "dgjit.tgz").exists(), "the JIT compiled nothing"

    # Next time: the lead unpacks both archives into the checkout; they travel read-only.
    shutil.rmtree(repo / ".dgsdist")
    (repo / ".dgsite").mkdir()
    with tarfile.open(out / "dgsite.tgz") as tar:
        tar.extractall(repo / ".dgsite", filter="data")
    kernel = repo / ".dgjit" / "cache" / "kernel.0123"
    kernel.mkdir(parents=True)
    (kernel / "kernel.cubin").write_text("sm_90a")
    for p in (repo / ".dgsite", repo / ".dgjit"):
        subprocess.run(["chmod", "-R", "a-w", str(p)], check=True)
    try:
        out2 = box.root / "out2"
        done = _gpu_check(box, repo, out2, DEEPGEMM_SITE=box.root / "elsewhere",
                          DG_JIT_CACHE_DIR=box.root / "jit2")
    finally:
        for p in (repo / ".dgsite", repo / ".dgjit"):
            subprocess.run(["chmod", "-R", "u+w", str(p)], check=True)
    assert "building" not in done.out
    assert f"DeepGEMM: 2.8.2 {repo}/.dgsite/deep_gemm/__init__.py" in done.out
    assert not (out2 / "dgsite.tgz").exists()
    assert (box.root / "jit2" / "cache" / "kernel.0123" / "kernel.cubin").is_file()
    assert "cache/kernel.0123/kernel.cubin" in _names(out2 / "dgjit.tgz")


@needs_setuptools
def test_gpu_check_packs_nothing_without_a_given_out(box):
    repo = _checkout(box)
    (repo / ".dgsdist").mkdir()
    _sdist(repo / ".dgsdist")
    done = _gpu_check(box, repo, None)
    assert "DeepGEMM: 2.8.2" in done.out
    assert not list((repo / ".out").glob("*.tgz"))


def test_gpu_check_skip_deepgemm(box):
    repo = _checkout(box)
    (repo / ".dgsdist").mkdir()
    _sdist(repo / ".dgsdist")
    done = _gpu_check(box, repo, box.root / "out", SKIP_DEEPGEMM=1)
    assert "DeepGEMM: skipped (SKIP_DEEPGEMM=1), MEGAMOE_DEEPGEMM=0" in done.out
    assert "DeepGEMM: not importable" in done.out and "building" not in done.out
