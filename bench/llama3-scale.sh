#!/usr/bin/env bash
# Llama-3-shaped models with RANDOM weights (scripts/make-random-llama.py: bf16 shards, the real
# Llama 3 tokenizer, vocabulary 128,256, untied head, llama3 rope_scaling) quantized by
# `qcal run` on 2 MPI ranks with WikiText-2 calibration: peak resident memory per rank and wall
# time per phase (from the job's PHASE events).
#   bash bench/llama3-scale.sh [WORK_DIR] [CASE ...]     (after scripts/build.sh)
# Cases: 8b-quip2 (llama3-8b, 2 layers, QuIP# 2-bit), 8b-gptq4 (llama3-8b, 2 layers, GPTQ 4-bit),
# 70b-gptq4 (llama3-70b, 1 layer, GPTQ 4-bit); default: all three. Calibration: QCAL_CALIB_SEQS
# sequences (default 16) of 128 tokens. WORKERS (default 2) ranks.
# Prints one markdown row per case.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${QCAL_SHARED_DIR:-../shared}
WORK=${1:-/tmp/qcal-llama3-scale}
shift || true
CASES=("$@")
[ ${#CASES[@]} -gt 0 ] || CASES=(8b-quip2 8b-gptq4 70b-gptq4)
SEQS=${QCAL_CALIB_SEQS:-16}
WORKERS=${WORKERS:-2}
Q=build/client/qcal
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
source bench/rank-peaks.sh
mkdir -p "$WORK"

echo "| case (random weights) | ranks | peak per rank (GiB) | calibrate s | quantize s | finalize s | total s | blocks (rank: s) |"
echo "|---|---|---|---|---|---|---|---|"
for c in "${CASES[@]}"; do
  case $c in
    8b-quip2) shape=llama3-8b layers=2 recipe=jobs/quip-e8p-2bit.yaml ;;
    8b-gptq4) shape=llama3-8b layers=2 recipe=jobs/gptq-4bit.yaml ;;
    70b-gptq4) shape=llama3-70b layers=1 recipe=jobs/gptq-4bit.yaml ;;
    *) echo "unknown case $c" >&2; exit 2 ;;
  esac
  model="$WORK/$shape-$layers"
  [ -f "$model/config.json" ] || /usr/bin/python3 scripts/make-random-llama.py --shape "$shape" \
      --layers "$layers" --dtype bf16 --max-shard-mb 2000 --out "$model" > /dev/null
  r="$WORK/$c.yaml"
  sed -e "s/num_sequences: 128/num_sequences: $SEQS/" -e "s/^name: \(.*\)/name: \1-calib$SEQS/" \
      "$recipe" > "$r"
  out="$WORK/out-$c"
  rm -rf "$out" "$out.job" "$WORK/done-$c"
  rank_peaks_start "$WORK/done-$c" "$WORK/peaks-$c.txt"
  rc=0
  $Q run "$r" --model "$model" --out "$out" --workers "$WORKERS" --no-eval --data-root "$SHARED" \
      --json > "$WORK/run-$c.jsonl" 2> "$WORK/run-$c.err" || rc=$?
  touch "$WORK/done-$c"
  wait "$RANK_PEAKS_PID"
  peaks=$(rank_peaks_report "$WORK/run-$c.jsonl" "$WORK/peaks-$c.txt")
  if [ $rc -ne 0 ]; then
    echo "| $shape $layers layers, $(basename "$recipe" .yaml) | $WORKERS | $peaks | failed (exit $rc): $(tail -1 "$WORK/run-$c.err") ||||"
    continue
  fi
  /usr/bin/python3 - "$WORK/run-$c.jsonl" "$shape $layers layers, $(basename "$recipe" .yaml)" \
      "$WORKERS" "$peaks" <<'EOF'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
events = [l for l in lines if "kind" in l]
job = [l for l in lines if "job" in l][-1]["job"]
phases, start = {}, None
marks = [(e["time_unix"], e["phase"]) for e in events if e["kind"] == "PHASE"]
end = job["updated_unix"]
for i, (t, p) in enumerate(marks):
    t1 = marks[i + 1][0] if i + 1 < len(marks) else end
    phases[p] = phases.get(p, 0) + t1 - t
blocks = ", ".join(f'{b["block"]} r{b["rank"]}: {b["seconds"]:.0f}' for b in job["blocks"])
total = end - job["created_unix"]
f = lambda p: f'{phases[p]:.0f}' if p in phases else "-"
print(f'| {sys.argv[2]} | {sys.argv[3]} | {sys.argv[4]} | {f("calibrate")} | {f("quantize")} | '
      f'{f("finalize")} | {total:.0f} | {blocks} |')
EOF
done
