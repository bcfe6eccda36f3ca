#!/usr/bin/env bash
# A link planted at any path a job writes is refused, and what it points to is left unchanged
# (issue 51, deliverable 1; common/safe_fs.h).
#
# The paths are not a hand list: a first run of each job records every path it creates or opens
# for writing (QCAL_TRACE_WRITES, traced by common/safe_fs.cc, which every write goes through:
# tests/scripts/no_raw_writes_test.py checks that). Then, for each recorded path below the
# output and job directories (the directories themselves are the user's choice and are resolved
# once, when the job starts), a fresh run finds a symbolic link there, to a canary file (or a
# canary directory, where the job makes a directory). Each run must say "PATH ... is a symbolic
# link" naming the path, and the canary must keep its bytes and its directory its contents.
#   1. `qcal quantize` with gptq-4bit (calibration, Hessians, activation spill with --max-memory
#      1M, staged shards, journal, lock, index, config, tokenizer copies, report), then with
#      quarot-w4a8kv4 (what it adds: sequential block inputs, static activation ranges);
#   2. `qcal run --workers 1` (the coordinator and a worker rank): the paths the first jobs did
#      not write (the workers' log and pid file);
#   3. a model directory whose special_tokens_map.json links to a secret outside it: the job
#      fails naming the file, and no output holds the secret.
# The plants run with --overwrite, so that a link at out/config.json meets the write itself
# rather than the refusal to replace another job's checkpoint (user_messages_test.sh).
# Usage (ctest runs it): job_links_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
shared=${QCAL_SHARED_DIR:-$src/../shared}
q="$build/client/qcal"
work=$(mktemp -d /tmp/qcal-links.XXXXXX)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
recipe="$src/jobs/gptq-4bit.yaml"

"$q" import llama2c "$shared/models/stories260K/stories260K.bin" \
  "$shared/models/stories260K/tok512.bin" --out "$work/model" > /dev/null

canary="$work/canary.txt"
canary_dir="$work/canary-dir"
reset_canaries() {
  printf 'root:x:0:0:canary\n' > "$canary"
  rm -rf "$canary_dir" && mkdir "$canary_dir" && printf 'keep\n' > "$canary_dir/kept"
}
check_canaries() {  # $1: what was planted
  if [ "$(cat "$canary")" != "root:x:0:0:canary" ]; then
    echo "FAIL: the canary file changed through a link at $1:"; head -c 300 "$canary"; exit 1
  fi
  if [ "$(ls -A "$canary_dir")" != "kept" ] || [ "$(cat "$canary_dir/kept")" != "keep" ]; then
    echo "FAIL: the canary directory changed through a link at $1:"; ls -la "$canary_dir"; exit 1
  fi
}

quantize() {  # $1: output directory; the rest: extra flags
  local out=$1; shift
  "$q" quantize --recipe "$recipe" --model "$work/model" --out "$out" --data-root "$shared" \
    --max-memory 1M --overwrite "$@"
}
run_service() {  # $1: output directory
  "$q" run "$recipe" --model "$work/model" --out "$1" --workers 1 --data-root "$shared" \
    --max-memory 1M --no-eval --overwrite --state "$work/state"
}

# The paths a job writes, relative to OUT or JOB ("out/<rel>" or "job/<rel>"), without the
# temporary names of atomic writes (NAME.tmp.PID.N: created with O_EXCL, never through a link).
relative_paths() {  # $1: trace file, $2: OUT
  local out=$2
  grep -v -E '\.tmp\.[0-9]+\.[0-9]+$' "$1" | sort -u | while read -r p; do
    case "$p" in
      "$out.job"/*) echo "job/${p#"$out.job"/}" ;;
      "$out"/*) echo "out/${p#"$out"/}" ;;
    esac
  done | sort -u
}

plant_and_run() {  # $1: runner (quantize|run_service), $2: relative path, $3: a directory?
  local runner=$1 rel=$2 is_dir=$3
  local out="$work/o" target
  rm -rf "$out" "$out.job" "$work/state"
  case "$rel" in job/*) target="$out.job/${rel#job/}" ;; *) target="$out/${rel#out/}" ;; esac
  mkdir -p "$(dirname "$target")"
  reset_canaries
  if [ "$is_dir" = 1 ]; then ln -s "$canary_dir" "$target"; else ln -s "$canary" "$target"; fi
  local log="$work/plant.log" rc=0
  "$runner" "$out" > "$log" 2>&1 || rc=$?
  # The coordinator's own refusals of files it writes beside the job (the workers' pid file) are
  # warnings in its log, since the job goes on without them.
  [ -f "$work/state/coordinator.log" ] && cat "$work/state/coordinator.log" >> "$log"
  check_canaries "$rel"
  if ! grep -F -q "is a symbolic link" "$log" || ! grep -F -q "$target" "$log"; then
    echo "FAIL: a link at $rel (exit $rc) was not refused by name:"; tail -20 "$log"; exit 1
  fi
  if [ "$rc" = 0 ] && ! grep -q -i "warn" "$log"; then
    echo "FAIL: the job with a link at $rel succeeded without a word:"; tail -20 "$log"; exit 1
  fi
  echo "refused: $rel$( [ "$is_dir" = 1 ] && echo /) (exit $rc)"
}

covered=()
# Traces one job ($1: quantize|run_service, with $recipe set), then plants a link at every path
# it wrote that no earlier job covered.
trace_and_plant() {
  local runner=$1 name=$2 t="$work/t-$2" new=0 rel p is_dir
  rm -rf "$t" "$t.job" "$work/state"
  QCAL_TRACE_WRITES="$work/trace-$name" "$runner" "$t" > "$t.log" 2>&1 ||
    { echo "the traced job $name failed:"; tail -20 "$t.log"; exit 1; }
  mapfile -t paths < <(relative_paths "$work/trace-$name" "$t")
  for rel in "${paths[@]}"; do
    printf '%s\n' "${covered[@]}" | grep -F -x -q -- "$rel" && continue
    case "$rel" in job/*) p="$t.job/${rel#job/}" ;; *) p="$t/${rel#out/}" ;; esac
    # A directory the job made (and kept) gets a link to a directory; a file it made and
    # removed again (a spill, a staged copy) is a file.
    is_dir=0; [ -d "$p" ] && is_dir=1
    plant_and_run "$runner" "$rel" "$is_dir"
    covered+=("$rel")
    new=$((new + 1))
  done
  echo "$name: $new more paths refused (of ${#paths[@]} it writes)"
}

# ---- 1. qcal quantize: calibration with spills (gptq), then a sequential method with
#         block inputs and a rotated shard 0 (quarot)
recipe="$src/jobs/gptq-4bit.yaml"
trace_and_plant quantize gptq
recipe="$src/jobs/quarot-w4a8kv4.yaml"
trace_and_plant quantize quarot

# ---- 2. the service: what only the coordinator and its workers write
recipe="$src/jobs/gptq-4bit.yaml"
trace_and_plant run_service service
printf '%s\n' "${covered[@]}" | grep -q -x "job/workers.log" ||
  { echo "FAIL: the service trace has no job/workers.log"; exit 1; }
printf '%s\n' "${covered[@]}" | grep -q -x "job/sequential/inputs-1.safetensors" ||
  { echo "FAIL: the quarot trace has no sequential inputs"; exit 1; }

# ---- 3. a tokenizer file that links out of the model directory
cp -r "$work/model" "$work/model-link"
printf 'SECRET-%s\n' "$RANDOM$RANDOM" > "$work/secret"
rm -f "$work/model-link/special_tokens_map.json"
ln -s "$work/secret" "$work/model-link/special_tokens_map.json"
rc=0
"$q" quantize --recipe "$recipe" --model "$work/model-link" --out "$work/o3" \
  --data-root "$shared" > "$work/o3.log" 2>&1 || rc=$?
if [ "$rc" = 0 ] || ! grep -q "special_tokens_map.json: resolves to .*outside the model directory" \
    "$work/o3.log"; then
  echo "FAIL: a tokenizer file linking out of the model was not refused (exit $rc):"
  tail -10 "$work/o3.log"; exit 1
fi
if grep -r -q -F "$(cat "$work/secret")" "$work/o3" "$work/o3.job" 2>/dev/null; then
  echo "FAIL: the secret was copied into the output"; exit 1
fi
echo "tokenizer copy: a link out of the model directory refused"
echo "job links: every written path refused through a link"
