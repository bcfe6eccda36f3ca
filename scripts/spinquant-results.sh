#!/usr/bin/env bash
# Learned-rotation table (docs/results.md, "SpinQuant"): on stories260K and aidreams260K and their
# outlier-planted variants (qcal tool plant-outliers --alpha 50 --beta 50, as the QuaRot table),
# for W4A4KV4, W4A8KV4 and W4A16: no rotation (jobs/*-norot.yaml), QuaRot's Hadamards
# (jobs/quarot-*.yaml) and learned R1/R2 (jobs/spinquant-*.yaml), each run as a job (`qcal
# quantize`, one process, one thread) with the recipe's calibration (128 x 128 WikiText-2-valid
# tokens), then `qcal eval --reference FLOAT --bos-per-window` on the TinyStories sample (512-token
# windows; aidreams260K: its 128): perplexity and mean KL(float || quantized) per token. For the
# spinquant rows the training time and the mean training loss of the first and last 10 steps
# come from the job's log.
#   bash scripts/spinquant-results.sh [BUILD_DIR] [OUT_DIR]   (OUT_DIR/results.jsonl + a table)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=${2:-out/spinquant-results}
SHARED=${QCAL_SHARED_DIR:-../shared}
Q=$BUILD/client/qcal
TS="$SHARED/data/tinystories/TinyStories-valid.sample30k.txt"
MODELS=${MODELS:-"stories260K aidreams260K"}
SETTINGS=${SETTINGS:-"w4a4kv4 w4a8kv4 w4a16"}
mkdir -p "$OUT/q"
[ "${KEEP:-0}" = 1 ] || : > "$OUT/results.jsonl"
for m in $MODELS; do
  base="$OUT/$m"
  [ -f "$base/config.json" ] || $Q import llama2c "$SHARED/models/$m/$m.bin" \
      "$SHARED/models/$m/tok512.bin" --out "$base" > /dev/null
  [ -f "$base-planted/config.json" ] || $Q tool plant-outliers --model "$base" \
      --out "$base-planted" --alpha 50 --beta 50 > /dev/null
  ctx=$(/usr/bin/python3 -c "import json,sys; print(min(512, json.load(open(sys.argv[1]))['max_position_embeddings']))" "$base/config.json")
  for variant in "$base" "$base-planted"; do
    label=$(basename "$variant")
    for s in $SETTINGS; do
      for r in $s-norot quarot-$s spinquant-$s; do
        out="$OUT/q/$label-$r"
        rm -rf "$out" "$out.job"
        t0=$(date +%s.%N)
        $Q --log-level info quantize --recipe "jobs/$r.yaml" --model "$variant" --out "$out" \
          --data-root "$SHARED" --threads 1 > "$out.log" 2>&1
        t1=$(date +%s.%N)
        j=$($Q eval --model "$out" --reference "$variant" --data "$TS" --ctx $ctx \
          --bos-per-window --json | tail -1)
        train=$(/usr/bin/python3 - "$out.log" <<'PY'
import re, sys, datetime, json
lines = open(sys.argv[1]).read().splitlines()
ts = lambda l: datetime.datetime.strptime(l[1:24], "%Y-%m-%d %H:%M:%S.%f")
start = next((l for l in lines if "rotation training step 1/" in l), None)
end = next((l for l in lines if "rotations phase:" in l), None)
if not start or not end:
    print("null"); sys.exit()
m = re.search(r"steps: ([0-9.]+) / ([0-9.]+)", end)
# the first step's line is logged after that step: add one step's share
n = int(re.search(r"rotations phase: (\d+) steps", end).group(1))
secs = (ts(end) - ts(start)).total_seconds() * n / max(n - 1, 1)
print(json.dumps({"seconds": round(secs, 2), "first10": float(m.group(1)), "last10": float(m.group(2))}))
PY
)
        echo "{\"model\":\"$label\",\"setting\":\"$s\",\"recipe\":\"$r\",\"quantize_s\":$(printf %.2f "$(echo "$t1 - $t0" | bc)"),\"training\":$train,\"eval\":$j}" \
          >> "$OUT/results.jsonl"
        echo "$label $r done" >&2
      done
    done
  done
done
/usr/bin/python3 - "$OUT/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| model | setting | no rotation: ppl / KL | Hadamard (QuaRot): ppl / KL | learned (SpinQuant): ppl / KL | training: s, loss first → last 10 steps | job s (norot / Hadamard / learned) |")
print("|---|---|---|---|---|---|---|")
keys = list(dict.fromkeys((r["model"], r["setting"]) for r in rows))
for m, s in keys:
    get = lambda prefix: next((r for r in rows if r["model"] == m and r["setting"] == s and r["recipe"].startswith(prefix)), None)
    n, h, l = get(s + "-norot") or get(s), get("quarot-"), get("spinquant-")
    cell = lambda r: "%.2f / %.4f" % (r["eval"]["perplexity"], r["eval"]["mean_kl"]) if r else ""
    best = min((x for x in (n, h, l) if x), key=lambda r: r["eval"]["mean_kl"])
    c = [cell(x) if x is not best else "**" + cell(x) + "**" for x in (n, h, l)]
    t = l["training"] if l else None
    tr = "%.1f s, %.3f → %.3f" % (t["seconds"], t["first10"], t["last10"]) if t else ""
    print("| %s | %s | %s | %s | %s | %s | %s |" % (m, s.upper(), c[0], c[1], c[2], tr,
          " / ".join("%.0f" % x["quantize_s"] for x in (n, h, l) if x)))
PY
