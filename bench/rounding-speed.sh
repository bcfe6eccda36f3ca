#!/usr/bin/env bash
# Issue 13's CPU speed goals in one run, side by side (after scripts/build.sh): BlockLDLQ-E8P,
# LDLQ and GPTQ time ÷ one dense fp32 sgemm of the same shape (every core) at 4096 × 4096,
# 4096 × 11008 and 28672 × 8192 (Llama-2-70B gate/up_proj), and the exact fixed-point Hessian
# accumulation's time ÷ LibTorch's fp32 matmul for 128- and 2048-token sequences. Prints a
# markdown table. About 12 minutes on a 2-core machine (the 70B shape dominates; it needs about
# 6 GB). Do not run it beside a build or another benchmark: only ratios from one quiet run mean
# anything.
#   bash bench/rounding-speed.sh [BUILD_DIR]
# QCAL_SHAPES='4096/n:4096' restricts the rounding shapes (a bench_rounding filter fragment).
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-build}
SHAPES=${QCAL_SHAPES:-'4096/n:4096|4096/n:11008|28672/n:8192'}
json=$(mktemp)
trap 'rm -f "$json"' EXIT
"$B/bench/bench_rounding" --benchmark_format=json --benchmark_out="$json" \
  --benchmark_filter="BM_Sgemm/m:($SHAPES)/|BM_BlockLdlq/m:($SHAPES)/e8p:1/sweeps:0/|BM_Ldlq/m:($SHAPES)/|BM_Gptq/m:($SHAPES)/act_order:0/" \
  > /dev/null
/usr/bin/python3 - "$json" <<'EOF'
import json, re, sys
rows = {}
shapes = []
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    m = re.match(r"BM_(\w+)/m:(\d+)/n:(\d+)", b["name"])
    kind, shape = m.group(1), f"{m.group(2)} × {m.group(3)}"
    if shape not in shapes:
        shapes.append(shape)
    rows.setdefault(kind, {})[shape] = b
print("| × one fp32 sgemm (every core) | " + " | ".join(shapes) + " |")
print("|---|" + "---|" * len(shapes))
print("| sgemm, s | " + " | ".join("%.2f" % rows["Sgemm"][s]["sgemm_s"] for s in shapes) + " |")
for kind, label in [("BlockLdlq", "BlockLDLQ E8P, no sweeps (goal ≤ 3×)"),
                    ("Ldlq", "LDLQ 4-bit per channel"), ("Gptq", "GPTQ 4-bit per channel")]:
    print(f"| {label} | " + " | ".join("%.2f×" % rows[kind][s]["x_sgemm"] for s in shapes) + " |")
EOF
echo
echo "| Hessian accumulation | n | fixed GFLOP/s | matmul GFLOP/s | time of matmul ÷ time of fixed (goal ≥ 80%) |"
echo "|---|---|---|---|---|"
for spec in "2048 128" "4096 2048"; do
  set -- $spec
  "$B/bench/bench_quant_block" --tokens "$1" --seq "$2" |
    awk -v seq="$2" '$1 ~ /^[0-9]+$/ { printf "| %s-token sequences | %s | %s | %s | %s |\n", seq, $1, $2, $4, $5 }'
done
