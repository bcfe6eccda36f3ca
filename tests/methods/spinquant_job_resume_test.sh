#!/usr/bin/env bash
# A spinquant job killed (SIGKILL) during its rotations phase resumes from the last saved training
# state (checkpoint_every: 1 here) and writes the checkpoint an uninterrupted job writes, byte for
# byte. Both jobs journal the phase's training curve (phase_done: 40 losses), and the report each
# writes plots it under the phase's name (the report names no method).
# Usage (ctest runs it): spinquant_job_resume_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
shared=${QCAL_SHARED_DIR:-$src/../shared}
q=$build/client/qcal
work=$(mktemp -d /tmp/qcal-sq-resume.XXXXXX)
trap 'rm -rf "$work"' EXIT
$q import llama2c "$shared/models/stories260K/stories260K.bin" "$shared/models/stories260K/tok512.bin" \
  --out "$work/model" > /dev/null
sed -e 's/num_sequences: 128/num_sequences: 16/' -e 's/steps: 100 .*/steps: 40/' \
    -e 's/checkpoint_every: 10 .*/checkpoint_every: 1/' "$src/jobs/spinquant-w4a4kv4.yaml" \
    > "$work/recipe.yaml"
run() { $q --log-level info quantize --recipe "$work/recipe.yaml" --model "$work/model" --out "$1" \
          --data-root "$shared" > "$1.log" 2>&1; }
run "$work/whole"
# The interrupted job: killed once its training has saved a state a few steps in.
$q --log-level info quantize --recipe "$work/recipe.yaml" --model "$work/model" \
  --out "$work/cut" --data-root "$shared" > "$work/cut.first.log" 2>&1 &
pid=$!
state="$work/cut.job/phases/rotations.state.safetensors"
for _ in $(seq 1 600); do
  [ -f "$state.fnv1a64" ] && grep -q "step 5/40" "$work/cut.first.log" && break
  sleep 0.1
done
kill -9 $pid 2>/dev/null || true
wait $pid 2>/dev/null || true
if [ -f "$work/cut.job/phases/rotations.safetensors" ]; then
  echo "FAIL: the job finished its training before it was killed"; exit 1
fi
[ -f "$state" ] || { echo "FAIL: no saved training state to resume from"; exit 1; }
run "$work/cut"
grep -q "resuming at step" "$work/cut.log" || { echo "FAIL: the rerun did not resume"; cat "$work/cut.log"; exit 1; }
grep -o "resuming at step [0-9]* of 40" "$work/cut.log"
for f in $(cd "$work/whole" && ls | sort); do
  cmp -s "$work/whole/$f" "$work/cut/$f" || { echo "FAIL: $f differs from the uninterrupted job's"; exit 1; }
done
echo "resumed job: $(ls "$work/whole" | wc -l) files identical to the uninterrupted job's"
for j in whole cut; do
  /usr/bin/python3 - "$work/$j.job/journal.jsonl" <<'PY' || exit 1
import json, sys
done = [json.loads(l) for l in open(sys.argv[1]) if '"phase_done"' in l]
if not done or done[-1]["phase"] != "rotations" or len(done[-1]["losses"]) != 40:
    sys.exit(f"FAIL: {sys.argv[1]}: no phase_done of 'rotations' with 40 losses: {done}")
print(f"{sys.argv[1]}: phase_done 'rotations', {len(done[-1]['losses'])} losses")
PY
  grep -q 'id="training-rotations"' "$work/$j.job/report.html" \
    || { echo "FAIL: $j.job/report.html plots no training of the 'rotations' phase"; exit 1; }
done
