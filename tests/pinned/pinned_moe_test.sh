#!/usr/bin/env bash
# Pins the bytes of mixture-of-experts calibration and quantization: stories260K upcycled as in
# bench/moe-models.sh (Mixtral layout, 4 experts, top 2; Llama 4 layout, 4 experts, top 1 with a
# shared expert), quantized by single-process `qcal quantize` with gptq-4bit and
# calibration.moe_min_tokens 5000, so that in each model some experts keep the real routing and
# some calibrate on every token (the starved-expert rule). The sha256 of every output file and of
# every block's Hessian cache file (JOB/hessians/) must equal tests/pinned/moe-hashes.txt: an
# unintended change of the expert Hessians' sums (the per-sequence products, the route-all
# inputs, the file layout) or of the rounding fails here. An intended one updates that file in
# the same commit and says why (regenerate: bash tests/pinned/pinned_moe_test.sh . build --print
# > tests/pinned/moe-hashes.txt).
# Usage (ctest runs it): pinned_moe_test.sh SOURCE_DIR BUILD_DIR [--print]
set -euo pipefail
src=$(cd "$1" && pwd) build=$(cd "$2" && pwd)
print=${3:-}
export OPENBLAS_CORETYPE=${QCAL_PIN_OPENBLAS_CORETYPE:-Haswell}  # as pinned_outputs_test.sh
cd "$src"
work=$(mktemp -d /tmp/qcal-pinned-moe.XXXXXX)
trap 'rm -rf "$work"' EXIT
WORK=$work
export QCAL_BIN="$build/client/qcal"
source bench/moe-models.sh  # upcycle, MOE_MODELS, SHARED, Q (QCAL_BIN)

sed -e 's/^name: .*/name: gptq-starved/' \
    -e 's/^calibration:$/calibration:\n  moe_min_tokens: 5000/' jobs/gptq-4bit.yaml > "$work/r.yaml"
for name in "${MOE_MODELS[@]}"; do
  upcycle "$name"
  o="$work/$name-starved-quantize"
  "$Q" quantize --recipe "$work/r.yaml" --model "$work/$name" --out "$o" --data-root "$SHARED" \
      > "$o.log" 2>&1 || { echo "$name: qcal quantize failed:"; tail -5 "$o.log"; exit 1; }
  (cd "$o" && for f in $(ls | sort); do
     echo "$name-starved quantize out/$f $(sha256sum "$f" | cut -d' ' -f1)"; done)
  (cd "$o.job/hessians" && for f in $(ls *.safetensors | sort); do
     echo "$name-starved quantize hessians/$f $(sha256sum "$f" | cut -d' ' -f1)"; done)
done > "$work/got.txt"
if [ "$print" = --print ]; then cat "$work/got.txt"; exit 0; fi
pins="$src/tests/pinned/moe-hashes.txt"
if diff "$pins" "$work/got.txt" > "$work/diff.txt"; then
  echo "pinned MoE outputs: $(wc -l < "$pins") files of ${#MOE_MODELS[@]} models identical"
  exit 0
fi
echo "pinned MoE outputs differ (expected < > got):"
cat "$work/diff.txt"
exit 1
