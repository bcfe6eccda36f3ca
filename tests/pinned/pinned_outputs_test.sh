#!/usr/bin/env bash
# Pins the output bytes of a few small recipes on stories260K (single-process `qcal quantize`):
# the sha256 of every output file must equal tests/pinned/output-hashes.txt. An unintended
# numeric change fails here; an intended one updates that file in the same commit and says why
# (regenerate with: OPENBLAS_CORETYPE=Haswell bash scripts/recipe-hashes.sh /tmp/h gptq-4bit quarot-w4a4kv4 quip-e8p-2bit-ft
# quip-e8p-2bit spinquant-w4a4kv4 qtip-2bit > tests/pinned/output-hashes.txt).
# Usage (ctest runs it): pinned_outputs_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
# The pins were made with OpenBLAS's Haswell (AVX2 + FMA) kernels, which qcal selects by itself
# on every x86-64 CPU with AVX2 and FMA (common/cpu.h, SelectBlasKernelsOrReexec). Other kernels
# (OpenBLAS's Prescott fallback on CPUs newer than the library, or SkylakeX) sum small GEMMs in
# another order and change the bits of the recipes that train (block fine-tuning, rotation
# training). The export below keeps the pins on Haswell even where that selection cannot run;
# QCAL_PIN_OPENBLAS_CORETYPE tries others.
export OPENBLAS_CORETYPE=${QCAL_PIN_OPENBLAS_CORETYPE:-Haswell}
pins="$src/tests/pinned/output-hashes.txt"
work=$(mktemp -d /tmp/qcal-pinned.XXXXXX)
trap 'rm -rf "$work"' EXIT
recipes=$(awk '{print $1}' "$pins" | uniq)
# shellcheck disable=SC2086
QCAL_BIN="$build/client/qcal" bash "$src/scripts/recipe-hashes.sh" "$work" $recipes > "$work/got.txt"
if diff "$pins" "$work/got.txt" > "$work/diff.txt"; then
  echo "pinned outputs: $(wc -l < "$pins") files of $(echo $recipes | wc -w) recipes identical"
  exit 0
fi
echo "pinned outputs differ (expected < > got):"
cat "$work/diff.txt"
for r in $recipes; do [ -s "$work/$r.log" ] && { echo "--- $r log:"; tail -5 "$work/$r.log"; }; done
exit 1
