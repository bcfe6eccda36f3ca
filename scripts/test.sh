#!/usr/bin/env bash
# Newcomer command (b): install every dependency, build, and pass all tests.
#   bash scripts/test.sh
# Runs the whole ctest suite (GPU tests report SKIPPED without a device), then the safetensors
# header fuzzer for QCAL_FUZZ_SECONDS (default 60).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
BUILD_DIR=${QCAL_BUILD_DIR:-build}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${QCAL_TEST_JOBS:-2}"
bash scripts/fuzz-safetensors.sh "${QCAL_FUZZ_SECONDS:-60}"
