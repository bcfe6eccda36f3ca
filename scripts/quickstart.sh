#!/usr/bin/env bash
# Newcomer command (a): install, build, and run the main job on the bundled model.
#   bash scripts/quickstart.sh
# The main job imports ../shared/models/stories260K into a Hugging Face layout, prints its float
# perplexity on the WikiText-2 test set and the TinyStories sample, quantizes it with QuIP# 2-bit
# (E8P, jobs/quip-e8p-2bit.yaml) and prints the quantized model's perplexity on the same data.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${QCAL_SHARED_DIR:-../shared}
OUT=${QCAL_OUT_DIR:-out}
bash scripts/install-deps.sh
bash scripts/build.sh
QCAL=build/client/qcal
$QCAL import llama2c "$SHARED/models/stories260K/stories260K.bin" \
  "$SHARED/models/stories260K/tok512.bin" --out "$OUT/stories260K"
echo
echo "== WikiText-2 test (GPTQ convention: non-overlapping 512-token windows)"
$QCAL eval --model "$OUT/stories260K" --data "$SHARED/data/wikitext2/wiki.test.joined.txt" --ctx 512
echo
echo "== TinyStories sample (same convention)"
$QCAL eval --model "$OUT/stories260K" \
  --data "$SHARED/data/tinystories/TinyStories-valid.sample30k.txt" --ctx 512
echo
echo "== QuIP# 2-bit (E8P) quantization"
$QCAL quantize --recipe jobs/quip-e8p-2bit.yaml --model "$OUT/stories260K" \
  --out "$OUT/stories260K-quip2" --data-root "$SHARED"
echo
echo "== quantized: WikiText-2 test"
$QCAL eval --model "$OUT/stories260K-quip2" --data "$SHARED/data/wikitext2/wiki.test.joined.txt" \
  --ctx 512
echo
echo "== quantized: TinyStories sample"
$QCAL eval --model "$OUT/stories260K-quip2" \
  --data "$SHARED/data/tinystories/TinyStories-valid.sample30k.txt" --ctx 512
echo
echo "== greedy samples: float, then quantized"
$QCAL generate --model "$OUT/stories260K" --prompt "Once upon a time" --tokens 48
$QCAL generate --model "$OUT/stories260K-quip2" --prompt "Once upon a time" --tokens 48
