#!/usr/bin/env bash
# A spinquant job killed (SIGKILL) during its rotations phase resumes from the last saved training
# state (checkpoint_every: 1 here) and writes the checkpoint an uninterrupted job writes, byte for
# byte. Usage (ctest runs it): spinquant_job_resume_test.sh SOURCE_DIR BUILD_DIR
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
