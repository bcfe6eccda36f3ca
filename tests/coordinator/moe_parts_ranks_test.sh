#!/usr/bin/env bash
# Issue 53, deliverable 4: a mixture-of-experts block's experts quantized in parallel on several
# ranks. stories260K upcycled (tests/reference/moe_reference.py) into Mixtral (4 experts, top 2)
# and Llama4ForConditionalGeneration (4 experts, top 1, a shared expert, MoE on every other
# layer, a vision tower); gptq 4-bit and quip E8P 2-bit. Reference: `qcal quantize
# --experts-per-task -1` (one task per block). Each of
#   qcal quantize --experts-per-task 1          (every expert its own task, one rank)
#   qcal run --workers 1 / 2 / 3 --experts-per-task 1, 3
# must write a checkpoint byte-identical to it (same file set, hidden files included: no part
# file left) and journal one block_part_done per expert group of each MoE block (how many ranks
# quantized groups of one block is printed); the job report counts a
# split block's time as its tasks' (assembly + groups) and every rank that ran one of them.
# Usage (ctest runs it): moe_parts_ranks_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
shared=${QCAL_SHARED_DIR:-$src/../shared}
q="$build/client/qcal"
py=/usr/bin/python3
work=$(mktemp -d /tmp/qcal-moe-parts.XXXXXX)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
unset QCAL_NUM_THREADS OPENBLAS_NUM_THREADS OMP_NUM_THREADS

"$q" import llama2c "$shared/models/stories260K/stories260K.bin" \
  "$shared/models/stories260K/tok512.bin" --out "$work/dense" > /dev/null
"$py" "$src/tests/reference/moe_reference.py" upcycle --dense "$work/dense" \
  --out "$work/mixtral" --layout mixtral --experts 4 --top-k 2 --noise 0.05 --seed 1 > /dev/null
"$py" "$src/tests/reference/moe_reference.py" upcycle --dense "$work/dense" \
  --out "$work/llama4-mm" --layout llama4-mm --experts 4 --top-k 1 --shared-scale 0.5 \
  --router-scale 16 --moe-step 2 --noise 0.05 --seed 1 > /dev/null

cat > "$work/gptq4.yaml" <<'YAML'
name: moe-parts-gptq4
method: gptq
bits: 4
calibration: {files: [data/tinystories/TinyStories-valid.sample30k.txt], num_sequences: 16, seq_len: 64}
YAML
cat > "$work/quip2.yaml" <<'YAML'
name: moe-parts-quip2
method: quip
bits: 2
codebook: e8p
calibration: {files: [data/tinystories/TinyStories-valid.sample30k.txt], num_sequences: 16, seq_len: 64}
YAML

fail=0
compare() {  # compare REF OUT LABEL
  local ref=$1 out=$2 label=$3 bad=0
  if ! diff <(cd "$ref" && ls -A | sort) <(cd "$out" && ls -A | sort) > /dev/null; then
    echo "FAIL $label: file sets differ: $(cd "$ref" && ls -A | tr '\n' ' ') vs $(cd "$out" && ls -A | tr '\n' ' ')"
    bad=1
  fi
  for f in "$ref"/*; do
    cmp -s "$f" "$out/$(basename "$f")" || { echo "FAIL $label: $(basename "$f") differs"; bad=1; }
  done
  [ $bad -eq 0 ] && echo "ok   $label: $(ls "$ref" | wc -l) files byte-identical to one task per block"
  return $bad
}
# parts JOB_DIR PER_TASK MODEL LABEL WORKERS: one block_part_done per group of every MoE block;
# with several workers, some block's groups on more than one rank.
parts() {
  "$py" - "$1/journal.jsonl" "$2" "$3/config.json" "$4" "$5" <<'PY'
import json, sys
journal, per_task, config, label = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
c = json.load(open(config))
t = c.get("text_config", c)
experts = t.get("num_local_experts")
layers = t["num_hidden_layers"]
step = t.get("interleave_moe_layer_step", 1)
moe = [l for l in range(layers) if step <= 1 or (l + 1) % step == 0]
groups = -(-experts // per_task)
entries = [json.loads(l) for l in open(journal) if l.strip()]
parts = [e for e in entries if e.get("event") == "block_part_done"]
bad = []
ranks_by_block = {}
for l in moe:
    mine = [e for e in parts if e["layer"] == l]
    if len(mine) != groups:
        bad.append(f"block {l}: {len(mine)} block_part_done, expected {groups}")
    ranks_by_block[l] = {e.get("rank") for e in mine}
dense = [e["layer"] for e in parts if e["layer"] not in moe]
if dense:
    bad.append(f"dense blocks {dense} were split")
# How many ranks quantized groups of one block is printed, not required: tasks are pulled, so
# on a loaded machine one rank may take them all (runner_scheduler_test shows groups going to
# several ranks at once).
spread = max(len(r) for r in ranks_by_block.values())
# The report (JOB/report.html): "Time per block task" bars are the block's tasks summed; the
# peak memory chart has a bar for every rank that ran a task.
import re
page = open(journal.rsplit("/", 1)[0] + "/report.html").read()
blocks = {e["layer"]: e for e in entries if e.get("event") == "block_done"}
chart = page[page.index('id="time-block"'):]
chart = chart[:chart.index("</svg>")]
for l in moe:
    want = blocks[l]["seconds"] + sum(e["seconds"] for e in parts if e["layer"] == l)
    m = re.search(r"<title>%d seconds: ([0-9.e+-]+) s</title>" % l, chart)
    if not m or abs(float(m.group(1)) - want) > 1e-3 * max(1.0, want):
        bad.append(f"report: block {l} time {m.group(1) if m else None}, its tasks sum to {want:.4g}")
ranks = {e.get("rank") for e in parts} | {b.get("rank") for b in blocks.values()}
memory = page[page.index('id="memory-rank"'):]
for r in ranks:
    if f"<title>rank {r} host" not in memory:
        bad.append(f"report: no peak memory bar for rank {r}")
if bad:
    print(f"FAIL {label}: " + "; ".join(bad)); sys.exit(1)
print(f"ok   {label}: {groups} group(s) per MoE block journaled, up to {spread} rank(s) per block, "
      f"the report counts them")
PY
}

for model in mixtral llama4-mm; do
  for recipe in gptq4 quip2; do
    ref="$work/$model-$recipe-whole"
    "$q" quantize --recipe "$work/$recipe.yaml" --model "$work/$model" --out "$ref" \
      --data-root "$shared" --threads 1 --experts-per-task -1 > "$ref.log" 2>&1 \
      || { echo "qcal quantize $model $recipe failed:"; tail -5 "$ref.log"; exit 1; }
    out="$work/$model-$recipe-q1"
    if "$q" quantize --recipe "$work/$recipe.yaml" --model "$work/$model" --out "$out" \
        --data-root "$shared" --threads 1 --experts-per-task 1 > "$out.log" 2>&1; then
      compare "$ref" "$out" "$model $recipe quantize --experts-per-task 1" || fail=1
      parts "$out.job" 1 "$work/$model" "$model $recipe quantize --experts-per-task 1" 1 || fail=1
    else
      echo "FAIL $model $recipe quantize --experts-per-task 1:"; tail -8 "$out.log"; fail=1
    fi
    combos=("2 1" "3 1" "2 3")
    [ "$recipe" = quip2 ] && combos=("2 1")
    for combo in "${combos[@]}"; do
      set -- $combo
      label="$model $recipe run --workers $1 --experts-per-task $2"
      out="$work/$model-$recipe-w$1-e$2"
      if ! "$q" run "$work/$recipe.yaml" --model "$work/$model" --out "$out" \
          --data-root "$shared" --workers "$1" --threads 1 --experts-per-task "$2" --no-eval \
          > "$out.log" 2>&1; then
        echo "FAIL $label: qcal run exited non-zero:"; tail -8 "$out.log"; fail=1; continue
      fi
      compare "$ref" "$out" "$label" || fail=1
      parts "$out.job" "$2" "$work/$model" "$label" "$1" || fail=1
    done
  done
done
exit $fail
