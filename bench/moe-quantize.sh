#!/usr/bin/env bash
# Quantized mixture-of-experts models (issue 53, deliverable 6): stories260K upcycled as in
# bench/moe-upcycle.sh (Mixtral layout, 4 experts, top 2; Llama 4 layout, 4 experts, top 1 with a
# shared expert), quantized with the bundled recipes jobs/gptq-4bit.yaml, quip-e8p-2bit.yaml,
# qtip-2bit.yaml and quip-e8p-2bit-ft.yaml (QuIP#'s block and end-to-end fine-tuning; RECIPES
# picks some) (128 WikiText-2 sequences of 128 tokens), each with the real routing and with
# route-all calibration (calibration.moe_route_all: true), then evaluated (TinyStories sample,
# ctx 256, BOS per window, and WikiText-2 test, MAX_TOKENS tokens). Prints one markdown table and,
# per layout, the calibration's tokens per expert (fewest / most over the MoE blocks).
#   [RECIPES="quip-e8p-2bit-ft"] bash bench/moe-quantize.sh [WORK_DIR]   (after scripts/build.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-/tmp/qcal-moe-quantize}
source bench/moe-models.sh
ppl() {  # dir data -> perplexity
  $Q eval --model "$1" --data "$2" --ctx 256 --bos-per-window --max-tokens "$MAX_TOKENS" \
      --json 2>/dev/null |
    /usr/bin/python3 -c 'import json,sys; print("%.3f" % json.load(sys.stdin)["perplexity"])'
}
echo "| model (stories260K upcycled, noise $NOISE) | recipe | calibration | bits (codes) |" \
     "TinyStories ppl | WikiText-2 ppl | seconds |"
echo "|---|---|---|---|---|---|---|"
echo "| dense | float | – | 32 | $(ppl "$dense" "$ts") | $(ppl "$dense" "$wt") | – |"
loads=()
for name in "${MOE_MODELS[@]}"; do
  upcycle "$name"
  model="$WORK/$name"
  echo "| $name | float | – | 32 | $(ppl "$model" "$ts") | $(ppl "$model" "$wt") | – |"
  for recipe in ${RECIPES:-gptq-4bit quip-e8p-2bit qtip-2bit quip-e8p-2bit-ft}; do
    for mode in routed route-all; do
      yaml="$WORK/$recipe-$mode.yaml"
      if [ "$mode" = route-all ]; then
        sed -e "s/^name: .*/name: $recipe-route-all/" \
            -e 's/^calibration:$/calibration:\n  moe_route_all: true/' "jobs/$recipe.yaml" > "$yaml"
      else
        cp "jobs/$recipe.yaml" "$yaml"
      fi
      out="$WORK/$name-$recipe-$mode"
      rm -rf "$out" "$out.job"
      j=$($Q quantize --recipe "$yaml" --model "$model" --out "$out" --data-root "$SHARED" --json \
          2>/dev/null)
      read -r bits secs lo hi <<< "$(/usr/bin/python3 -c '
import json, sys
j = json.loads(sys.argv[1])
t = [x for l in j.get("expert_loads", []) for x in l["routed_tokens"]] or ["-"]
print("%.3f %.1f %s %s" % (j["code_bits_per_weight"], j["seconds"], min(t), max(t)))' "$j")"
      if [ "$mode" = routed ] && [ "$recipe" = gptq-4bit ]; then
        what="calibration tokens per expert (128 × 128 WikiText-2 tokens, top-k routing)"
        loads+=("$name: $what, fewest $lo / most $hi over the MoE blocks")
      fi
      echo "| $name | $recipe | $mode | $bits | $(ppl "$out" "$ts") | $(ppl "$out" "$wt") | $secs |"
    done
  done
done
echo
for l in "${loads[@]}"; do echo "- $l"; done
