#!/usr/bin/env bash
# Newcomer command (b): install every dependency, build, and pass all tests.
#   bash scripts/test.sh
# Runs each libFuzzer target (safetensors, config.json, recipes, tokenizer files, the journal;
# scripts/fuzz.sh) for QCAL_FUZZ_SECONDS (default 30), then the whole ctest suite (GPU tests
# report SKIPPED without a device), whose summary is the last thing printed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
bash scripts/fuzz.sh "${QCAL_FUZZ_SECONDS:-30}"
BUILD_DIR=${QCAL_BUILD_DIR:-build}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${QCAL_TEST_JOBS:-2}"
