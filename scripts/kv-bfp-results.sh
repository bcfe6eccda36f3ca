#!/usr/bin/env bash
# BFP12 K cache with and without K-sort on the real models and their outlier-planted variants
# (docs/results.md, "BFP keys and K-sort"). Writes one JSON object per line to $OUT/results.jsonl
# and the outlier statistics to $OUT/stats.jsonl; prints progress to stderr.
#
#   QCAL=build/client/qcal OUT=/tmp/kvbfp scripts/kv-bfp-results.sh
#
# Environment: QCAL (the qcal binary), SHARED (../shared), OUT (output dir), WIKI_TOKENS (first N
# tokens of WikiText-2 test; default 100000, -1 = all).
set -euo pipefail
QCAL=${QCAL:-build/client/qcal}
SHARED=${SHARED:-../shared}
OUT=${OUT:-/tmp/kvbfp}
WIKI_TOKENS=${WIKI_TOKENS:-100000}
TS=$SHARED/data/tinystories/TinyStories-valid.sample30k.txt
WIKI=$SHARED/data/wikitext2/wiki.test.joined.txt
mkdir -p "$OUT"
: > "$OUT/results.jsonl"
: > "$OUT/stats.jsonl"

for m in stories260K aidreams260K; do
  "$QCAL" import llama2c "$SHARED/models/$m/$m.bin" "$SHARED/models/$m/tok512.bin" \
    --out "$OUT/$m" > /dev/null
  "$QCAL" tool plant-outliers --model "$OUT/$m" --out "$OUT/$m-planted" --json \
    > "$OUT/$m-planted.plant.json"
  "$QCAL" tool plant-outliers --model "$OUT/$m" --out "$OUT/$m-planted2" --k-pairs 2 --json \
    > "$OUT/$m-planted2.plant.json"
done

for m in stories260K aidreams260K; do
  if [ $m = stories260K ]; then ctx=512; blocks="2 4 8"; else ctx=128; blocks="2 4 8 16"; fi
  for v in "" -planted -planted2; do
    dir=$OUT/$m$v
    "$QCAL" tool outlier-stats --model "$dir" --data "$TS" --tokens 4096 --ctx $ctx --json \
      >> "$OUT/stats.jsonl"
    for data in tinystories wikitext2; do
      if [ $data = tinystories ]; then file=$TS; max=-1; else file=$WIKI; max=$WIKI_TOKENS; fi
      run() {
        echo "$m$v $data $*" >&2
        "$QCAL" tool kv-eval --model "$dir" --data "$file" --ctx $ctx --bos-per-window \
          --max-tokens $max --kl --json "$@" | sed "s/^{/{\"dataset\":\"$data\",/" \
          >> "$OUT/results.jsonl"
      }
      run --key-bits 16 --query-bits 16
      for b in $blocks; do
        run --block $b
        run --block $b --k-sort
      done
    done
  done
done
echo "done: $OUT/results.jsonl $OUT/stats.jsonl" >&2
