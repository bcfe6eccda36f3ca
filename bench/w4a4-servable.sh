#!/usr/bin/env bash
# Issue 54: what the servable W4A4 recipes cost against the paper ones (docs/results.md, "Servable
# W4A4"). On stories260K and aidreams260K and their outlier-planted variants (qcal tool
# plant-outliers --alpha 50 --beta 50, as the QuaRot and SpinQuant tables), a chain of recipes from
# the paper's to the servable one, one change at a time:
#   paper       jobs/{quarot,spinquant}-w4a4kv4.yaml   R1-R4 (R4 whole), clip 0.9, 4-bit KV
#   kv16        the same with a float KV cache                       (what 4-bit KV costs)
#   r4b         kv16 without R3, R4 as the block Hadamard (r4_block: auto)   (what the block costs)
#   noclip      r4b with clip 1.0, qcal's rule                       (what giving up clipping costs)
#   servable    jobs/{quarot,spinquant}-w4a4-servable.yaml: noclip with Humming's rule
# Each runs as a job (`qcal quantize`, one process, one thread, the recipe's 128 x 128 WikiText-2
# calibration), then `qcal eval --reference FLOAT --bos-per-window` on the TinyStories sample
# (512-token windows; aidreams260K: 128): perplexity and mean KL(float || quantized) per token.
# The plain and planted models of one base run side by side (two processes).
#   bash bench/w4a4-servable.sh [BUILD_DIR] [OUT_DIR]   (OUT_DIR/results.jsonl + a table)
#   METHODS="quarot spinquant", MODELS="stories260K aidreams260K", STEPS="paper ... servable"
#   choose what runs.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=${2:-out/w4a4-servable}
SHARED=${QCAL_SHARED_DIR:-../shared}
Q=$BUILD/client/qcal
TS="$SHARED/data/tinystories/TinyStories-valid.sample30k.txt"
MODELS=${MODELS:-"stories260K aidreams260K"}
METHODS=${METHODS:-"quarot spinquant"}
mkdir -p "$OUT/recipes" "$OUT/q"
for m in $METHODS; do
  paper=jobs/$m-w4a4kv4.yaml
  sed -e "s/^name: .*/name: $m-w4a4kv4-kv16/" -e 's/^kv_cache: .*/kv_cache: {bits: 16}/' \
    "$paper" > "$OUT/recipes/$m-kv16.yaml"
  sed -e "s/^name: .*/name: $m-w4a4kv4-r4b/" \
    -e 's/^rotation: .*/rotation: {enabled: true, r1: true, r2: true, r3: false, r4: true, r4_block: auto, seed: 0}/' \
    "$OUT/recipes/$m-kv16.yaml" > "$OUT/recipes/$m-r4b.yaml"
  sed -e "s/^name: .*/name: $m-w4a4kv4-noclip/" \
    -e 's/^activations: .*/activations: {bits: 4, clip: 1.0, granularity: per_token}/' \
    "$OUT/recipes/$m-r4b.yaml" > "$OUT/recipes/$m-noclip.yaml"
done
source bench/small-models.sh
run_model() {  # run_model MODEL_DIR CTX -> one JSON line per recipe on stdout
  local variant=$1 ctx=$2 label m step recipe r
  label=$(basename "$variant")
  for m in $METHODS; do
    for step in ${STEPS:-paper kv16 r4b noclip servable}; do
      case $step in
        paper) recipe=jobs/$m-w4a4kv4.yaml ;;
        servable) recipe=jobs/$m-w4a4-servable.yaml ;;
        *) recipe=$OUT/recipes/$m-$step.yaml ;;
      esac
      r=$(job_eval "$recipe" "$variant" "$OUT/q/$label-$m-$step" "$ctx")
      echo "{\"model\":\"$label\",\"method\":\"$m\",\"step\":\"$step\",\"quantize_s\":${r%%$'\t'*},\"eval\":${r#*$'\t'}}"
      echo "$label $m $step done" >&2
    done
  done
}
: > "$OUT/results.jsonl"
for m in $MODELS; do
  ctx=$(prepare_model "$OUT" "$m")
  for v in "$OUT/$m" "$OUT/$m-planted"; do
    echo "{\"model\":\"$(basename "$v")\",\"method\":\"float\",\"step\":\"float\",\"eval\":$(float_eval "$v" "$ctx")}" \
      >> "$OUT/results.jsonl"
  done
  run_model "$OUT/$m" "$ctx" > "$OUT/$m.jsonl" &
  run_model "$OUT/$m-planted" "$ctx" > "$OUT/$m-planted.jsonl" &
  wait
  cat "$OUT/$m.jsonl" "$OUT/$m-planted.jsonl" >> "$OUT/results.jsonl"
done
/usr/bin/python3 - "$OUT/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = ["paper", "kv16", "r4b", "noclip", "servable"]
print("| model | float ppl | method | " + " | ".join(steps) + " |")
print("|---|---|---|" + "---|" * len(steps))
for model in dict.fromkeys(r["model"] for r in rows):
    fl = next(r for r in rows if r["model"] == model and r["method"] == "float")
    for m in dict.fromkeys(r["method"] for r in rows if r["method"] != "float"):
        cells = []
        for s in steps:
            r = next((r for r in rows if r["model"] == model and r["method"] == m and r["step"] == s), None)
            cells.append("%.3f / %.4f" % (r["eval"]["perplexity"], r["eval"]["mean_kl"]) if r else "")
        print("| %s | %.3f | %s | %s |" % (model, fl["eval"]["perplexity"], m, " | ".join(cells)))
PY
