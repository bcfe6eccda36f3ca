#!/usr/bin/env bash
# Issue 54: the FP8 (E4M3, static per-tensor scales) KV cache against a float cache, QuaRot's
# 4-bit integer cache and the K-sort paper's BFP12 keys (docs/results.md, "FP8 KV cache"). On
# stories260K and aidreams260K and their outlier-planted variants (qcal tool plant-outliers
# --alpha 50 --beta 50), KV-cache-only recipes (float weights and activations):
#   kv8fp-norot, quarot-kv8fp-r12   FP8 without rotation / after R1-R2 (both servable)
#   kv4-norot, quarot-kv4           QuaRot's 4-bit asymmetric cache per head, without / with R1-R4
#   kv-bfp12-g4, kv-bfp12-g4-ksort  BFP12 pre-RoPE keys in blocks of 4, without / with K-sort
# and the servable W4A4 recipe with a float and an FP8 cache. Each runs as a job (`qcal quantize`,
# one thread), then `qcal eval --reference FLOAT --bos-per-window` on the TinyStories sample
# (512-token windows; aidreams260K: 128): perplexity and mean KL(float || quantized) per token.
#   bash bench/kv-fp8.sh [BUILD_DIR] [OUT_DIR]   (OUT_DIR/results.jsonl + a table)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=${2:-out/kv-fp8}
SHARED=${QCAL_SHARED_DIR:-../shared}
Q=$BUILD/client/qcal
TS="$SHARED/data/tinystories/TinyStories-valid.sample30k.txt"
MODELS=${MODELS:-"stories260K aidreams260K"}
mkdir -p "$OUT/recipes" "$OUT/q"
sed -e 's/^name: .*/name: quarot-w4a4kv8fp-servable/' -e 's/^kv_cache: .*/kv_cache: {bits: 8, format: fp8}/' \
  jobs/quarot-w4a4-servable.yaml > "$OUT/recipes/quarot-w4a4kv8fp-servable.yaml"
RECIPES=(jobs/kv8fp-norot.yaml jobs/quarot-kv8fp-r12.yaml jobs/kv4-norot.yaml jobs/quarot-kv4.yaml
         jobs/kv-bfp12-g4.yaml jobs/kv-bfp12-g4-ksort.yaml jobs/quarot-w4a4-servable.yaml
         "$OUT/recipes/quarot-w4a4kv8fp-servable.yaml")
source bench/small-models.sh
run_model() {  # run_model MODEL_DIR CTX -> one JSON line per recipe
  local variant=$1 ctx=$2 label recipe name r
  label=$(basename "$variant")
  for recipe in "${RECIPES[@]}"; do
    name=$(basename "$recipe" .yaml)
    r=$(job_eval "$recipe" "$variant" "$OUT/q/$label-$name" "$ctx")
    echo "{\"model\":\"$label\",\"recipe\":\"$name\",\"quantize_s\":${r%%$'\t'*},\"eval\":${r#*$'\t'}}"
    echo "$label $name done" >&2
  done
}
: > "$OUT/results.jsonl"
for m in $MODELS; do
  ctx=$(prepare_model "$OUT" "$m")
  for v in "$OUT/$m" "$OUT/$m-planted"; do
    echo "{\"model\":\"$(basename "$v")\",\"recipe\":\"float\",\"eval\":$(float_eval "$v" "$ctx")}" \
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
models = list(dict.fromkeys(r["model"] for r in rows))
recipes = list(dict.fromkeys(r["recipe"] for r in rows))
print("| recipe | " + " | ".join(models) + " |")
print("|---|" + "---|" * len(models))
for rec in recipes:
    cells = []
    for m in models:
        r = next((r for r in rows if r["model"] == m and r["recipe"] == rec), None)
        e = r["eval"] if r else None
        cells.append("" if not e else ("%.3f" % e["perplexity"] if rec == "float"
                                       else "%.3f / %.4f" % (e["perplexity"], e["mean_kl"])))
    print("| %s | %s |" % (rec, " | ".join(cells)))
PY
