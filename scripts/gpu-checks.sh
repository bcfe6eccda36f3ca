#!/usr/bin/env bash
# Every GPU test and benchmark in one run, for a short lease on a GPU machine (docs/getting-started.md).
#   here:  scripts/gpu-checks.sh prepare [BUILD_DIR]   packs .device/bundle.tar.xz (binaries + the
#          shared libraries a bare CUDA machine lacks, Open MPI's plugins for the NCCL test);
#          carry .device/bundle.tar.xz to the GPU machine
#   there: scripts/gpu-checks.sh run [OUT_DIR]         runs the GPU tests, then the benchmarks;
#          logs and gtest XML land in OUT_DIR (default $OUT, else .device/out)
# The run prints one line per step with its exit status and ends non-zero if any test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
bundle=.device/bundle
tests=(kernels_gpu_ops_test kernels_hadamard_cuda_test engine_nccl_comm_test)
benches=(bench_gpu_kernels)
case "$mode" in
  prepare)
    build=${2:-build}
    ninja -C "$build" "${tests[@]}" "${benches[@]}" || exit 1
    bash scripts/gpu-bundle.sh "$build" "$bundle" "${tests[@]}" "${benches[@]}" || exit 1
    mkdir -p "$bundle/ompi"
    cp -r /usr/lib/x86_64-linux-gnu/openmpi /usr/lib/x86_64-linux-gnu/pmix2 "$bundle/ompi/" 2>/dev/null
    # Carried compressed (the device tool's working tree limit is 64 MiB; OpenBLAS alone is 35).
    tar -C .device -cJf .device/bundle.tar.xz bundle && rm -rf "$bundle"
    du -sh .device/bundle.tar.xz
    ;;
  run)
    out=${2:-${OUT:-.device/out}}
    mkdir -p "$out"
    [ -d "$bundle" ] || tar -C .device -xJf .device/bundle.tar.xz || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
    # Open MPI looks for its plugins at the paths it was built with.
    for d in openmpi pmix2; do
      [ -d "/usr/lib/x86_64-linux-gnu/$d" ] || cp -r "$bundle/ompi/$d" /usr/lib/x86_64-linux-gnu/ 2>/dev/null
    done
    export LD_LIBRARY_PATH="$PWD/$bundle/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
    export OMPI_MCA_ess_singleton_isolated=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    failed=0
    for t in "${tests[@]}"; do
      start=$(date +%s.%N)
      timeout 300 "$bundle/$t" --gtest_output="xml:$out/$t.xml" > "$out/$t.log" 2>&1
      rc=$?
      printf '%-30s rc=%d  %.1f s\n' "$t" "$rc" "$(echo "$(date +%s.%N) - $start" | python3 -c "import sys;print(eval(sys.stdin.read()))")"
      grep -E '^\[ +(OK|FAILED|SKIPPED|PASSED|seed|info) ' "$out/$t.log" | head -40
      [ "$rc" = 0 ] || { failed=1; tail -30 "$out/$t.log"; }
    done
    for b in "${benches[@]}"; do
      timeout 400 "$bundle/$b" ${QCAL_BENCH_ARGS:-} 2>&1 | tee "$out/$b.log"
      echo "$b rc=${PIPESTATUS[0]}"
    done
    exit $failed
    ;;
  *) echo "usage: scripts/gpu-checks.sh prepare [BUILD_DIR] | run [OUT_DIR]" >&2; exit 2 ;;
esac
