#!/usr/bin/env bash
# Newcomer command (b): install every dependency, build, and pass all tests.
#   bash scripts/test.sh
# Runs the safetensors header fuzzer for QCAL_FUZZ_SECONDS (default 60), then the whole ctest
# suite (GPU tests report SKIPPED without a device), whose summary is the last thing printed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
bash scripts/fuzz-safetensors.sh "${QCAL_FUZZ_SECONDS:-60}"
BUILD_DIR=${QCAL_BUILD_DIR:-build}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${QCAL_TEST_JOBS:-2}"
