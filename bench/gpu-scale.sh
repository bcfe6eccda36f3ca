#!/usr/bin/env bash
# Issue 37, deliverable 5: one decoder layer of Llama-3-8B and Llama-3-70B shape (RANDOM weights,
# scripts/make-random-llama.py: bf16 shards, the real Llama 3 tokenizer, untied head) quantized
# by `qcal quantize --device cuda` with 128 x 2048 WikiText-2 calibration tokens, gptq-4bit and
# quip-e8p-2bit: seconds per phase and peak host and device memory from each job's --json, then a
# projection of whole 8B (32 layers) and 70B (80 layers) jobs at the QuIP# paper's calibration
# (6144 x 4096 tokens) on one 8-GPU node, built from those measured times only (the method is
# printed with the table and in docs/results.md).
#
# On a lent GPU, after scripts/gpu-e2e.sh pack/stage has put the bundle in /tmp/qb:
#   bench/gpu-scale.sh run [OUT_DIR]
# Here, to try the logic on the CPU (small calibration, one case):
#   QCAL_SCALE_BIN=build/client/qcal QCAL_SCALE_DEVICE=cpu QCAL_SCALE_SEQS=2 \
#     QCAL_SCALE_SEQ_LEN=64 QCAL_SCALE_CASES=8b-gptq4 bench/gpu-scale.sh run /tmp/scale
# Mixture-of-experts cases (issue 53, on request: QCAL_SCALE_CASES="mixtral-gptq4 scout-gptq4"):
# one Mixtral-8x7B- or Llama-4-Scout-shaped layer, quantized with --experts-per-task 1 (each
# expert its own task, run one after another on the one GPU); the projection spreads a model's
# expert tasks over the 8 ranks.
# Knobs: QCAL_SCALE_CASES (default "8b-gptq4 8b-quip2 70b-gptq4 70b-quip2"), QCAL_SCALE_SEQS (128),
# QCAL_SCALE_SEQ_LEN (2048), QCAL_SCALE_STEP_S (each job's time budget, default 150 s),
# QCAL_SCALE_THREADS (host threads, default: all cores), QCAL_SCALE_WORK (models and jobs,
# default /tmp/qcal-scale). One "STEP" line per job; JSON, logs and the projection land in
# OUT_DIR as they are made. A job over its budget is reported with the last progress it showed.
set -uo pipefail
cd "$(dirname "$0")/.."
[ "${1:-}" = run ] || { echo "usage: bench/gpu-scale.sh run [OUT_DIR]" >&2; exit 2; }
out=${2:-${OUT:-.device/scale-out}}
mkdir -p "$out"
cases=(${QCAL_SCALE_CASES:-8b-gptq4 8b-quip2 70b-gptq4 70b-quip2})
seqs=${QCAL_SCALE_SEQS:-128}
seq_len=${QCAL_SCALE_SEQ_LEN:-2048}
budget=${QCAL_SCALE_STEP_S:-150}
device=${QCAL_SCALE_DEVICE:-cuda}
threads=${QCAL_SCALE_THREADS:-$(nproc)}
W=${QCAL_SCALE_WORK:-/tmp/qcal-scale}
if [ -n "${QCAL_SCALE_BIN:-}" ]; then
  Q=$QCAL_SCALE_BIN S=${QCAL_SHARED_DIR:-../shared}
else
  [ -d /tmp/qb ] || { cat /tmp/qcal-parts/qcal.part.* | xz -d | tar -C /tmp -xf - || exit 1; }
  export LD_LIBRARY_PATH=/tmp/qb/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  Q=/tmp/qb/qcal S=/tmp/qb/shared
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
fi
mkdir -p "$W"
PY=${QCAL_SCALE_PYTHON:-python3}

# The random models, one layer each; the 70B one is written in the background while the 8B
# jobs run (numpy, about a minute for its 4.2 GB of embeddings and head).
make_model() {  # shape
  local dir="$W/$1-1"
  [ -f "$dir/config.json" ] && return 0
  local start=$(date +%s)
  $PY scripts/make-random-llama.py --shape "$1" --layers 1 --dtype bf16 --max-shard-mb 2000 \
    --tokenizer-from "$S/models/llama3-tokenizer" --out "$dir.tmp" > "$out/make-$1.log" 2>&1 &&
    rm -rf "$dir" && mv "$dir.tmp" "$dir"
  local rc=$?
  echo "STEP make-random-llama $1 (random weights): rc=$rc $(( $(date +%s) - start )) s"
  return $rc
}
shapes=()
for c in "${cases[@]}"; do
  case $c in
    8b-*) s=llama3-8b ;; 70b-*) s=llama3-70b ;; mixtral-*) s=mixtral-8x7b ;; scout-*) s=llama4-scout ;;
    *) echo "unknown case $c" >&2; exit 2 ;;
  esac
  [[ " ${shapes[*]} " == *" $s "* ]] || shapes+=("$s")
done
declare -A made
first=${shapes[0]}
make_model "$first"; made[$first]=$?
bg_pid=
if [ ${#shapes[@]} -gt 1 ]; then
  (make_model "${shapes[1]}") & bg_pid=$!
fi

for c in "${cases[@]}"; do
  split=()
  case $c in
    8b-*) shape=llama3-8b ;;
    70b-*) shape=llama3-70b ;;
    mixtral-*) shape=mixtral-8x7b split=(--experts-per-task 1) ;;
    scout-*) shape=llama4-scout split=(--experts-per-task 1) ;;
  esac
  case $c in
    *-gptq4) recipe=jobs/gptq-4bit.yaml ;;
    *-quip2) recipe=jobs/quip-e8p-2bit.yaml ;;
    *) echo "unknown case $c" >&2; exit 2 ;;
  esac
  if [ "$shape" != "$first" ] && [ -n "$bg_pid" ]; then
    wait "$bg_pid"; made[$shape]=$?; bg_pid=
  fi
  [ "${made[$shape]:-1}" = 0 ] || { echo "STEP quantize $c: skipped (no model)"; continue; }
  r="$W/$c.yaml"
  sed -e "s/num_sequences: [0-9]*/num_sequences: $seqs/" -e "s/seq_len: [0-9]*/seq_len: $seq_len/" \
      -e "s/^name: \(.*\)/name: \1-scale-${seqs}x${seq_len}/" "$recipe" > "$r"
  rm -rf "$W/out-$c" "$W/out-$c.job"
  start=$(date +%s.%N)
  timeout "$budget" $Q --log-level info quantize --recipe "$r" --model "$W/$shape-1" \
    --out "$W/out-$c" --data-root "$S" --device "$device" --threads "$threads" \
    ${split[@]+"${split[@]}"} --json \
    > "$out/$c.json" 2> "$out/$c.log"
  rc=$?
  secs=$($PY -c "print(round($(date +%s.%N) - $start, 1))")
  if [ $rc = 0 ]; then
    echo "STEP quantize $c --device $device: rc=0 $secs s"
  else
    # Over budget or failed: where it was (the progress lines and the last events).
    echo "STEP quantize $c --device $device: rc=$rc $secs s (budget $budget s); last: $(tr '\r' '\n' < "$out/$c.log" | grep -v '^$' | tail -2 | tr '\n' ' ')"
  fi
done
[ -z "$bg_pid" ] || wait "$bg_pid"

$PY - "$out" "$seqs" "$seq_len" "$device" "${cases[@]}" <<'PY' | tee "$out/projection.md"
import json, math, os, sys
out, seqs, seq_len, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cases = sys.argv[5:]
GiB = 1 << 30
LAYERS = {"8b": 32, "70b": 80, "mixtral": 32, "scout": 48}
MOE = {"mixtral", "scout"}  # their block's tasks (expert groups + assembly) spread over ranks
PAPER_TOKENS, RANKS = 6144 * 4096, 8
measured_tokens = seqs * seq_len

def load(c):
    try:
        lines = open(f"{out}/{c}.json").read().strip().splitlines()
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None

def phase(phases, name):
    return sum(p["seconds"] for p in phases if p["name"] == name)

def peak(phases, key):
    vals = [p[key] for p in phases if p.get(key) is not None]
    return max(vals) / GiB if vals else float("nan")

print(f"### One layer, {seqs} x {seq_len} calibration tokens, --device {device} (random weights)\n")
cols = ["case", "total s", "calib: read", "forward + Hessian sums", "reduce", "save",
        "block: read", "transform", "load calib", "quantize", "(factor", "round", "refine",
        "proxy)", "write", "peak host GiB", "peak device GiB"]
print("| " + " | ".join(cols) + " |")
print("|" + "---|" * len(cols))
rows = {}
for c in cases:
    j = load(c)
    if j is None:
        print(f"| {c} | did not finish (see {c}.log) |" + " |" * (len(cols) - 2))
        continue
    cal = j["calibrate_phases"]
    # A split MoE block's phases are its expert tasks' and its assembly's, summed by name.
    blk = j["blocks"][0]["phases"] if j["blocks"] else []
    m = {"read": phase(cal, "hessians/read weights"), "forward": phase(cal, "hessians/forward"),
         "reduce": phase(cal, "hessians/reduce"), "save": phase(cal, "hessians/save"),
         "b_read": phase(blk, "read weights"), "b_transform": phase(blk, "transform"),
         "b_load": phase(blk, "load calibration"), "b_quantize": phase(blk, "quantize"),
         "factor": phase(blk, "quantize/factor"), "round": phase(blk, "quantize/round"),
         "refine": phase(blk, "quantize/refine"), "proxy": phase(blk, "quantize/proxy loss"),
         "b_write": phase(blk, "write"), "finalize": phase(j["phases"], "finalize"),
         "total": j["seconds"]}
    m["block"] = m["b_read"] + m["b_transform"] + m["b_load"] + m["b_quantize"] + m["b_write"]
    rows[c] = m
    host = (j.get("peak_host_bytes") or float("nan") * GiB) / GiB
    dev = j.get("peak_device_bytes")
    dev = dev / GiB if dev is not None else float("nan")
    vals = [m["total"], m["read"], m["forward"], m["reduce"], m["save"], m["b_read"],
            m["b_transform"], m["b_load"], m["b_quantize"], m["factor"], m["round"], m["refine"],
            m["proxy"], m["b_write"]]
    print(f"| {c} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {host:.1f} | {dev:.1f} |")

print(f"""
### Projection: whole models at {PAPER_TOKENS // 4096} x 4096 calibration tokens on one {RANKS}-GPU node

Method (measured per-layer seconds only): the calibration walk shards the sequences over the
{RANKS} ranks, so per layer every rank reads the block (calib: read), runs the forward with its
Hessian sums on 1/{RANKS} of the tokens (forward + Hessian sums, scaled linearly from
{measured_tokens} measured tokens to {PAPER_TOKENS // RANKS} per rank), reduces and rank 0 saves
(reduce, save: as measured on one GPU; the NCCL all-reduce across 8 GPUs is not measured by a
one-GPU loan); then the block tasks go to the ranks, {RANKS} at a time (block = read + transform
+ load calibration + quantize + write of the measured layer). Layers: 8B 32, 70B 80.
calibrate = L x (read + forward x {PAPER_TOKENS // RANKS}/{measured_tokens} + reduce + save);
quantize = ceil(L/{RANKS}) x block; for a MoE model (Mixtral 32 layers, Scout 48) the block's
expert tasks (one expert each) spread over the ranks too: quantize = L x block / {RANKS}, a lower
bound (the assembly waits for its groups). Attention at 4096 positions costs more per token than at
{seq_len}: the forward term is a lower bound by that share.
""")
print("| model, method | calibrate (h) | quantize (h) | total (h) | target |")
print("|---|---|---|---|---|")
for c, m in rows.items():
    size, method = c.split("-")
    L = LAYERS[size]
    calib = L * (m["read"] + m["forward"] * (PAPER_TOKENS / RANKS) / measured_tokens +
                 m["reduce"] + m["save"])
    quant = (L * m["block"] / RANKS if size in MOE else math.ceil(L / RANKS) * m["block"])
    target = {("70b", "quip2"): "<= 1 h", ("70b", "gptq4"): "<= 0.5 h"}.get((size, method), "")
    print(f"| {size.upper()} {method} | {calib / 3600:.2f} | {quant / 3600:.2f} | "
          f"{(calib + quant) / 3600:.2f} | {target} |")
PY
