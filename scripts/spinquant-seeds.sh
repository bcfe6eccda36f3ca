#!/usr/bin/env bash
# Learned against Hadamard rotations over the rotation seed (docs/results.md, "SpinQuant", "Over
# rotation seeds"). QuaRot's R1/R2 are random Hadamards (random signs from rotation.seed), and a
# random rotation's quality varies a lot with its draw; SpinQuant's learned rotations start from
# that same draw (or the identity, init: best). One seed compares one draw; this compares both
# methods over SEEDS, each seed's jobs identical but for rotation.seed:
#   for each model (and its outlier-planted variant, as scripts/spinquant-results.sh), setting
#   and seed: jobs/quarot-SETTING.yaml and jobs/spinquant-SETTING.yaml with rotation.seed = seed,
#   `qcal quantize --threads 1`, then `qcal eval --reference FLOAT --bos-per-window` on the
#   TinyStories sample (512-token windows; aidreams260K: 128).
# Output: OUT_DIR/seeds.jsonl (one line per job) and a table per (model, setting): the mean and
# the sample standard deviation of KL(float || quantized) over the seeds for each method, the mean
# of the paired difference learned - Hadamard with its standard error, and in how many seeds
# learned is lower. JOBS jobs run at once (default 2), each on one thread.
#   bash scripts/spinquant-seeds.sh [BUILD_DIR] [OUT_DIR]
#   env: MODELS ("stories260K aidreams260K"), VARIANTS ("plain planted"), SETTINGS ("w4a4kv4
#   w4a8kv4 w4a16"), SEEDS ("0 1 2 3 4 5 6 7"), JOBS (2), LEARNED_RECIPES (jobs: where
#   spinquant-SETTING.yaml is read from, to compare a variant), KEEP (1: keep OUT_DIR/seeds.jsonl
#   and skip the jobs it has)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=$(realpath -m "${2:-out/spinquant-seeds}")
SHARED=$(realpath "${QCAL_SHARED_DIR:-../shared}")
Q=$(realpath "$BUILD/client/qcal")
TS="$SHARED/data/tinystories/TinyStories-valid.sample30k.txt"
MODELS=${MODELS:-"stories260K aidreams260K"}
VARIANTS=${VARIANTS:-"plain planted"}
SETTINGS=${SETTINGS:-"w4a4kv4 w4a8kv4 w4a16"}
SEEDS=${SEEDS:-"0 1 2 3 4 5 6 7"}
JOBS=${JOBS:-2}
LEARNED_RECIPES=${LEARNED_RECIPES:-jobs}
mkdir -p "$OUT/q" "$OUT/recipes"

# One job: quantize, evaluate, append a JSON line (flock: JOBS of them write at once). A job
# whose line is already there (KEEP=1, a rerun after an interruption) is skipped.
run_one() {
  local variant=$1 recipe=$2 label=$3 setting=$4 method=$5 seed=$6 ctx=$7
  local out="$OUT/q/$label"
  local key="{\"model\":\"$(basename "$variant")\",\"setting\":\"$setting\",\"method\":\"$method\",\"seed\":$seed,"
  grep -qF "$key" "$OUT/seeds.jsonl" && return 0
  rm -rf "$out" "$out.job"
  "$Q" --log-level info quantize --recipe "$recipe" --model "$variant" --out "$out" \
    --data-root "$SHARED" --threads 1 > "$out.log" 2>&1 || { echo "$label: quantize failed" >&2; return 1; }
  local j
  j=$("$Q" eval --model "$out" --reference "$variant" --data "$TS" --ctx "$ctx" --bos-per-window \
    --threads 1 --json | tail -1)
  [ -n "$j" ] || { echo "$label: eval failed" >&2; return 1; }
  rm -rf "$out" "$out.job"
  flock "$OUT/seeds.jsonl" -c "echo '$key\"eval\":$j}' >> '$OUT/seeds.jsonl'"
}
export -f run_one
export Q OUT SHARED TS

[ "${KEEP:-0}" = 1 ] || : > "$OUT/seeds.jsonl"
: > "$OUT/tasks"
for m in $MODELS; do
  base="$OUT/$m"
  [ -f "$base/config.json" ] || "$Q" import llama2c "$SHARED/models/$m/$m.bin" \
      "$SHARED/models/$m/tok512.bin" --out "$base" > /dev/null
  [ -f "$base-planted/config.json" ] || "$Q" tool plant-outliers --model "$base" \
      --out "$base-planted" --alpha 50 --beta 50 > /dev/null
  ctx=$(/usr/bin/python3 -c "import json,sys; print(min(512, json.load(open(sys.argv[1]))['max_position_embeddings']))" "$base/config.json")
  for v in $VARIANTS; do
    variant=$base; [ "$v" = planted ] && variant=$base-planted
    for s in $SETTINGS; do
      for method in quarot spinquant; do
        for seed in $SEEDS; do
          recipe="$OUT/recipes/$method-$s-seed$seed.yaml"
          # rotation.seed is the only difference to the shipped recipe.
          src="jobs/$method-$s.yaml"
          [ "$method" = spinquant ] && src="$LEARNED_RECIPES/$method-$s.yaml"
          sed -E "s/^(rotation: \{.*seed: )0\}/\1$seed}/" "$src" > "$recipe"
          grep -qE "^rotation: \{.*seed: $seed\}" "$recipe" || {
            echo "spinquant-seeds: could not set rotation.seed in $src" >&2; exit 1; }
          echo "$variant $recipe $(basename "$variant")-$method-$s-seed$seed $s $method $seed $ctx" \
            >> "$OUT/tasks"
        done
      done
    done
  done
done
# Longest first (spinquant), so the parallel jobs finish together.
sort -k5,5r -s "$OUT/tasks" | xargs -P "$JOBS" -L 1 bash -c 'run_one "$@" && echo "$2 $3 done" >&2' _  ||
  echo "spinquant-seeds: some jobs failed (above); their rows are missing" >&2

/usr/bin/python3 - "$OUT/seeds.jsonl" <<'PY'
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
kl, ppl = {}, {}
for r in rows:
    kl[(r["model"], r["setting"], r["method"], r["seed"])] = r["eval"]["mean_kl"]
    ppl[(r["model"], r["setting"], r["method"], r["seed"])] = r["eval"]["perplexity"]
def stats(xs):
    n = len(xs); m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else float("nan")
    return m, sd
print("| model | setting | seeds | Hadamard KL: mean ± sd | learned KL: mean ± sd | learned − Hadamard: mean ± s.e. | learned lower | ppl, mean: Hadamard / learned |")
print("|---|---|---|---|---|---|---|---|")
keys = list(dict.fromkeys((r["model"], r["setting"]) for r in rows))
for m, s in keys:
    seeds = sorted({r["seed"] for r in rows if r["model"] == m and r["setting"] == s})
    seeds = [x for x in seeds if (m, s, "quarot", x) in kl and (m, s, "spinquant", x) in kl]
    if not seeds:
        continue
    h = [kl[(m, s, "quarot", x)] for x in seeds]
    l = [kl[(m, s, "spinquant", x)] for x in seeds]
    d = [b - a for a, b in zip(h, l)]
    hm, hs = stats(h); lm, ls = stats(l); dm, ds = stats(d)
    wins = sum(1 for x in d if x < 0)
    hp = sum(ppl[(m, s, "quarot", x)] for x in seeds) / len(seeds)
    lp = sum(ppl[(m, s, "spinquant", x)] for x in seeds) / len(seeds)
    print("| %s | %s | %d | %.4f ± %.4f | %.4f ± %.4f | %+.4f ± %.4f | %d of %d | %.2f / %.2f |" % (
        m, s.upper(), len(seeds), hm, hs, lm, ls, dm, ds / math.sqrt(len(seeds)), wins, len(seeds),
        hp, lp))
PY
