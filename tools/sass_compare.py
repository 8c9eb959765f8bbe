"""Compare the SASS of the CUDA kernels in csrc/ against those of another commit.

    python -m tools.sass_compare --base <rev> [--jobs 2] [--show-diff N]
        [--added-arg KERNEL=V | --removed-arg KERNEL=V]

Needs nvcc (no GPU): every csrc/*.cu of the working tree and of ``--base`` (read with ``git
show``, built in a scratch directory) is compiled to an sm_90a cubin with the JIT build's flags
(ops/hopper/cuda/build.py) and disassembled with cuobjdump (from the CUDA toolkit, else the copy
Triton ships). Kernels are matched by name and template arguments (every integer and bool one),
ignoring namespaces and parameter type names (they are renamed freely); ``--added-arg
KERNEL=V``: a template parameter appended to KERNEL since ``--base``, whose value V the base's
instances had (e.g. fp8_gemm_kernel=1); ``--removed-arg KERNEL=V``: the reverse, the last
template parameter of KERNEL in ``--base`` is gone from the working tree: the base's instances
with V there are compared with the working tree's without it, and those with another value are
listed as removed (not counted as differences); each pair's instructions are compared after
dropping addresses and encodings (branch targets are function-relative, so equal code has equal
targets). Prints, per kernel: "identical", "registers renumbered" (the same
instruction sequence with other register numbers), or the number of differing instructions;
and the registers / spill bytes ptxas reported on both sides. Exit status 1 when any kernel
differs beyond register numbering or exists on one side only.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from torchtitan_megamoe.ops.hopper.cuda.build import TARGET, nvcc_path  # noqa: E402

# readable names of the kernels (kernel identifier, template argument) -> family / mode
NAMES = {
    ("grouped_gemm_kernel", "0"): "bf16 gemm1_swiglu",
    ("grouped_gemm_kernel", "1"): "bf16 gemm_rows",
    ("grouped_gemm_kernel", "2"): "bf16 gemm_rows (N-major, dgrad1)",
    ("grouped_gemm_kernel", "3"): "bf16 wgrad (gather A: dw2)",
    ("grouped_gemm_kernel", "4"): "bf16 wgrad (gather B: dw13)",
    ("grouped_gemm_kernel", "5"): "bf16 wgrad (pre-gathered)",
    ("grouped_gemm_kernel", "6"): "bf16 dgrad2_swiglu",
    ("fp8_gemm_kernel", "0"): "fp8 gemm_rows",
    ("fp8_gemm_kernel", "1"): "fp8 gemm1_swiglu",
    ("fp8_gemm_kernel", "2"): "fp8 dgrad2_swiglu",
    ("fp8_gemm_kernel", "3"): "fp8 dgrad2_swiglu rows",
    ("fp8_wgrad_kernel", ""): "fp8 wgrad",
}


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    nvcc = nvcc_path()
    if found is None and nvcc is not None:
        candidate = Path(nvcc).resolve().parent / "cuobjdump"
        found = str(candidate) if candidate.exists() else None
    if found is None:
        import triton

        candidate = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        found = str(candidate) if candidate.exists() else None
    if found is None:
        raise SystemExit("cuobjdump not found (CUDA toolkit, or the one Triton ships)")
    return found


def kernel_key(mangled: str) -> tuple[str, str]:
    """(the kernel's identifier, its integer and bool template arguments joined by commas, or
    ''): the last name of the mangled nested name, without its namespaces."""
    if not mangled.startswith("_ZN"):
        return (mangled, "")
    i, last = 3, mangled
    while i < len(mangled) and mangled[i].isdigit():
        j = i
        while mangled[j].isdigit():
            j += 1
        n = int(mangled[i:j])
        last, i = mangled[j:j + n], j + n
    m = re.match(r"I((?:L[a-z]+\d+E)+)E", mangled[i:])
    return (last, ",".join(re.findall(r"L[a-z]+(\d+)E", m.group(1))) if m else "")


def label(key: tuple[str, str]) -> str:
    """The family / mode name of NAMES (by the first template argument), the others after it."""
    first, _, rest = key[1].partition(",")
    name = NAMES.get((key[0], first), f"{key[0]}<{first}>")
    return f"{name} <{rest}>" if rest else name


def rekey(old: dict, added: str | None = None, removed: str | None = None) -> tuple[dict, list]:
    """The base's kernels under the working tree's keys, and the base's keys that have none:
    ``added`` KERNEL=V appends V to KERNEL's arguments; ``removed`` KERNEL=V drops KERNEL's last
    argument where it is V (the instances where it is not V have no counterpart)."""
    gone = []
    if added:
        kernel, _, value = added.partition("=")
        old = {(k, f"{a},{value}" if k == kernel else a): v for (k, a), v in old.items()}
    if removed:
        kernel, _, value = removed.partition("=")
        kept = {}
        for (k, a), v in old.items():
            head, _, last = a.rpartition(",")
            if k != kernel:
                kept[(k, a)] = v
            elif last == value:
                kept[(k, head)] = v
            else:
                gone.append((k, a))
        old = kept
    return old, gone


def compile_tree(csrc: Path, out: Path, jobs: int) -> dict:
    """{kernel key: (normalized instructions, 'R regs, S spill bytes')} of every csrc/*.cu."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise SystemExit("needs nvcc")
    sources = sorted(csrc.glob("*.cu"))

    def one(src: Path):
        cubin = out / f"{src.stem}.cubin"
        cmd = [nvcc, "-O3", "-std=c++17", TARGET, "-cubin", "-Xptxas", "-v", "-o", str(cubin),
               str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"nvcc failed on {src}:\n{done.stderr[-4000:]}")
        return cubin, done.stdout + done.stderr

    with ThreadPoolExecutor(jobs) as pool:
        built = list(pool.map(one, sources))
    kernels = {}
    tool = cuobjdump()
    for cubin, log in built:
        props = {}
        current = None
        for line in log.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", line)
            if m:
                current = m.group(1)
                props[current] = {}
            m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
            if m and current:
                props[current]["spill"] = f"{m.group(1)}/{m.group(2)}"
            m = re.search(r"Used (\d+) registers", line)
            if m and current:
                props[current]["regs"] = m.group(1)
        sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        for block in re.split(r"\n\s*Function : ", sass)[1:]:
            name, _, body = block.partition("\n")
            name = name.strip()
            code = []
            for line in body.splitlines():
                m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;?\s*/\*", line)
                if m:
                    code.append(re.sub(r"\s+", " ", m.group(1)))
            p = props.get(name, {})
            stats = f"{p.get('regs', '?')} regs, spill st/ld {p.get('spill', '?')}"
            kernels[kernel_key(name)] = (code, stats)
    return kernels


REGISTER = re.compile(r"\b(U?R|U?P|B)(\d+)\b")


def renumbered(code: list[str]) -> list[str]:
    """The instructions with every register (R, UR, P, UP, B) renamed in order of first use, and
    branch targets dropped: equal when two kernels differ only in register numbering."""
    names: dict[str, str] = {}

    def rename(m):
        reg = m.group(0)
        if reg not in names:
            names[reg] = f"{m.group(1)}#{sum(1 for k in names if k.startswith(m.group(1)))}"
        return names[reg]

    return [re.sub(r"0x[0-9a-f]+$", "", REGISTER.sub(rename, line)) for line in code]


def base_csrc(rev: str, into: Path) -> Path:
    """csrc/ of commit ``rev`` (with subfolders) written under ``into``."""
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "csrc"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        dst = into / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(subprocess.run(["git", "show", f"{rev}:{name}"], cwd=REPO,
                                       capture_output=True, check=True).stdout)
    return into / "csrc"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare against (git rev)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="parallel nvcc runs (default: the CPU count)")
    ap.add_argument("--added-arg", metavar="KERNEL=V",
                    help="a template parameter appended to KERNEL since --base: V in the base")
    ap.add_argument("--removed-arg", metavar="KERNEL=V",
                    help="KERNEL's last template parameter in --base, gone since: the base's "
                         "instances with V compared, the others listed as removed")
    ap.add_argument("--show-diff", type=int, default=0, metavar="N",
                    help="print the first N lines of each differing kernel's diff (default 0)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "base").mkdir()
        (tmp / "new").mkdir()
        old = compile_tree(base_csrc(args.base, tmp / "src"), tmp / "base", args.jobs)
        new = compile_tree(REPO / "csrc", tmp / "new", args.jobs)
    # the base's instances under the working tree's keys
    old, gone = rekey(old, args.added_arg, args.removed_arg)
    differ = 0
    print(f"{'kernel':36} {'SASS':22} {args.base + ' (base)':28} working tree")
    for key in sorted(gone, key=label):
        print(f"{label(key):36} removed with its last template argument (--removed-arg)")
    for key in sorted(set(old) | set(new), key=label):
        name = label(key)
        if key not in old or key not in new:
            differ += 1
            side = "base" if key in old else "working tree"
            print(f"{name:36} only in the {side}")
            continue
        (a, sa), (b, sb) = old[key], new[key]
        if a == b:
            verdict = f"identical ({len(a)} instr)"
        elif renumbered(a) == renumbered(b):
            verdict = "registers renumbered"
        else:
            differ += 1
            changed = sum(1 for op in difflib.ndiff(a, b) if op[:1] in "+-")
            verdict = f"DIFFERS ({changed} of {len(a)}/{len(b)})"
        print(f"{name:36} {verdict:22} {sa:28} {sb}")
        if a != b and args.show_diff:
            diff = list(difflib.unified_diff(a, b, "base", "new", lineterm="", n=1))
            print("\n".join(diff[: args.show_diff]))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
