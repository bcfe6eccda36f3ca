#!/usr/bin/env bash
# QuaRot perplexity table (the QuaRot rows of docs/results.md): every quarot recipe in jobs/ and
# its unrotated twin, plus RTN variants of the weight-only recipes, on stories260K and
# aidreams260K, plain and outlier-planted (qcal tool plant-outliers, alpha = beta = 50).
# Perplexity as in scripts/quant-results.sh (--bos-per-window, ctx = the model's seq_len) on the
# TinyStories sample (all tokens) and the first $WT_TOKENS tokens of WikiText-2 test, each with the
# mean KL(float || quantized) of the next-token distributions (--kl).
#   bash scripts/quarot-results.sh BUILD_DIR OUT_DIR      (writes OUT_DIR/*.jsonl, prints the table)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
OUT=${2:-out/quarot-results}
SHARED=${QCAL_SHARED_DIR:-../shared}
WT_TOKENS=${WT_TOKENS:-20000}
Q=$BUILD/client/qcal
R=$BUILD/bench/quarot_results
TS="$SHARED/data/tinystories/TinyStories-valid.sample30k.txt"
WT="$SHARED/data/wikitext2/wiki.test.joined.txt"
mkdir -p "$OUT/recipes"
# RTN twins of the weight-only recipes (not bundled).
for f in jobs/quarot-w?a16.yaml jobs/w?a16-norot.yaml; do
  n=$(basename "$f" .yaml)
  sed -e "s/^name: $n/name: $n-rtn/" -e 's/^weights: gptq/weights: rtn/' -e '/^damp:/d' \
      -e '/act_order:/d' "$f" > "$OUT/recipes/$n-rtn.yaml"
done
RECIPES=(float)
for n in w4a4kv4 w4a4kv4-rtn w4a8kv4 w8a8kv8 w8a8-wtensor-atensor-static w8a8-wchannel-atensor-static \
         w8a8-wchannel-atensor-dynamic w8a8-wchannel-atoken-dynamic w4a16 w3a16 w2a16 kv4 kv3; do
  rot=jobs/quarot-$n.yaml
  case $n in
    *-rtn) plain=jobs/${n%-rtn}-norot-rtn.yaml ;;
    *) plain=jobs/$n-norot.yaml ;;
  esac
  RECIPES+=("$rot" "$plain")
done
for b in 4 3 2; do RECIPES+=("$OUT/recipes/quarot-w${b}a16-rtn.yaml" "$OUT/recipes/w${b}a16-norot-rtn.yaml"); done
# BFP12 keys (block 4, pre-RoPE) without and with K-sort, through the recipe path.
RECIPES+=(jobs/kv-bfp12-g4.yaml jobs/kv-bfp12-g4-ksort.yaml)
# The planted models get every recipe too.
PLANTED=("${RECIPES[@]}")
for model in ${QCAL_MODELS:-stories260K aidreams260K}; do
  ctx=512; [ "$model" = aidreams260K ] && ctx=128
  [ -f "$OUT/$model/config.json" ] || $Q import llama2c "$SHARED/models/$model/$model.bin" \
      "$SHARED/models/$model/tok512.bin" --out "$OUT/$model" > /dev/null
  [ -f "$OUT/$model-planted/config.json" ] || $Q tool plant-outliers --model "$OUT/$model" \
      --out "$OUT/$model-planted" --alpha 50 --beta 50 > /dev/null
  # The plain and the planted model run side by side (two processes, one thread each).
  /usr/bin/time -f "$model: %e s wall" $R --model "$OUT/$model" --data-root "$SHARED" \
      --eval "$TS" --eval "$WT" --ctx $ctx --max-tokens "$WT_TOKENS" --kl "${RECIPES[@]}" \
      > "$OUT/$model.jsonl" &
  /usr/bin/time -f "$model-planted: %e s wall" $R --model "$OUT/$model-planted" \
      --data-root "$SHARED" --eval "$TS" --eval "$WT" --ctx $ctx --max-tokens "$WT_TOKENS" \
      --kl "${PLANTED[@]}" > "$OUT/$model-planted.jsonl" &
  wait
done
/usr/bin/python3 - "$OUT" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
print("| model | recipe | rotations | W bits (codes / stored) | TinyStories ppl | KL | WikiText-2 ppl (first tokens) | KL | quantize s | eval s |")
print("|---|---|---|---|---|---|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(out, "*.jsonl"))):
    model = os.path.basename(path)[:-6]
    for line in open(path):
        j = json.loads(line)
        ev = j["eval"]
        bits = "32 / 32" if "code_bits" not in j else "%.2f / %.2f" % (j["code_bits"], j["stored_bits"])
        kl = ["%.4f" % e["kl"] if "kl" in e else "-" for e in ev]
        print("| %s | %s | %s | %s | %.3f | %s | %.3f | %s | %s | %.1f |" % (
            model, j["recipe"], j.get("rotations", "-"), bits, ev[0]["perplexity"], kl[0],
            ev[1]["perplexity"], kl[1], "%.1f" % j["quantize_s"] if "quantize_s" in j else "-",
            sum(e["seconds"] for e in ev)))
PY
