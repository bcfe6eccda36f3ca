#!/usr/bin/env bash
# qcal built ON a lent GPU machine against that machine's CUDA LibTorch (issue 38, deliverable 2).
#
# The GPU machine has CUDA (nvcc, cuBLAS, cuSOLVER, NCCL), a compiler, CMake, ninja and a python3
# whose torch is a CUDA LibTorch, but none of qcal's other dependencies and no package registry.
# `pack` collects those here, from Debian 12's packages (the ones scripts/install-deps.sh
# installs, less LibTorch, the compilers and the Slurm daemons), unpacked into the prefix
# /tmp/qcal-deps (the same absolute path on both machines, so the pkg-config files and the links
# that name it hold there), with what no build reads (static libraries other than GoogleTest's,
# documentation) left out:
#   here:  scripts/device-build.sh pack          -> .device/deps.tar.xz (carry .device)
#   there: scripts/device-build.sh build [OUT]   unpacks the prefix, configures build-device/
#          against python3's torch (Torch_DIR from torch.utils.cmake_prefix_path), builds every
#          target that `ctest -L gpu` runs with all cores, then qcal, then runs `ctest -L gpu`;
#          one "STEP" line per step with its seconds, logs in OUT (default $OUT, else
#          .device/build-out) as they are written.
#   here:  scripts/device-build.sh check         configures against the packed prefix and
#          Debian's LibTorch, builds one target of each kind, and fails when CMake found a
#          dependency outside the prefix (which the GPU machine would not have).
# Knobs: QCAL_DEVICE_BUILD_DIR (build-device), QCAL_TORCH_DIR (the Torch CMake package; default
# python3's), QCAL_CUDA_ARCH (90: H100/H200), QCAL_BUILD_S (the build's budget, default 420 s).
# The machine stays warm 30 s after a call: a second call soon after rebuilds only what changed
# (ninja, same build directory), which is what ccache would buy on a machine that starts bare.
set -uo pipefail
cd "$(dirname "$0")/.."
P=/tmp/qcal-deps
LIBDIR=$P/usr/lib/x86_64-linux-gnu
# Debian 12 packages: headers and CMake packages, their shared libraries, the tools the build
# runs (protoc, grpc_cpp_plugin, pkgconf, Open MPI's wrappers and mpirun).
DEBS=(
  libabsl-dev libabsl20220623 nlohmann-json3-dev libfmt-dev libfmt9 libspdlog-dev libspdlog1.10
  libyaml-cpp-dev libyaml-cpp0.7 libcli11-dev
  libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3
  pkgconf pkgconf-bin libpkgconf3
  libprotobuf-dev libprotobuf32 libprotobuf-lite32 libprotoc32 protobuf-compiler
  libgrpc++-dev libgrpc-dev libgrpc++1.51 libgrpc29 protobuf-compiler-grpc
  libc-ares-dev libc-ares2 libre2-dev libre2-9 libssl-dev libssl3 zlib1g-dev zlib1g
  libopenmpi-dev libopenmpi3 openmpi-bin openmpi-common libpmix-dev libpmix2 libhwloc-dev
  libhwloc15 libhwloc-plugins libevent-dev libevent-2.1-7 libevent-core-2.1-7
  libevent-pthreads-2.1-7 libevent-extra-2.1-7 libevent-openssl-2.1-7 libfabric1 libucx0
  libibverbs-dev libibverbs1 librdmacm1 libpsm2-2 libpsm-infinipath1 libnl-3-dev libnl-3-200
  libnl-route-3-dev libnl-route-3-200 libnuma-dev libnuma1 libltdl-dev libltdl7 libmunge2
  libxnvctrl0 ocl-icd-libopencl1 libpciaccess0 libbsd0 libmd0
  libopenblas-dev libopenblas-pthread-dev libopenblas0 libopenblas0-pthread liblapack-dev
  liblapack3 libblas-dev libblas3 libgfortran5 libquadmath0
  libgtest-dev libgmock-dev googletest
)

# Environment for configuring, building and running against the prefix.
prefix_env() {
  export PATH=$P/usr/bin:$PATH
  export LD_LIBRARY_PATH=$LIBDIR:$LIBDIR/openmpi/lib:$LIBDIR/openblas-pthread:$P/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  export PKG_CONFIG_PATH=$LIBDIR/pkgconfig:$P/usr/share/pkgconfig
  export OPAL_PREFIX=$P/usr  # Open MPI's wrappers and mpirun find their files under the prefix
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_ess_singleton_isolated=1
}

# configure BUILD_DIR TORCH_DIR CUDA_ARCH: CMake against the prefix (and CUDA, and the given Torch).
# BLAS and LAPACK: OpenBLAS itself, as the CI build finds it (Debian's libblas.so alternatives
# exist only where the packages are installed).
configure() {
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$P/usr" -DTorch_DIR="$2" \
    -DQCAL_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$3" -DCUDAToolkit_ROOT=/usr/local/cuda \
    -DQCAL_BUILD_BENCH=OFF -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
    -DPKG_CONFIG_EXECUTABLE="$P/usr/bin/pkgconf" \
    -DProtobuf_PROTOC_EXECUTABLE="$P/usr/bin/protoc" \
    -DMPI_CXX_COMPILER="$P/usr/bin/mpicxx.openmpi" -DMPIEXEC_EXECUTABLE="$P/usr/bin/mpirun.openmpi" \
    -DBLAS_LIBRARIES="$LIBDIR/openblas-pthread/libopenblas.so" \
    -DLAPACK_LIBRARIES="$LIBDIR/openblas-pthread/libopenblas.so"
}

# The targets `ctest -L gpu` runs, from CTest's own listing (a test is named after its target:
# tests/CMakeLists.txt's qcal_add_test).
gpu_targets() {
  ctest --test-dir "$1" -L gpu --show-only=json-v1 |
    python3 -c 'import json, sys; print(" ".join(sorted(t["name"] for t in json.load(sys.stdin)["tests"])))'
}

elapsed() { python3 -c "import time; print(round(time.time() - $1, 1))"; }

case "${1:-}" in
  pack)
    rm -rf "$P" && mkdir -p "$P" || exit 1
    dl=$(mktemp -d)
    (cd "$dl" && apt-get download "${DEBS[@]}" > download.log 2>&1) ||
      { tail -5 "$dl/download.log"; exit 1; }
    for d in "$dl"/*.deb; do dpkg-deb -x "$d" "$P" || exit 1; done
    echo "device-build: $(ls "$dl"/*.deb | wc -l) packages, $(du -sh "$dl" | cut -f1) of .deb files"
    rm -rf "$dl"
    # What no build reads: static libraries (GoogleTest's are the only ones CMake links), docs.
    find "$P" -name '*.a' ! -name 'libgtest*' ! -name 'libgmock*' -delete
    rm -rf "$P"/usr/share/{doc,man,info,lintian,locale,bug}
    # Open MPI's wrappers and mpirun likewise (mpicxx -> mpicxx.openmpi).
    for tool in mpicxx mpirun mpiexec; do ln -sf "$tool.openmpi" "$P/usr/bin/$tool"; done
    # Links to absolute paths (libz.so -> /lib/...) point into the prefix.
    find "$P" -type l -lname '/*' | while read -r link; do
      target=$(readlink "$link")
      if [ -e "$P$target" ]; then ln -sfn "$P$target" "$link"; fi
    done
    # pkg-config files name /usr: the prefix's instead.
    grep -rlE '(^|[=[:space:]]|-I|-L)/usr(/|$)' "$LIBDIR/pkgconfig" "$P/usr/share/pkgconfig" 2>/dev/null |
      xargs -r sed -i -E "s#(^|[=[:space:]]|-I|-L)/usr(/|$)#\1$P/usr\2#g"
    mkdir -p .device
    tar -C /tmp -cf - qcal-deps | xz -T0 -6 > .device/deps.tar.xz || exit 1
    echo "device-build: prefix $(du -sh "$P" | cut -f1) -> .device/deps.tar.xz $(du -h .device/deps.tar.xz | cut -f1)"
    ;;

  check)
    # Here: does the prefix hold everything? Configure against it with Debian's LibTorch (the
    # GPU machine's comes from python3 there), build one target of each kind, and list what CMake
    # took from outside the prefix.
    [ -d "$P" ] || tar -C /tmp -xJf .device/deps.tar.xz || exit 1
    prefix_env
    b=${QCAL_DEVICE_BUILD_DIR:-/tmp/qcal-device-check}
    rm -rf "$b"
    torch_dir=${QCAL_TORCH_DIR:-/usr/lib/x86_64-linux-gnu/cmake/Torch}
    configure "$b" "$torch_dir" "${QCAL_CUDA_ARCH:-90}" > /tmp/qcal-device-check.log 2>&1 ||
      { tail -30 /tmp/qcal-device-check.log; exit 1; }
    # Paths CMake resolved for the prefix's packages: each must lie in the prefix.
    outside=$(grep -E '^(absl|fmt|spdlog|yaml-cpp|nlohmann_json|CLI11|gRPC|GTest|protobuf|c-ares|re2)_DIR|^Protobuf_(INCLUDE_DIR|LIBRARY|PROTOC_EXECUTABLE)|^MPI_CXX_(COMPILER|HEADER_DIR)|^MPI_mpi(_cxx)?_LIBRARY|^PCRE2_|^PKG_CONFIG_EXECUTABLE|^pkgcfg_lib_PCRE2' \
        "$b/CMakeCache.txt" | grep -v "$P" | grep -vE '=$|NOTFOUND|=(-|[0-9])|PCRE2_(CFLAGS|LDFLAGS|STATIC|FOUND|VERSION|MODULE|PREFIX|LIBRARIES|LINK|INCLUDEDIR|LIBDIR|LIBRARY_DIRS|INCLUDE_DIRS)' )
    grep -E "^(gRPC_DIR|absl_DIR|Protobuf_LIBRARY|MPI_CXX_COMPILER|pkgcfg_lib_PCRE2_pcre2-8)" "$b/CMakeCache.txt"
    if [ -n "$outside" ]; then echo "device-build: found outside $P:"; echo "$outside"; exit 1; fi
    echo "device-build: the GPU tests to build: $(gpu_targets "$b")"
    # One target per kind of dependency: protobuf/gRPC (qcal_rpc), yaml-cpp (qcal_recipe),
    # spdlog/fmt/absl/PCRE2 (qcal_common), BLAS/LAPACK (qcal_kernels), CUDA and GoogleTest
    # (kernels_gpu_ops_test), MPI and NCCL (engine_nccl_comm_test).
    built="qcal_rpc qcal_recipe qcal_common qcal_kernels kernels_gpu_ops_test engine_nccl_comm_test"
    start=$(date +%s.%N)
    ninja -C "$b" $built > /tmp/qcal-device-check-build.log 2>&1 ||
      { tail -30 /tmp/qcal-device-check-build.log; exit 1; }
    # A header the compiler took from /usr/include rather than the prefix would be missing there:
    # only the C library's may come from there.
    stray=$(ninja -C "$b" -t deps | awk '$1 ~ /^\/usr\/include\// {print $1}' | sort -u |
      grep -vE '^/usr/include/(c\+\+|x86_64-linux-gnu|linux|asm-generic)/|^/usr/include/[^/]+\.h$' || true)
    stray_h=$(ninja -C "$b" -t deps | awk '$1 ~ /^\/usr\/include\/[^\/]+\.h$/ {print $1}' | sort -u |
      grep -E '/(pcre2|zlib|zconf|cblas|lapacke?|mpi|openblas_config|yaml|ares|re2|nccl)[^/]*\.h$' || true)
    if [ -n "$stray$stray_h" ]; then echo "device-build: headers from /usr/include:"; echo "$stray$stray_h"; exit 1; fi
    echo "device-build: configured, and built $built against the prefix in $(elapsed "$start") s; every header outside the C library's came from the prefix, CUDA or LibTorch"
    ;;

  build)
    out=${2:-${OUT:-.device/build-out}}
    mkdir -p "$out"
    b=${QCAL_DEVICE_BUILD_DIR:-build-device}
    total=$(date +%s.%N)
    if [ ! -d "$P" ]; then
      tar -C /tmp -xJf .device/deps.tar.xz || { echo "STEP unpack: failed"; exit 1; }
    fi
    prefix_env
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nvcc --version | tail -2;
      g++ --version | head -1; cmake --version | head -1; } > "$out/machine.txt" 2>&1
    cat "$out/machine.txt"
    torch_dir=${QCAL_TORCH_DIR:-$(python3 -c 'import os, torch; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))')}
    echo "torch: $(python3 -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>&1) at $torch_dir" | tee -a "$out/machine.txt"
    start=$(date +%s.%N)
    if [ ! -f "$b/build.ninja" ]; then
      configure "$b" "$torch_dir" "${QCAL_CUDA_ARCH:-90}" > "$out/configure.log" 2>&1
      rc=$?
      echo "STEP configure: rc=$rc $(elapsed "$start") s"
      [ $rc = 0 ] || { tail -40 "$out/configure.log"; exit 1; }
    fi
    targets=$(gpu_targets "$b")
    start=$(date +%s.%N)
    budget=${QCAL_BUILD_S:-420}
    timeout "$budget" ninja -C "$b" -j "$(nproc)" $targets > "$out/build-tests.log" 2>&1
    rc=$?
    echo "STEP build $targets: rc=$rc $(elapsed "$start") s"
    [ $rc = 0 ] || { grep -E 'error|FAILED' "$out/build-tests.log" | head -30; tail -5 "$out/build-tests.log"; }
    left=$(python3 -c "import time; print(max(10, int($budget - (time.time() - $start))))")
    start=$(date +%s.%N)
    timeout "$left" ninja -C "$b" -j "$(nproc)" qcal > "$out/build-qcal.log" 2>&1
    echo "STEP build qcal: rc=$? $(elapsed "$start") s"
    start=$(date +%s.%N)
    ctest --test-dir "$b" -L gpu --output-on-failure --timeout 300 --output-junit "$PWD/$out/ctest-gpu.xml" \
      > "$out/ctest-gpu.log" 2>&1
    rc=$?
    echo "STEP ctest -L gpu: rc=$rc $(elapsed "$start") s"
    grep -E 'tests passed|Passed|Failed|\*\*\*|Skipped|Not Run' "$out/ctest-gpu.log" | head -30
    echo "STEP device-build total: $(elapsed "$total") s"
    exit $rc
    ;;

  *) echo "usage: scripts/device-build.sh pack | check | build [OUT_DIR]" >&2; exit 2 ;;
esac
