#!/usr/bin/env bash
# Installs a CUDA 13.0 toolkit from PyPI wheels into a prefix, for machines without a system CUDA
# (CI, laptops without a GPU). Enough to compile the kernels to PTX and, with --full, to link the
# `cuda` feature's binaries.
#
# Usage:
#   scripts/cuda-toolkit.sh [--full] [PREFIX]      # default PREFIX: $HOME/.cache/candle-splitkv/cuda
#   eval "$(scripts/cuda-toolkit.sh --full)"       # install, then export the printed environment
#
# It prints `export` lines for CUDA_ROOT, PATH, LIBRARY_PATH and CUDA_COMPUTE_CAP on stdout; progress goes
# to stderr. Version 13.0 is pinned on purpose: PTX from a newer nvcc carries a newer ISA version that
# older drivers refuse to load (CUDA_ERROR_UNSUPPORTED_PTX_VERSION).
set -euo pipefail

full=0
prefix="${CANDLE_SPLITKV_CACHE:-$HOME/.cache/candle-splitkv}/cuda"
for arg in "$@"; do
  case "$arg" in
    --full) full=1 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "cuda-toolkit.sh: unknown option $arg (allowed: --full, PREFIX)" >&2; exit 2 ;;
    *) prefix="$arg" ;;
  esac
done

mkdir -p "$prefix"
prefix=$(cd "$prefix" && pwd)
root="$prefix/nvidia/cu13"

compiler="nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85"
libraries="nvidia-cuda-nvrtc==13.0.88 nvidia-curand==10.4.0.35 nvidia-cublas==13.0.2.14"

wanted="$compiler"
[ "$full" = 1 ] && wanted="$wanted $libraries"

missing=0
[ -x "$root/bin/nvcc" ] || missing=1
if [ "$full" = 1 ] && [ ! -e "$root/lib/libcublas.so" ]; then missing=1; fi

if [ "$missing" = 1 ]; then
  echo "cuda-toolkit.sh: installing CUDA 13.0 wheels into $prefix" >&2
  wheels=$(mktemp -d)
  trap 'rm -rf "$wheels"' EXIT
  # shellcheck disable=SC2086
  if ! python3 -m pip download --quiet --no-deps --dest "$wheels" $wanted >&2; then
    echo "cuda-toolkit.sh: pip could not download the CUDA wheels; check python3, pip and network access" >&2
    exit 1
  fi
  for wheel in "$wheels"/*.whl; do
    python3 -m zipfile -e "$wheel" "$prefix" >/dev/null
  done
  chmod +x "$root"/bin/* "$root"/nvvm/bin/* 2>/dev/null || true
  # Wheels ship versioned sonames only; the linker looks for the bare names.
  (cd "$root/lib" && for lib in *.so.[0-9]*; do
     bare="${lib%%.so.*}.so"; [ -e "$bare" ] || ln -s "$lib" "$bare"
   done)
  if [ "$full" = 1 ]; then
    # candle links libcuda dynamically. Machines without a driver have none, so build a link-time stub
    # exporting every driver entry point declared in cuda.h. It is never loaded at run time.
    mkdir -p "$root/lib/stubs"
    echo '#include <cuda.h>' | gcc -E -P -I "$root/include" - \
      | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | sed -E 's/[[:space:]]*\($//' | sort -u \
      | awk '{ print "int " $1 "(void) { return 999; }" }' > "$root/lib/stubs/libcuda_stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/lib/stubs/libcuda.so" "$root/lib/stubs/libcuda_stub.c"
  fi
fi

"$root/bin/nvcc" --version | tail -n 1 >&2
echo "export CUDA_ROOT=\"$root\""
echo "export PATH=\"$root/bin:\$PATH\""
echo "export LIBRARY_PATH=\"$root/lib/stubs:$root/lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}\""
echo "export CUDA_COMPUTE_CAP=\"\${CUDA_COMPUTE_CAP:-90}\""
