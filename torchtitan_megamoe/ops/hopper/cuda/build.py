"""JIT build of the CUDA sources in csrc/ into cached shared libraries, one per kernel family.

Each csrc/<family>.cu (its bf16 and FP8 entry points, built from the shared blocks in
csrc/include/) is its own library: a family's edit rebuilds only that family, and a process
loads only the families its tuners offer. A source is compiled once per (source text, every
header, nvcc version, target) into
``$MEGAMOE_CUDA_CACHE`` (default ``~/.cache/torchtitan_megamoe/cuda``) and loaded with ctypes.
Ranks of one torchrun share the cache: a file lock makes one of them compile while the others
wait, and the library is renamed into place only when complete. No torch headers are involved,
so a build takes seconds.
"""

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from torchtitan_megamoe import settings

FAMILIES = ("gemm1_swiglu", "gemm_rows", "dgrad2_swiglu", "wgrad")
"""The kernel families: csrc/<family>.cu each."""


def find_csrc() -> Path:
    """The CUDA sources: ``csrc/`` at the top of a checkout (editable installs, running from
    the tree), else the copy a wheel carries inside the package (setup.py's build_py puts it
    there)."""
    package = Path(__file__).resolve().parents[3]
    for candidate in (package.parent / "csrc", package / "csrc"):
        if (candidate / "include" / "launch_params.h").is_file():
            return candidate
    raise FileNotFoundError(
        f"torchtitan_megamoe: the CUDA sources (csrc/include/launch_params.h) are neither in "
        f"{package.parent / 'csrc'} (a checkout) nor in {package / 'csrc'} (an installed wheel); "
        "reinstall the package, or set MEGAMOE_CUDA=0 to run without the CUDA kernels"
    )


CSRC = find_csrc()
TARGET = "-gencode=arch=compute_90a,code=sm_90a"
"""wgmma and setmaxnreg need the sm_90a target; nvcc 13.0's -arch=sm_90a shorthand also runs a
plain sm_90 pass that rejects them, the -gencode form does not."""


def nvcc_path() -> str | None:
    # every forward asks (through sm90_usable): the PATH search once per environment
    env = os.environ
    return _find_nvcc(env.get("CUDA_HOME"), env.get("CUDA_PATH"), env.get("PATH"))


@functools.lru_cache(maxsize=8)
def _find_nvcc(cuda_home: str | None, cuda_path: str | None, path: str | None) -> str | None:
    home = cuda_home or cuda_path
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc", path=path)


def nvcc_command(source: Path, output: Path, nvcc: str) -> list[str]:
    return [
        nvcc, "-O3", "-std=c++17", TARGET, "-shared", "-Xcompiler", "-fPIC",
        "-Xptxas", "-v", "-o", str(output), str(source),
    ]


def headers() -> list[Path]:
    """Every header a family's source may include (csrc/include/, any depth)."""
    return sorted(p for p in (CSRC / "include").rglob("*") if p.suffix in (".cuh", ".h"))


def _cache_key(source: Path, nvcc: str) -> str:
    h = hashlib.sha256()
    for f in headers() + [source]:
        h.update(str(f.relative_to(CSRC)).encode())
        h.update(f.read_bytes())
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    h.update(version.encode())
    h.update(TARGET.encode())
    return h.hexdigest()[:16]


def build(name: str) -> Path:
    """Path of the shared library built from csrc/<name>.cu (compiled now if not cached)."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError(
            f"building {name}.cu needs nvcc (CUDA toolkit); put it on PATH or set CUDA_HOME, "
            "or use the Triton kernels (MEGAMOE_CUDA=0)"
        )
    source = CSRC / f"{name}.cu"
    cache = settings.cuda_cache()
    out_dir = cache / f"{name}-{_cache_key(source, nvcc)}"
    lib = out_dir / f"lib{name}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():  # another rank built it while this one waited
            return lib
        tmp = out_dir / f"lib{name}.so.{os.getpid()}"
        proc = subprocess.run(nvcc_command(source, tmp, nvcc), capture_output=True, text=True)
        (out_dir / "build.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed on {source}:\n{proc.stderr[-4000:]}")
        os.replace(tmp, lib)
    return lib


@functools.cache
def load(name: str) -> ctypes.CDLL:
    """The ctypes handle of csrc/<name>.cu's library (built on first use)."""
    return ctypes.CDLL(str(build(name)))
