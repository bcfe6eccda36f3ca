#!/usr/bin/env bash
# PrefixQuant table (docs/results.md, "PrefixQuant"): on stories260K and aidreams260K and their
# sink-planted variants (qcal tool plant-sinks: BOS and the first '.' massive, attention sinks),
# every bundled prefixquant recipe with and without the prefix, with and without block-wise
# fine-tuning, and QuaRot's dynamic recipes for comparison, each run as a job (`qcal quantize`,
# wall time recorded) and evaluated with `qcal eval --reference FLOAT --bos-per-window`: perplexity
# on the TinyStories sample and the mean KL(float || quantized) per scored token, in 512-token
# windows (aidreams260K: its context, 128) that each start with BOS (the llama2.c models' training convention). Behind a prefix
# (which ends with BOS) a window's BOS is the prefix's, so the float reference and the prefixed
# model read the same context; the window's first text token, which the prefixed model has no
# prediction for, is scored in neither. (In the default convention windows after the first have
# no BOS, and a prefixed model would read one the float model does not.)
# The -ft recipes carry the reference's Llama-scale learning rates; for these 260K-parameter
# models the script runs them with 40x (lr_weights 2e-4, lr_steps 2e-3), as the table says.
#   bash scripts/prefixquant-results.sh [BUILD_DIR] [OUT_DIR]   (OUT_DIR/results.jsonl + a table)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=${2:-out/prefixquant-results}
SHARED=${QCAL_SHARED_DIR:-../shared}
Q=$BUILD/client/qcal
TS="$SHARED/data/tinystories/TinyStories-valid.sample30k.txt"
MODELS=${MODELS:-"stories260K aidreams260K"}
mkdir -p "$OUT/recipes"
[ "${KEEP:-0}" = 1 ] || : > "$OUT/results.jsonl"   # KEEP=1: append (e.g. MODELS=aidreams260K)
for f in jobs/prefixquant-*.yaml; do
  n=$(basename "$f" .yaml)
  sed -e 's/lr_weights: 5.0e-6, lr_steps: 5.0e-5/lr_weights: 2.0e-4, lr_steps: 2.0e-3/' "$f" \
    > "$OUT/recipes/$n.yaml"
done
for q in w4a4kv4 w4a8kv4 w8a8kv8; do cp "jobs/quarot-$q.yaml" "$OUT/recipes/"; done
RECIPES=""
for q in w4a4kv4 w4a8kv4 w8a8kv8; do
  RECIPES="$RECIPES quarot-$q prefixquant-$q-noprefix prefixquant-$q prefixquant-$q-ft-noprefix prefixquant-$q-ft"
done
for m in $MODELS; do
  base="$OUT/$m"
  if [ ! -f "$base/config.json" ]; then
    $Q import llama2c "$SHARED/models/$m/$m.bin" "$SHARED/models/$m/tok512.bin" --out "$base" >/dev/null
  fi
  if [ ! -f "$base-sinks/config.json" ]; then
    $Q tool plant-sinks --model "$base" --out "$base-sinks" >/dev/null
  fi
  # 512-token windows, or the model's context when shorter (aidreams260K: 128).
  ctx=$(/usr/bin/python3 -c "import json,sys; print(min(512, json.load(open(sys.argv[1]))['max_position_embeddings']))" "$base/config.json")
  for variant in "$base" "$base-sinks"; do
    label=$(basename "$variant")
    j=$($Q eval --model "$variant" --data "$TS" --ctx $ctx --bos-per-window --json | tail -1)
    echo "{\"model\":\"$label\",\"recipe\":\"float\",\"eval\":$j}" >> "$OUT/results.jsonl"
    for r in $RECIPES; do
      out="$OUT/q/$label-$r"
      rm -rf "$out" "$out.job"
      t0=$(date +%s.%N)
      $Q quantize --recipe "$OUT/recipes/$r.yaml" --model "$variant" --out "$out" \
        --data-root "$SHARED" >/dev/null
      t1=$(date +%s.%N)
      j=$($Q eval --model "$out" --reference "$variant" --data "$TS" --ctx $ctx --bos-per-window \
        --json | tail -1)
      echo "{\"model\":\"$label\",\"recipe\":\"$r\",\"quantize_s\":$(printf %.2f "$(echo "$t1 - $t0" | bc)"),\"eval\":$j}" \
        >> "$OUT/results.jsonl"
      echo "$label $r done" >&2
    done
  done
done
/usr/bin/python3 - "$OUT/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
models = list(dict.fromkeys(r["model"] for r in rows))
recipes = list(dict.fromkeys(r["recipe"] for r in rows))
def cell(m, rec):
    for r in rows:
        if r["model"] == m and r["recipe"] == rec:
            e = r["eval"]
            if rec == "float":
                return "%.3f" % e["perplexity"]
            return "%.3f / %.3f / %.0f s" % (e["perplexity"], e["mean_kl"], r["quantize_s"])
    return ""
print("| recipe | " + " | ".join(models) + " |")
print("|---|" + "---|" * len(models))
for rec in recipes:
    print("| %s | " % rec + " | ".join(cell(m, rec) for m in models) + " |")
PY
