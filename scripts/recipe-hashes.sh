#!/usr/bin/env bash
# Quantizes stories260K with every recipe in jobs/ (single process, `qcal quantize`) and prints
# the sha256 of every output file, one line per file: "<recipe> <file> <sha256>". Used to show
# that a refactoring leaves every checkpoint byte-identical (diff two runs' outputs).
#   bash scripts/recipe-hashes.sh [OUT_DIR] [RECIPE ...]      (after scripts/build.sh)
# OUT_DIR defaults to a fresh temporary directory; RECIPE names (stems of jobs/*.yaml) default to
# every recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${QCAL_SHARED_DIR:-../shared}
Q=${QCAL_BIN:-build/client/qcal}
OUT=${1:-$(mktemp -d /tmp/qcal-hashes.XXXXXX)}
shift || true
mkdir -p "$OUT"
recipes=("$@")
if [ ${#recipes[@]} -eq 0 ]; then
  for f in jobs/*.yaml; do recipes+=("$(basename "$f" .yaml)"); done
fi
model="$OUT/stories260K"
[ -f "$model/config.json" ] || $Q import llama2c "$SHARED/models/stories260K/stories260K.bin" \
    "$SHARED/models/stories260K/tok512.bin" --out "$model" > /dev/null
for r in "${recipes[@]}"; do
  dir="$OUT/q-$r"
  rm -rf "$dir" "$dir.job"
  $Q quantize --recipe "jobs/$r.yaml" --model "$model" --out "$dir" --data-root "$SHARED" \
      > "$OUT/$r.log" 2>&1 || { echo "$r FAILED (see $OUT/$r.log)"; continue; }
  (cd "$dir" && for f in $(ls | sort); do echo "$r $f $(sha256sum "$f" | cut -d' ' -f1)"; done)
done
