#!/usr/bin/env bash
# Chooses the default of `refine_sweeps` by measurement (issue 13): quantizes both bundled real
# models with QuIP# (2/3/4 bits) and GPTQ (2/3/4 bits) at several sweep counts and prints one
# markdown row per (model, recipe, sweeps): TinyStories and WikiText-2 perplexity
# (--bos-per-window at the model's seq_len) and the quantize wall time.
#   bash bench/refine-sweeps.sh [OUT_DIR] [SWEEPS ...]      (after scripts/build.sh)
# SWEEPS defaults to 0 1 3 10. Recipes: QCAL_RECIPES (default: the six above, no fine-tuning).
# QCAL_SCALE=row|matrix|auto overrides the QuIP# recipes' scale; QCAL_NO_WIKITEXT=1 skips the
# (slow: about a minute per row at ctx 512) WikiText-2 evaluation.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${QCAL_SHARED_DIR:-../shared}
OUT=${1:-/tmp/qcal-refine-sweeps}
shift || true
SWEEPS=("$@")
[ ${#SWEEPS[@]} -gt 0 ] || SWEEPS=(0 1 3 10)
Q=build/client/qcal
TS="$SHARED/data/tinystories/TinyStories-valid.sample30k.txt"
WT="$SHARED/data/wikitext2/wiki.test.joined.txt"
mkdir -p "$OUT"
ppl() { /usr/bin/python3 -c "import json,sys; print('%.3f' % json.loads(sys.stdin.readlines()[-1])['perplexity'])"; }
echo "| model | recipe | scale | refine_sweeps | TinyStories ppl | WikiText-2 ppl | quantize s |"
echo "|---|---|---|---|---|---|---|"
for model in ${QCAL_MODELS:-stories260K aidreams260K}; do
  ctx=512; [ "$model" = aidreams260K ] && ctx=128
  fdir="$OUT/$model"
  [ -f "$fdir/config.json" ] || $Q import llama2c "$SHARED/models/$model/$model.bin" \
      "$SHARED/models/$model/tok512.bin" --out "$fdir" > /dev/null
  for recipe in ${QCAL_RECIPES:-quip-e8p-2bit quip-e8p-3bit quip-e8p-4bit gptq-2bit gptq-3bit gptq-4bit}; do
    for s in "${SWEEPS[@]}"; do
      r="$OUT/$recipe-${QCAL_SCALE:-}s$s.yaml"
      grep -v '^refine_sweeps:' "jobs/$recipe.yaml" | sed "s/^name: .*/name: $recipe-s$s/" > "$r"
      echo "refine_sweeps: $s" >> "$r"
      if [ -n "${QCAL_SCALE:-}" ] && grep -q '^method: quip' "$r"; then
        grep -v '^scale:' "$r" > "$r.tmp"; echo "scale: $QCAL_SCALE" >> "$r.tmp"; mv "$r.tmp" "$r"
      fi
      dir="$OUT/$model-$recipe-${QCAL_SCALE:-}s$s"
      rm -rf "$dir" "$dir.job"
      t0=$(date +%s%N)
      $Q quantize --recipe "$r" --model "$fdir" --out "$dir" --data-root "$SHARED" > "$dir.log" 2>&1
      qs=$(( ($(date +%s%N) - t0) / 1000000 ))
      ts=$($Q eval --model "$dir" --data "$TS" --ctx $ctx --bos-per-window --json | ppl)
      wt=-
      [ -n "${QCAL_NO_WIKITEXT:-}" ] ||
        wt=$($Q eval --model "$dir" --data "$WT" --ctx $ctx --bos-per-window --json | ppl)
      scale=$(grep '^scale:' "$r" | awk '{print $2}' || true)
      [ -n "$scale" ] || { grep -q '^method: quip' "$r" && scale=row || scale=-; }
      printf "| %s | %s | %s | %s | %s | %s | %d.%01d |\n" "$model" "$recipe" "$scale" "$s" "$ts" "$wt" \
          $((qs / 1000)) $(((qs % 1000) / 100))
    done
  done
done
