#!/usr/bin/env bash
# Installs the optional DeepGEMM extra (PyPI sdist deepinfer-gemm 2.8.2, Python package deep_gemm)
# into the current python, or into a folder with --target. It builds from source: one C++ file
# compiled against the installed CUDA torch; DeepGEMM's kernels are compiled by nvcc at first call.
#
#   bash scripts/install_deepgemm.sh [--target DIR] [--sdist PATH] [--check-only]
#
#   --target DIR   install into DIR (not the current environment); the env file puts it on PYTHONPATH
#   --sdist PATH   build this local deepinfer_gemm-2.8.2.tar.gz, offline (default: from PyPI)
#   --check-only   run the checks and print the pip command; install nothing
#
# Needs: a CUDA build of torch; nvcc >= 12.9 of torch's CUDA major version (CUDA_HOME, CUDA_PATH,
# nvcc on PATH, or /usr/local/cuda); g++ >= 13 for C++20 <format> (CXX, else the first of g++,
# g++-15, g++-14, g++-13 that has it); setuptools, wheel and packaging importable (the build runs
# without isolation, against the installed torch). elfutils/libdwfl.h (Debian: libdw-dev) is used
# when present, else a declaration-only stub: DeepGEMM only dlopens libdw, for stack traces.
# Writes deepgemm_env.sh beside the installed package; `source` it (bash) before python:
# PYTHONPATH (with --target), CUDA_HOME, LD_PRELOAD, DG_JIT_CACHE_DIR (kernel cache, default ~/.dj).
# Env: PYTHON (default python3), CXX, CUDA_HOME, TORCH_CUDA_ARCH_LIST (default 9.0: Hopper).
set -uo pipefail

PY=${PYTHON:-python3}
# a relative path must survive the cd of the import check (and no symlink resolved: a venv's is one)
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac
SPEC="deepinfer-gemm==2.8.2"
TARGET="" SDIST="" CHECK_ONLY=0
while [ $# -gt 0 ]; do
  case $1 in
    --target) TARGET=${2:?--target needs a folder}; shift 2 ;;
    --sdist) SDIST=${2:?--sdist needs a file}; shift 2 ;;
    --check-only) CHECK_ONLY=1; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "install_deepgemm: unknown argument '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done

errors=0
fail() { echo "install_deepgemm: error: $*" >&2; errors=$((errors + 1)); }
say() { echo "install_deepgemm: $*"; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# --- python and torch: one run answers every question about the interpreter
probe=$("$PY" - 2>&1 <<'EOF'
import os, sys, sysconfig
print("python", sys.version.split()[0])
try:
    import torch
except Exception as e:
    print("torch none", type(e).__name__)
    sys.exit()
print("torch", torch.__version__)
print("torch_cuda", torch.version.cuda or "none")
try:  # setup.py's own imports, in its order (setuptools makes its vendored wheel importable)
    import setuptools, wheel.bdist_wheel, packaging.version
    print("build_deps ok")
except Exception as e:
    print("build_deps", f"{type(e).__name__}: {e}")
maps = [l.split()[-1] for l in open("/proc/self/maps") if "/libstdc++.so" in l]
print("libstdcxx", os.path.realpath(maps[0]) if maps else "none")
try:
    import nvidia
    print("nvidia", *nvidia.__path__)
except Exception:
    print("nvidia")
EOF
) || { echo "$probe" >&2; fail "could not run $PY (set PYTHON to the python that has torch)"; }
pv() { sed -n "s/^$1 //p" <<<"$probe" | head -1; }
torch_v=$(pv torch) torch_cuda=$(pv torch_cuda)
if [ -z "$torch_v" ] || [ "${torch_v%% *}" = none ]; then
  fail "no torch in $PY: install a CUDA build of torch first (DeepGEMM compiles against it)"
elif [ "$torch_cuda" = none ]; then
  fail "torch $torch_v in $PY is a CPU-only build: DeepGEMM needs a CUDA build of torch" \
       "(on Linux x86_64, PyPI's plain 'pip install torch' is one)"
else
  [ "$(pv build_deps)" = ok ] || fail "setup.py's build imports fail in $PY ($(pv build_deps)):" \
    "pip install setuptools wheel packaging (the build runs without isolation)"
fi

# --- nvcc >= 12.9: the build links cudart from it, and the JIT compiles every kernel with it
cuda_home=${CUDA_HOME:-${CUDA_PATH:-}}
if [ -z "$cuda_home" ] && command -v nvcc >/dev/null 2>&1; then
  # nvcc on PATH may be a wrapper script: the real one names its own bin/ in a dry run
  bin=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -1)
  cuda_home=$(dirname "${bin:-$(dirname "$(readlink -f "$(command -v nvcc)")")}")
fi
[ -z "$cuda_home" ] && [ -x /usr/local/cuda/bin/nvcc ] && cuda_home=/usr/local/cuda
nvcc_v=""
if [ -z "$cuda_home" ]; then
  fail "no nvcc (CUDA_HOME unset, none on PATH, no /usr/local/cuda): DeepGEMM compiles its" \
       "kernels with nvcc >= 12.9; install the CUDA toolkit and set CUDA_HOME to it"
elif [ ! -x "$cuda_home/bin/nvcc" ]; then
  fail "CUDA_HOME=$cuda_home has no bin/nvcc: set CUDA_HOME to a CUDA toolkit >= 12.9"
else
  nvcc_v=$("$cuda_home/bin/nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p' | head -1)
  major=${nvcc_v%%.*} minor=${nvcc_v#*.}
  if [ -z "$nvcc_v" ] || [ "$major" -lt 12 ] || { [ "$major" = 12 ] && [ "$minor" -lt 9 ]; }; then
    fail "nvcc ${nvcc_v:-of unknown version} in $cuda_home is older than 12.9, which DeepGEMM's" \
         "JIT needs: install CUDA toolkit >= 12.9 and set CUDA_HOME to it"
  elif [ -n "$torch_cuda" ] && [ "$torch_cuda" != none ] && [ "${torch_cuda%%.*}" != "$major" ]; then
    fail "nvcc $nvcc_v vs torch built for CUDA $torch_cuda: torch's extension build refuses" \
         "another major version; set CUDA_HOME to a CUDA ${torch_cuda%%.*}.x toolkit (>= 12.9)" \
         "or install a torch built for CUDA $major"
  fi
  [ -f "$cuda_home/include/cuda_runtime.h" ] || \
    fail "$cuda_home has no include/cuda_runtime.h: install the full CUDA toolkit (headers too)"
fi

# --- a C++20 compiler with <format>, which DeepGEMM's C++ uses throughout
has_format() {
  printf '#include <format>\nauto s = std::format("{}", 1);\n' \
    | "$1" -std=c++20 -fsyntax-only -x c++ - >/dev/null 2>&1
}
cxx="" tried=()
for c in ${CXX:-} g++ g++-15 g++-14 g++-13; do
  command -v "$c" >/dev/null 2>&1 || continue
  if has_format "$c"; then cxx=$c; break; fi
  tried+=("$c $("$c" -dumpfullversion -dumpversion 2>/dev/null | head -1)")
done
if [ -z "$cxx" ]; then
  list=$(IFS=,; echo "${tried[*]:-none found}")
  fail "no C++ compiler with C++20 <format> (tried: ${list//,/, }): DeepGEMM needs g++ >= 13;" \
       "install one (Debian/Ubuntu: apt-get install g++-13) or set CXX to it"
else
  say "C++ compiler: $cxx $("$cxx" -dumpfullversion -dumpversion 2>/dev/null | head -1)"
  # DeepJIT's headers include it for stack traces and dlopen libdw.so.1 at run time (optional)
  has_dwfl() { printf '#include <elfutils/libdwfl.h>\n' | "$cxx" -fsyntax-only -x c++ - >/dev/null 2>&1; }
  if ! has_dwfl; then
    mkdir -p "$TMP/include/elfutils"
    # declarations only, with elfutils' public signatures: nothing links against them
    cat > "$TMP/include/elfutils/libdwfl.h" <<'STUB'
#pragma once
#include <stdint.h>
#include <sys/types.h>
#ifdef __cplusplus
extern "C" {
#endif
typedef uint64_t Dwarf_Addr, Dwarf_Word, GElf_Addr;
typedef uint32_t GElf_Word;
typedef struct Elf Elf;
typedef struct GElf_Shdr GElf_Shdr;
typedef struct Dwfl Dwfl;
typedef struct Dwfl_Module Dwfl_Module;
typedef struct Dwfl_Line Dwfl_Line;
typedef struct {
  int (*find_elf)(Dwfl_Module *, void **, const char *, Dwarf_Addr, char **, Elf **);
  int (*find_debuginfo)(Dwfl_Module *, void **, const char *, Dwarf_Addr, const char *,
                        const char *, GElf_Word, char **);
  int (*section_address)(Dwfl_Module *, void **, const char *, Dwarf_Addr, const char *,
                         GElf_Word, const GElf_Shdr *, Dwarf_Addr *);
  char **debuginfo_path;
} Dwfl_Callbacks;
Dwfl *dwfl_begin(const Dwfl_Callbacks *);
int dwfl_linux_proc_report(Dwfl *, pid_t);
int dwfl_report_end(Dwfl *, int (*)(Dwfl_Module *, void *, const char *, Dwarf_Addr, void *), void *);
Dwfl_Module *dwfl_addrmodule(Dwfl *, Dwarf_Addr);
const char *dwfl_module_addrname(Dwfl_Module *, GElf_Addr);
Dwfl_Line *dwfl_module_getsrc(Dwfl_Module *, Dwarf_Addr);
const char *dwfl_lineinfo(Dwfl_Line *, Dwarf_Addr *, int *, int *, Dwarf_Word *, Dwarf_Word *);
int dwfl_linux_proc_find_elf(Dwfl_Module *, void **, const char *, Dwarf_Addr, char **, Elf **);
#ifdef __cplusplus
}
#endif
STUB
    export CPLUS_INCLUDE_PATH="$TMP/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
    if has_dwfl; then
      say "no elfutils/libdwfl.h (Debian: libdw-dev): building with a declaration-only stub"
    else
      fail "elfutils/libdwfl.h: neither installed nor the stub compiles with $cxx;" \
           "install libdw-dev (Debian/Ubuntu) or elfutils-devel (Fedora)"
    fi
  fi
fi

# --- the CUDA libraries' headers that ATen/cuda pulls in: a runtime-only CUDA install may lack them
if [ -n "$cxx" ] && [ -n "$nvcc_v" ]; then
  for h in cublasLt.h cusparse.h cusolverDn.h; do
    [ -f "$cuda_home/include/$h" ] && continue
    # pip's nvidia-* wheels (torch's dependencies) carry them
    read -ra nv <<<"$(pv nvidia)"
    found=""
    [ ${#nv[@]} -gt 0 ] && found=$(find "${nv[@]}" -path '*/include/*' -name "$h" 2>/dev/null | head -1)
    if [ -n "$found" ]; then
      inc=$(dirname "$found")
      export CPLUS_INCLUDE_PATH="$inc${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
    else
      fail "no $h in $cuda_home/include nor in pip's nvidia packages: install the CUDA toolkit's" \
           "math library headers (e.g. the cuda-libraries-dev package)"
    fi
  done
fi

# --- the source, and where it goes
if [ -n "$SDIST" ]; then
  if [ -f "$SDIST" ]; then SDIST=$(readlink -f "$SDIST"); else fail "no sdist at $SDIST"; fi
fi
[ -n "$TARGET" ] && TARGET=$(realpath -m "$TARGET")

# --- the libstdc++ to preload: the JIT's start-up crashed in std::regex until the compiler's own was
libstdcxx=""
if [ -n "$cxx" ]; then
  libstdcxx=$(readlink -f "$("$cxx" -print-file-name=libstdc++.so.6)" 2>/dev/null)
  [ -f "$libstdcxx" ] || libstdcxx=""
fi
loaded=$(pv libstdcxx)
preload_hint=""
if [ -n "$libstdcxx" ] && [ "$loaded" != none ] && [ -n "$loaded" ] && [ "$loaded" != "$libstdcxx" ]; then
  preload_hint="export LD_PRELOAD=$libstdcxx  # DeepGEMM: python loads $loaded; its JIT needs $cxx's"
fi

if [ "$errors" -gt 0 ]; then
  echo "install_deepgemm: $errors problem(s) above; nothing installed" >&2
  exit 1
fi

export CUDA_HOME=$cuda_home PATH="$cuda_home/bin:$PATH"
# CXX for torch's ninja build, CC/LDSHARED for setuptools' own compile and link steps
export CXX=$cxx CC=$cxx LDSHARED="$cxx -shared"
# without DG_FORCE_BUILD setup.py tries to download a prebuilt wheel; DG_PACKAGE_NAME keeps the
# metadata's name the sdist's (pip checks it)
export DG_FORCE_BUILD=1 DG_PACKAGE_NAME=deepinfer_gemm TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
# setup.py bakes these into the package's defaults when they are set at build time
unset DG_JIT_CACHE_DIR DG_JIT_PRINT_COMPILER_COMMAND DG_JIT_CPP_STANDARD
pip_cmd=("$PY" -m pip install --no-build-isolation --no-deps --no-cache-dir --force-reinstall
         --disable-pip-version-check)
if [ -n "$SDIST" ]; then pip_cmd+=(--no-index "$SDIST"); else pip_cmd+=("$SPEC"); fi
if [ -n "$TARGET" ]; then pip_cmd+=(--target "$TARGET" --upgrade); fi

say "torch $torch_v (CUDA $torch_cuda), nvcc $nvcc_v in $cuda_home"
[ -n "$preload_hint" ] && echo "$preload_hint"
if [ "$CHECK_ONLY" = 1 ]; then
  say "checks passed; would run: DG_FORCE_BUILD=1 DG_PACKAGE_NAME=deepinfer_gemm" \
      "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST CXX=$CXX ${pip_cmd[*]}"
  exit 0
fi

say "building ${SDIST:-$SPEC} (one C++ file, a few minutes)"
"${pip_cmd[@]}" || { echo "install_deepgemm: the build failed (pip's output above)" >&2; exit 1; }

# --- check it imports from elsewhere, and write the env file beside the package
preload=${libstdcxx:+$libstdcxx${LD_PRELOAD:+:$LD_PRELOAD}}
site=$(cd / && PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" LD_PRELOAD=${preload:-${LD_PRELOAD:-}} \
       "$PY" -c 'import deep_gemm, os; print(os.path.dirname(os.path.dirname(deep_gemm.__file__)))' \
       | tail -1)
if [ ! -d "$site" ]; then
  echo "install_deepgemm: error: installed, but 'import deep_gemm' fails (above)" >&2
  exit 1
fi
env_file=$site/deepgemm_env.sh
# shellcheck disable=SC2016  # the env file expands these when it is sourced
{
  echo "# DeepGEMM's run-time environment, from scripts/install_deepgemm.sh: source it (bash)."
  if [ -n "$TARGET" ]; then
    echo "# The installed folder is where this file is, so the folder can move (e.g. into .dgsite/)."
    echo '_dg=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)'
    echo 'case ":${PYTHONPATH:-}:" in *":$_dg:"*) ;; *) export PYTHONPATH="$_dg${PYTHONPATH:+:$PYTHONPATH}" ;; esac'
  fi
  echo "export CUDA_HOME=\${CUDA_HOME:-$cuda_home}"
  echo "# the JIT compiles each kernel at its first call and keeps it here"
  echo 'export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-$HOME/.dj}'
  if [ -n "$libstdcxx" ]; then
    echo "# the JIT's start-up crashed in std::regex unless the compiler's libstdc++ was loaded first"
    echo "_dgl=$libstdcxx"
    echo 'if [ -f "$_dgl" ]; then case ":${LD_PRELOAD:-}:" in *":$_dgl:"*) ;;'
    echo '  *) export LD_PRELOAD="$_dgl${LD_PRELOAD:+:$LD_PRELOAD}" ;; esac; fi'
  fi
  echo 'unset _dg _dgl'
} > "$env_file"
say "installed deep_gemm into $site"
[ -n "$preload_hint" ] && echo "$preload_hint"
say "its environment (PYTHONPATH, LD_PRELOAD, DG_JIT_CACHE_DIR): source $env_file"
