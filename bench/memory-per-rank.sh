#!/usr/bin/env bash
# Peak resident memory (VmHWM) of each worker rank of `qcal run`, on Llama-7B-shaped models with
# random weights and 2, 4 and 8 layers (scripts/make-random-llama.py), GPTQ 4-bit, 2 ranks and a
# small calibration (8 sequences of 128 tokens). A worker that holds one block at a time peaks at
# the same memory whatever the depth; one that holds the model grows with it.
#   bash bench/memory-per-rank.sh [WORK_DIR] [LAYERS ...]        (after scripts/build.sh)
# QCAL_BIN_DIR: a folder holding qcal, qcal-coordinator and qcal-worker (default: the build tree).
# Prints one markdown row per layer count: layers, peak per rank (GiB), wall time of the run.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${QCAL_SHARED_DIR:-../shared}
WORK=${1:-/tmp/qcal-memory}
shift || true
LAYERS=("$@")
[ ${#LAYERS[@]} -gt 0 ] || LAYERS=(2 4 8)
if [ -n "${QCAL_BIN_DIR:-}" ]; then
  Q="$QCAL_BIN_DIR/qcal"
  EXTRA=(--coordinator-binary "$QCAL_BIN_DIR/qcal-coordinator" --worker-binary "$QCAL_BIN_DIR/qcal-worker")
else
  Q=build/client/qcal
  EXTRA=()
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mkdir -p "$WORK"
tok="$WORK/stories260K"
[ -f "$tok/config.json" ] || $Q import llama2c "$SHARED/models/stories260K/stories260K.bin" \
    "$SHARED/models/stories260K/tok512.bin" --out "$tok" > /dev/null
recipe="$WORK/gptq-4bit-small-calib.yaml"
sed -e 's/num_sequences: 128/num_sequences: 8/' -e 's/^name: .*/name: gptq-4bit-small-calib/' \
    jobs/gptq-4bit.yaml > "$recipe"

source bench/rank-peaks.sh

echo "| layers | peak per rank (GiB) | qcal run wall s |"
echo "|---|---|---|"
for L in "${LAYERS[@]}"; do
  model="$WORK/llama7b-$L"
  [ -f "$model/config.json" ] || /usr/bin/python3 scripts/make-random-llama.py --shape 7b \
      --layers "$L" --tokenizer-from "$tok" --out "$model"
  out="$WORK/out-$L"
  rm -rf "$out" "$out.job" "$WORK/done-$L"
  rank_peaks_start "$WORK/done-$L" "$WORK/peaks-$L.txt"
  t0=$(date +%s.%N)
  $Q run "$recipe" --model "$model" --out "$out" --workers 2 --no-eval --data-root "$SHARED" \
      "${EXTRA[@]}" > "$WORK/run-$L.log" 2>&1 || { echo "run with $L layers failed: $WORK/run-$L.log"; }
  t1=$(date +%s.%N)
  touch "$WORK/done-$L"
  wait "$RANK_PEAKS_PID"
  peaks=$(rank_peaks_report "$WORK/run-$L.log" "$WORK/peaks-$L.txt")
  printf "| %s | %s | %.0f |\n" "$L" "$peaks" "$(echo "$t1 - $t0" | bc)"
  rm -rf "$out" "$out.job"
done
