#!/usr/bin/env bash
# Mixture-of-experts layers at real shapes with RANDOM weights (scripts/make-random-llama.py
# --shape mixtral-8x7b | llama4-scout, 1 layer, bf16, the real Llama 3 tokenizer) quantized by
# `qcal run` on WORKERS (default 2) ranks, once with one task per block (--experts-per-task -1)
# and once with the block's experts split into groups (issue 53, deliverable 4): wall time per
# phase (from the job's PHASE events), peak resident memory per rank, and each task's rank and
# seconds (the block's assembly, and its expert groups from the journal's block_part_done).
#   bash bench/moe-scale.sh [WORK_DIR] [CASE ...]     (after scripts/build.sh)
# Cases: mixtral-rtn4 (Mixtral-8x7B layer, RTN 4-bit: -1 and 2 experts per task),
# scout-rtn4 (Llama-4-Scout layer, RTN 4-bit: groups of 4 only; one task per block needs about
# 23 GiB on one rank, SPLITS="-1 4" where a rank has that); default: both. mixtral-gptq4 and
# scout-gptq4 (GPTQ 4-bit, groups of 2 and 4; the calibration expert-parallel) and mixtral-quip2 /
# scout-quip2 (QuIP# E8P 2-bit) calibrate on QCAL_CALIB_SEQS (default 64) WikiText-2 sequences
# of QCAL_CALIB_LEN (default 512) tokens, with calibration.moe_min_tokens QCAL_MOE_MIN_TOKENS
# (default 1024: so few tokens per expert would otherwise put every Scout expert on route-all).
# RECIPE overrides the recipe of every case; SPLITS overrides the experts-per-task values of
# every case (e.g. SPLITS=8: only the default split).
# QCAL_BIN: the qcal to run (default build/client/qcal; qcal-coordinator and qcal-worker beside
# it). Prints one markdown row per run.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${QCAL_SHARED_DIR:-../shared}
WORK=${1:-/tmp/qcal-moe-scale}
shift || true
CASES=("$@")
[ ${#CASES[@]} -gt 0 ] || CASES=(mixtral-rtn4 scout-rtn4)
SEQS=${QCAL_CALIB_SEQS:-64}
LEN=${QCAL_CALIB_LEN:-512}
MIN_TOKENS=${QCAL_MOE_MIN_TOKENS:-1024}
WORKERS=${WORKERS:-2}
Q=${QCAL_BIN:-build/client/qcal}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
source bench/rank-peaks.sh
mkdir -p "$WORK"

echo "| case (random weights) | experts per task | ranks | peak per rank (GiB) | calibrate s | quantize s | finalize s | total s | tasks (rank: s) |"
echo "|---|---|---|---|---|---|---|---|---|"
for c in "${CASES[@]}"; do
  case $c in
    mixtral-rtn4) shape=mixtral-8x7b splits="-1 2" recipe=${RECIPE:-jobs/rtn-4bit.yaml} ;;
    scout-rtn4) shape=llama4-scout splits="4" recipe=${RECIPE:-jobs/rtn-4bit.yaml} ;;
    mixtral-gptq4) shape=mixtral-8x7b splits="2" recipe=${RECIPE:-jobs/gptq-4bit.yaml} ;;
    scout-gptq4) shape=llama4-scout splits="4" recipe=${RECIPE:-jobs/gptq-4bit.yaml} ;;
    mixtral-quip2) shape=mixtral-8x7b splits="2" recipe=${RECIPE:-jobs/quip-e8p-2bit.yaml} ;;
    scout-quip2) shape=llama4-scout splits="4" recipe=${RECIPE:-jobs/quip-e8p-2bit.yaml} ;;
    *) echo "unknown case $c" >&2; exit 2 ;;
  esac
  splits=${SPLITS:-$splits}
  model="$WORK/$shape-1"
  [ -f "$model/config.json" ] || /usr/bin/python3 scripts/make-random-llama.py --shape "$shape" \
      --layers 1 --dtype bf16 --max-shard-mb 2000 --out "$model" > /dev/null
  r="$WORK/$c.yaml"
  sed -e "s/num_sequences: 128/num_sequences: $SEQS/" -e "s/seq_len: 128/seq_len: $LEN/" \
      -e "s/^calibration:$/calibration:\n  moe_min_tokens: $MIN_TOKENS/" \
      -e "s/^name: \(.*\)/name: \1-calib${SEQS}x$LEN/" "$recipe" > "$r"
  for per in $splits; do
    tag="$c-e$per"
    out="$WORK/out-$tag"
    rm -rf "$out" "$out.job" "$WORK/done-$tag"
    rank_peaks_start "$WORK/done-$tag" "$WORK/peaks-$tag.txt"
    rc=0
    $Q run "$r" --model "$model" --out "$out" --workers "$WORKERS" --no-eval \
        --data-root "$SHARED" --experts-per-task "$per" --json \
        > "$WORK/run-$tag.jsonl" 2> "$WORK/run-$tag.err" || rc=$?
    touch "$WORK/done-$tag"
    wait "$RANK_PEAKS_PID"
    peaks=$(rank_peaks_report "$WORK/run-$tag.jsonl" "$WORK/peaks-$tag.txt")
    label="$shape 1 layer, $(basename "$recipe" .yaml)"
    if [ $rc -ne 0 ]; then
      echo "| $label | $per | $WORKERS | $peaks | failed (exit $rc): $(tail -1 "$WORK/run-$tag.err") |||||"
      continue
    fi
    /usr/bin/python3 - "$WORK/run-$tag.jsonl" "$out.job/journal.jsonl" "$label" "$per" \
        "$WORKERS" "$peaks" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
events = [l for l in lines if "kind" in l]
job = [l for l in lines if "job" in l][-1]["job"]
phases = {}
marks = [(e["time_unix"], e["phase"]) for e in events if e["kind"] == "PHASE"]
end = job["updated_unix"]
for i, (t, p) in enumerate(marks):
    t1 = marks[i + 1][0] if i + 1 < len(marks) else end
    phases[p] = phases.get(p, 0) + t1 - t
journal = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
tasks = [f'experts [{e["part"]["expert_begin"]}, {e["part"]["expert_end"]}) r{e.get("rank", "?")}: '
         f'{e["seconds"]:.0f}' for e in journal if e.get("event") == "block_part_done"]
tasks += [f'block {b["block"]} r{b["rank"]}: {b["seconds"]:.0f}' for b in job["blocks"]]
total = end - job["created_unix"]
f = lambda p: f'{phases[p]:.0f}' if p in phases else "-"
print(f'| {sys.argv[3]} | {sys.argv[4]} | {sys.argv[5]} | {sys.argv[6]} | {f("calibrate")} | '
      f'{f("quantize")} | {f("finalize")} | {total:.0f} | {"; ".join(tasks)} |')
PY
  done
done
