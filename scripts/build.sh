#!/usr/bin/env bash
# Configures and builds qcal into ./build (Release with debug info, Ninja, ccache when present).
# Usage: scripts/build.sh [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${QCAL_BUILD_DIR:-build}
JOBS=${QCAL_JOBS:-$(nproc)}
if [ ! -f "$BUILD_DIR/build.ninja" ] || [ $# -gt 0 ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
fi
cmake --build "$BUILD_DIR" -j "$JOBS"
