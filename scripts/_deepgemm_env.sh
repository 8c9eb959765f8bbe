# Sourced by scripts/_device_env.sh: the optional DeepGEMM extra on a GPU machine, so that every
# GPU script (tests, bench, training A/Bs) runs the kernels a user with DeepGEMM installed runs.
#
#   dg_setup     DeepGEMM importable from then on, from ignored folders of the checkout carried
#                along: .dgsite/dgsite.tgz (an install packed by an earlier run) or .dgsite/ (an
#                install), else .dgsdist/deepinfer_gemm-2.8.2.tar.gz built with
#                scripts/install_deepgemm.sh into DEEPGEMM_SITE (default /tmp/dgsite, ~2.5 min);
#                .dgjit/ holds its JIT-compiled kernels (DG_JIT_CACHE_DIR, default /tmp/dgjit).
#                SKIP_DEEPGEMM=1: none, and MEGAMOE_DEEPGEMM=0. A build failure runs without it.
#   dg_version   "VERSION PATH" of the importable deep_gemm, or nothing
#   dg_pack_jit  its JIT kernels into $OUT/dgjit.tgz (only when the caller gave $OUT)
# A fresh build comes back as $OUT/dgsite.tgz; keep both for the next run with
#   mkdir -p .dgsite .dgjit && cp dgsite.tgz .dgsite/ && tar -xzf dgjit.tgz -C .dgjit

DG_SDIST=.dgsdist/deepinfer_gemm-2.8.2.tar.gz DG_SITE=${DEEPGEMM_SITE:-/tmp/dgsite}
dg_version() { (cd / && $PY -c 'import deep_gemm; print(deep_gemm.__version__, deep_gemm.__file__)') 2>/dev/null; }
dg_use() {  # $1: an install folder; its env file sets PYTHONPATH, LD_PRELOAD, CUDA_HOME
  local pp=${PYTHONPATH:-} pre=${LD_PRELOAD-unset}
  if [ -f "$1/deepgemm_env.sh" ]; then
    # shellcheck disable=SC1091
    source "$1/deepgemm_env.sh"
  else
    PYTHONPATH="$(cd "$1" && pwd):$PYTHONPATH"
    export PYTHONPATH
  fi
  [ -n "$(dg_version)" ] && return 0
  export PYTHONPATH=$pp
  if [ "$pre" = unset ]; then unset LD_PRELOAD; else export LD_PRELOAD=$pre; fi
  return 1
}
dg_pack() {  # $1 folder, $2 archive name under $OUT, then what in the folder to pack
  local dir=$1 name=$2 size
  shift 2
  [ -n "$OUT_GIVEN" ] || return 0
  tar -C "$dir" --exclude=__pycache__ --exclude='*.pyc' -czf "$OUT/$name" "$@" || { rm -f "$OUT/$name"; return 0; }
  size=$(stat -c %s "$OUT/$name")
  if [ "$size" -ge $((16 << 20)) ]; then
    rm -f "$OUT/$name"
    echo "DeepGEMM: $name would be $((size >> 20)) MiB, over 16 MiB: not kept"
  else
    echo "DeepGEMM: $dir packed into $OUT/$name ($((size >> 10)) KiB)"
  fi
}
dg_setup() {
  if [ "${SKIP_DEEPGEMM:-0}" = 1 ]; then
    export MEGAMOE_DEEPGEMM=${MEGAMOE_DEEPGEMM:-0}
    echo "DeepGEMM: skipped (SKIP_DEEPGEMM=1), MEGAMOE_DEEPGEMM=$MEGAMOE_DEEPGEMM"
    return
  fi
  # a scratch copy: carried folders may be read-only, and the JIT writes beside its entries
  export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/dgjit}
  mkdir -p "$DG_JIT_CACHE_DIR"
  [ -d .dgjit ] && cp -r .dgjit/. "$DG_JIT_CACHE_DIR"/ && chmod -R u+w "$DG_JIT_CACHE_DIR"
  if [ -f .dgsite/dgsite.tgz ]; then  # the build packed (a folder would be too big to carry)
    rm -rf "$DG_SITE" && mkdir -p "$DG_SITE" && tar -xzf .dgsite/dgsite.tgz -C "$DG_SITE"
    dg_use "$DG_SITE" && return
    echo "DeepGEMM: .dgsite/dgsite.tgz does not import here (built for another torch or python?)"
  elif [ -d .dgsite ]; then
    dg_use .dgsite && return
    echo "DeepGEMM: .dgsite/ does not import here (built for another torch or python?)"
  fi
  [ -f "$DG_SITE/deepgemm_env.sh" ] && dg_use "$DG_SITE" && return  # an earlier run on this machine
  [ -f "$DG_SDIST" ] || return 0
  echo "DeepGEMM: building $DG_SDIST into $DG_SITE (log: $OUT/deepgemm_build.log)"
  if PYTHON=$PY timeout "${DEEPGEMM_TIMEOUT_S:-360}" bash scripts/install_deepgemm.sh \
       --target "$DG_SITE" --sdist "$DG_SDIST" > "$OUT/deepgemm_build.log" 2>&1 && dg_use "$DG_SITE"; then
    grep '^export LD_PRELOAD' "$OUT/deepgemm_build.log"
    dg_pack "$DG_SITE" dgsite.tgz .
  else
    echo "DeepGEMM: build failed, running without it; the log's end:"
    tail -15 "$OUT/deepgemm_build.log"
  fi
}
dg_pack_jit() {
  [ "${SKIP_DEEPGEMM:-0}" != 1 ] && [ -d "${DG_JIT_CACHE_DIR:-/nonexistent}/cache" ] && \
    dg_pack "$DG_JIT_CACHE_DIR" dgjit.tgz cache
  return 0
}
