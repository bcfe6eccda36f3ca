#!/usr/bin/env bash
# Mixture-of-experts models upcycled from the real stories260K (issue 53, deliverable 6): every
# expert a copy of its block's MLP perturbed by NOISE relative Gaussian noise (default 0.05), so
# the model still models text, in the Mixtral layout (4 experts, top 2) and the Llama 4 layout
# (4 experts, top 1, half of each MLP in the shared expert, half routed through sigmoid-scaled
# inputs, the router scaled so the chosen expert's sigmoid score is near 1; MoE on every layer, no
# NoPE layers). Prints the float models' perplexity and KL to the
# dense model (qcal eval --reference), and the routing of the TinyStories sample (qcal tool
# expert-load: tokens per expert).
#   bash bench/moe-upcycle.sh [WORK_DIR]          (after scripts/build.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-/tmp/qcal-moe-upcycle}
source bench/moe-models.sh
echo "| model (stories260K upcycled, noise $NOISE) | TinyStories ppl | KL to dense | WikiText-2 ppl ($MAX_TOKENS tokens) | KL to dense | tokens per expert, TinyStories 4096 tokens: min / max over layers |"
echo "|---|---|---|---|---|---|"
row() {  # name dir
  local name=$1 dir=$2 cells=()
  for data in "$ts" "$wt"; do
    local j
    j=$($Q eval --model "$dir" --reference "$dense" --data "$data" --ctx 256 --bos-per-window \
        --max-tokens "$MAX_TOKENS" --json 2>/dev/null)
    cells+=("$(/usr/bin/python3 -c 'import json,sys; j=json.loads(sys.argv[1]); print("%.4f | %.5f" % (j["perplexity"], j["mean_kl"]))' "$j")")
  done
  local load="-"
  if [ "$name" != dense ]; then
    load=$($Q tool expert-load --model "$dir" --data "$ts" --tokens 4096 --json |
      /usr/bin/python3 -c 'import json,sys; j=json.load(sys.stdin); L=j["layers"]; print("%d / %d (%d tokens, top %d, %d experts x %d layers)" % (min(l["min"] for l in L), max(l["max"] for l in L), j["tokens"], j["top_k"], j["experts"], len(L)))')
  fi
  echo "| $name | ${cells[0]} | ${cells[1]} | $load |"
}
row dense "$dense"
for name in "${MOE_MODELS[@]}"; do
  upcycle "$name"
  row "$name" "$WORK/$name"
done
