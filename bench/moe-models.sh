# Sourced by bench/moe-upcycle.sh and bench/moe-quantize.sh (from the repository root, WORK set):
# the upcycled stories260K models of issue 53's measurements. Sets SHARED, NOISE, MAX_TOKENS, Q,
# ts / wt (the TinyStories sample and WikiText-2 test), dense (stories260K imported into
# WORK/dense) and MOE_MODELS (the layouts' names); `upcycle NAME` makes WORK/NAME once, every
# expert a copy of its block's MLP with NOISE relative Gaussian noise (seed 1): Mixtral layout,
# 4 experts, top 2; Llama 4 layout, 4 experts, top 1, half of each MLP in the shared expert and
# half routed through sigmoid-scaled inputs, router rows scaled by 16 (MoE on every layer).
SHARED=${QCAL_SHARED_DIR:-../shared}
NOISE=${NOISE:-0.05}
MAX_TOKENS=${MAX_TOKENS:-40000}
Q=${QCAL_BIN:-build/client/qcal}
ts="$SHARED/data/tinystories/TinyStories-valid.sample30k.txt"
wt="$SHARED/data/wikitext2/wiki.test.joined.txt"
mkdir -p "$WORK"
dense="$WORK/dense"
[ -f "$dense/config.json" ] || $Q import llama2c "$SHARED/models/stories260K/stories260K.bin" \
    "$SHARED/models/stories260K/tok512.bin" --out "$dense" > /dev/null
MOE_MODELS=(mixtral-4x-top2 llama4-4x-top1)
declare -A MOE_ARGS=(
  [mixtral-4x-top2]="--layout mixtral --experts 4 --top-k 2"
  [llama4-4x-top1]="--layout llama4 --experts 4 --top-k 1 --shared-scale 0.5 --router-scale 16"
)
upcycle() {  # NAME -> WORK/NAME
  [ -f "$WORK/$1/config.json" ] || /usr/bin/python3 tests/reference/moe_reference.py upcycle \
      --dense "$dense" --out "$WORK/$1" --noise "$NOISE" --seed 1 ${MOE_ARGS[$1]}
}
