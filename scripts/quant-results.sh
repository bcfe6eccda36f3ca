#!/usr/bin/env bash
# Quantizes both bundled real models with every recipe in jobs/ and prints a markdown table of
# perplexities (TinyStories sample and WikiText-2 test, --bos-per-window at the model's seq_len,
# as the golden numbers), bits per weight and wall times. Used for docs/results.md.
#   bash scripts/quant-results.sh [OUT_DIR]       (after scripts/build.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${QCAL_SHARED_DIR:-../shared}
OUT=${1:-out/results}
Q=build/client/qcal
RECIPES=(rtn-4bit rtn-3bit rtn-2bit gptq-4bit gptq-3bit gptq-2bit quip-e8p-4bit quip-e8p-3bit
         quip-e8p-2bit quip-halfint-2bit quip-e8p-4bit-ft quip-e8p-3bit-ft quip-e8p-2bit-ft)
TS="$SHARED/data/tinystories/TinyStories-valid.sample30k.txt"
WT="$SHARED/data/wikitext2/wiki.test.joined.txt"
mkdir -p "$OUT"

secs_since() { local ms=$(( ($(date +%s%N) - $1) / 1000000 )); printf "%d.%01d" $((ms / 1000)) $(((ms % 1000) / 100)); }
json_field() { /usr/bin/python3 -c "import json,sys; print(json.loads(sys.stdin.readlines()[-1])['$1'])"; }

echo "| model | recipe | bits (codes / stored) | TinyStories ppl | WikiText-2 ppl | quantize s | eval s |"
echo "|---|---|---|---|---|---|---|"
for model in ${QCAL_MODELS:-stories260K aidreams260K}; do
  ctx=512; [ "$model" = aidreams260K ] && ctx=128
  fdir="$OUT/$model"
  [ -f "$fdir/config.json" ] || $Q import llama2c "$SHARED/models/$model/$model.bin" \
      "$SHARED/models/$model/tok512.bin" --out "$fdir" > /dev/null
  for recipe in float "${RECIPES[@]}"; do
    dir="$fdir"; bits="32 / 32"; qs="-"
    if [ "$recipe" != float ]; then
      dir="$OUT/$model-$recipe"
      t0=$(date +%s%N)
      qj=$($Q quantize --recipe "jobs/$recipe.yaml" --model "$fdir" --out "$dir" \
             --data-root "$SHARED" --json)
      qs=$(secs_since "$t0")
      bits="$(printf %.3f "$(echo "$qj" | json_field code_bits_per_weight)") / $(printf %.3f "$(echo "$qj" | json_field stored_bits_per_weight)")"
    fi
    t0=$(date +%s%N)
    ts=$($Q eval --model "$dir" --data "$TS" --ctx $ctx --bos-per-window --json | json_field perplexity)
    wt=$($Q eval --model "$dir" --data "$WT" --ctx $ctx --bos-per-window --json | json_field perplexity)
    es=$(secs_since "$t0")
    printf "| %s | %s | %s | %.3f | %.3f | %s | %s |\n" "$model" "$recipe" "$bits" "$ts" "$wt" "$qs" "$es"
  done
done
