#!/usr/bin/env bash
# Packs GPU test/benchmark binaries from a build tree with the shared libraries they need that a
# bare CUDA machine may lack (absl, gtest, BLAS, ...; not libc, not the CUDA libraries, which the
# GPU machine provides) into one folder, so the binaries can run on a machine that has CUDA but
# not qcal's build dependencies.
# Usage: scripts/gpu-bundle.sh BUILD_DIR OUT_DIR binary...   then, there:
#   LD_LIBRARY_PATH=OUT_DIR/lib:/usr/local/cuda/lib64 OUT_DIR/<binary>
set -euo pipefail
build=$1; out=$2; shift 2
rm -rf "$out"; mkdir -p "$out/lib"
for b in "$@"; do
  path=$(find "$build" -type f -name "$b" -perm -u+x | head -1)
  [ -n "$path" ] || { echo "gpu-bundle: $b not found under $build" >&2; exit 1; }
  cp "$path" "$out/"
  ldd "$path" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libcuda.so*|libcudart*|libcublas*|libcusolver*|libnccl*|libcusparse*|libnvJitLink*|libstdc++*|libgcc_s*) ;;
      *) cp -n "$lib" "$out/lib/" ;;
    esac
  done
done
du -sh "$out"
