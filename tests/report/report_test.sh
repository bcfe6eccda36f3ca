#!/usr/bin/env bash
# Issue 40: the job report, checked the way a person would look at it — rendered in a browser.
#  * A fine-tuning job (quip-e8p-2bit-ft on stories260K) writes JOB/report.html when it finishes.
#  * `qcal report OUT --eval TEXT` rewrites it with perplexity and KL against the float model;
#    the numbers on the page are the ones it printed.
#  * Headless Chromium loads the page; the page's own script measures, after layout, how many
#    data marks each plot has and how many have a non-empty box (<body data-plot-check>): every
#    plot a fine-tuning job must show (proxy loss by linear, block error before/after
#    fine-tuning, the fine-tuning curves, time per phase and per block, peak memory per rank) is
#    present, and all its marks are drawn.
#  * A screenshot is taken (a PNG of the page's size, not blank); with QCAL_REPORT_SCREENSHOT=PATH
#    it is kept there (docs/report.png is made so).
#  * Bad input: a directory that is neither a job nor an output directory is refused, naming it.
# Usage (ctest runs it): report_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
shared=${QCAL_SHARED_DIR:-$src/../shared}
q="$build/client/qcal"
py=/usr/bin/python3
work=$(mktemp -d /tmp/qcal-report.XXXXXX)
trap 'rm -rf "$work"' EXIT
data="$shared/data/tinystories/TinyStories-valid.sample30k.txt"
browser=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$browser" ]; then
  echo "FAIL: no chromium (scripts/install-deps.sh installs it): the report cannot be rendered"
  exit 1
fi
render() {  # render FLAGS... URL: headless Chromium, no sandbox (CI runs as root), no GPU
  timeout 120 "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars "$@" 2>/dev/null
}

"$q" import llama2c "$shared/models/stories260K/stories260K.bin" \
  "$shared/models/stories260K/tok512.bin" --out "$work/model" > /dev/null
"$q" quantize --recipe "$src/jobs/quip-e8p-2bit-ft.yaml" --model "$work/model" --out "$work/q2ft" \
  --data-root "$shared" --threads 1 > "$work/quantize.log" 2>&1 || { cat "$work/quantize.log"; exit 1; }

fail=0
ok() { echo "ok   $*"; }
bad() { echo "FAIL $*"; fail=1; }

page="$work/q2ft.job/report.html"
[ -s "$page" ] && ok "the finished job wrote $page" || bad "no report at the end of the job"

"$q" report "$work/q2ft" --eval "$data" --ctx 256 --bos-per-window --threads 1 --json \
  > "$work/report.json" 2> "$work/report.err" || { cat "$work/report.err"; exit 1; }
"$py" - "$work/report.json" "$page" <<'EOF' || fail=1
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
page = open(sys.argv[2]).read()
e = r["evals"][0]
want = ["%.6g" % e["reference_perplexity"], "%.6g" % e["perplexity"], "%.4g" % e["mean_kl"]]
missing = [w for w in want if "<td>%s</td>" % w not in page]
if r["report"] != sys.argv[2] or missing:
    print("FAIL report --eval: page", r["report"], "lacks", missing)
    sys.exit(1)
print("ok   report --eval: float ppl %s, quantized %s, KL %s on the page" % tuple(want))
EOF

render --dump-dom "file://$page" > "$work/dom.html" || true
"$py" - "$work/dom.html" <<'EOF' || fail=1
import re, sys
dom = open(sys.argv[1]).read()
m = re.search(r'data-plot-check="([^"]*)"', dom)
if not m:
    print("FAIL the browser did not run the page's plot check (no data-plot-check)")
    sys.exit(1)
plots = {}
for item in m.group(1).split():
    name, marks, shown = item.rsplit(":", 2)
    plots[name] = (int(marks), int(shown))
want = ["proxy-loss", "block-mse", "ft-heldout", "ft-train", "time-phase", "time-block",
        "memory-rank"]
bad = [w for w in want if w not in plots or plots[w][0] == 0 or plots[w][1] != plots[w][0]]
for name in want:
    print("  ", name, "marks %d, drawn %d" % plots.get(name, (0, 0)))
if bad:
    print("FAIL plots missing, empty or not drawn:", bad)
    sys.exit(1)
print("ok   %d plots rendered by the browser, every data mark drawn" % len(plots))
EOF

shot=${QCAL_REPORT_SCREENSHOT:-$work/report.png}
render --screenshot="$shot" --window-size=1400,2100 "file://$page" || true
"$py" - "$shot" <<'EOF' || fail=1
import struct, sys, zlib
data = open(sys.argv[1], "rb").read()
assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
w, h = struct.unpack(">II", data[16:24])
# The image data: a page of one color compresses to almost nothing.
idat = b"".join(data[i + 8:i + 8 + struct.unpack(">I", data[i:i + 4])[0]]
                for i in range(8, len(data) - 12) if data[i + 4:i + 8] == b"IDAT")
raw = zlib.decompress(idat)
distinct = len(set(raw[::97]))
if w != 1400 or h != 2100 or distinct < 8:
    print("FAIL screenshot: %dx%d, %d distinct sampled bytes" % (w, h, distinct))
    sys.exit(1)
print("ok   screenshot %dx%d, %d bytes, not blank" % (w, h, len(data)))
EOF

mkdir -p "$work/empty"
if msg=$("$q" report "$work/empty" 2>&1); then
  bad "a directory without a journal was reported"
elif [[ "$msg" != *"$work/empty"*"neither a job directory"* ]]; then
  bad "refusal does not name the directory: $msg"
else
  ok "refused: $msg"
fi
exit $fail
