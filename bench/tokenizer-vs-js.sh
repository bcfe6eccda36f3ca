#!/usr/bin/env bash
# Llama 3 tokenizer.json encoding speed, single-threaded, qcal beside the independent JS tokenizer
# llama3-tokenizer-js 1.2.0 (node, fetched by scripts/llama3-reference-ids.mjs --bench) on the
# same file (default: WikiText-2 test, joined), each the best of 5 runs, measured one after the
# other in this run. Prints both and the ratio.
#
#   bash bench/tokenizer-vs-js.sh [FILE]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHARED="${QCAL_SHARED_DIR:-$ROOT/../shared}"
FILE="${1:-$SHARED/data/wikitext2/wiki.test.joined.txt}"
ninja -C "$ROOT/build" bench_tokenizer > /dev/null
qcal=$("$ROOT/build/bench/bench_tokenizer" "$SHARED/models/llama3-tokenizer/tokenizer.json" "$FILE" 5)
js=$(cd "$ROOT" && QCAL_BENCH_FILE="$FILE" node scripts/llama3-reference-ids.mjs --bench 2>/dev/null)
echo "qcal: $qcal"
echo "js:   $js"
python3 - "$qcal" "$js" <<'PY'
import json, sys
q, j = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert q["tokens"] == j["tokens"], f"token counts differ: qcal {q['tokens']} vs js {j['tokens']}"
mb = q["bytes"] / 1e6
print(f"{q['tokens']} tokens from {q['bytes']} bytes: qcal {q['best_ms']:.0f} ms ({mb / q['best_ms'] * 1e3:.1f} MB/s), "
      f"js {j['best_ms']:.0f} ms ({mb / j['best_ms'] * 1e3:.1f} MB/s); qcal is {j['best_ms'] / q['best_ms']:.1f}x faster")
PY
