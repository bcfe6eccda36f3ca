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

# Samples VmHWM (kB) of every qcal-worker process every 0.2 s; prints the largest per pid.
sample_peaks() {
  declare -A peak
  while [ ! -f "$1" ]; do
    for p in $(pgrep -x qcal-worker || true); do
      v=$(awk '/VmHWM/{print $2}' "/proc/$p/status" 2>/dev/null || true)
      if [ -n "$v" ] && { [ -z "${peak[$p]:-}" ] || [ "$v" -gt "${peak[$p]}" ]; }; then peak[$p]=$v; fi
    done
    sleep 0.2
  done
  for p in "${!peak[@]}"; do echo "$p ${peak[$p]}"; done
}

echo "| layers | peak per rank (GiB) | qcal run wall s |"
echo "|---|---|---|"
for L in "${LAYERS[@]}"; do
  model="$WORK/llama7b-$L"
  [ -f "$model/config.json" ] || /usr/bin/python3 scripts/make-random-llama.py --shape 7b \
      --layers "$L" --tokenizer-from "$tok" --out "$model"
  out="$WORK/out-$L"
  rm -rf "$out" "$out.job" "$WORK/done-$L"
  sample_peaks "$WORK/done-$L" > "$WORK/peaks-$L.txt" &
  sampler=$!
  t0=$(date +%s.%N)
  $Q run "$recipe" --model "$model" --out "$out" --workers 2 --no-eval --data-root "$SHARED" \
      "${EXTRA[@]}" > "$WORK/run-$L.log" 2>&1 || { echo "run with $L layers failed: $WORK/run-$L.log"; }
  t1=$(date +%s.%N)
  touch "$WORK/done-$L"
  wait $sampler
  # Only this job's ranks (their pids, from the run's "rank r registered: ..., pid N" lines):
  # other qcal-worker processes on the machine (a test suite) are sampled too but not reported.
  ranks=$(sed -n 's/.* registered: .*, pid \([0-9]*\) .*/\1/p' "$WORK/run-$L.log" | sort -u)
  peaks=$(for p in $ranks; do grep "^$p " "$WORK/peaks-$L.txt" || true; done | sort -k2 -n |
          awk '{printf "%s%.2f", (NR>1?" / ":""), $2/1048576}')
  printf "| %s | %s | %.0f |\n" "$L" "$peaks" "$(echo "$t1 - $t0" | bc)"
  rm -rf "$out" "$out.job"
done
