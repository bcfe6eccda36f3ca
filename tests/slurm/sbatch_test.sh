#!/usr/bin/env bash
# Issue 14 on a local Slurm cluster (slurm/local-cluster.sh: 2 emulated nodes): the CPU sbatch
# template from `qcal slurm-script --cpu` quantizes stories260K with 2 nodes x 2 ranks (workers as
# one srun --mpi=pmix step), and
#   1. QuIP# 2-bit and a fine-tuning recipe: output byte-identical to `qcal quantize`;
#   2. the fine-tuning job requeued mid-way (`scontrol requeue`) resumes by itself to the same
#      bytes;
#   3. the same job signalled as before its time limit (`scancel --batch -s USR1`) stops, requeues
#      itself and resumes to the same bytes;
# in 2 and 3 no block finished before the interruption is quantized again (the journal holds
# one block_done per block);
#   4. a long-running qcal-coordinator --launcher slurm (outside any allocation) submits a job's
#      workers as their own Slurm job: same bytes; `qcal cancel` of a running job leaves no Slurm
#      job and no worker process behind;
#   5. an unprivileged user submits the template itself: the job runs under that user's uid in
#      its own allocation and every output file is that user's (skipped, saying so, where no
#      user can be made).
# The cluster lives under BUILD/slurm-test and is torn down at exit.
# Usage (ctest runs it, label slurm): sbatch_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
shared=${QCAL_SHARED_DIR:-$src/../shared}
q="$build/client/qcal"
cluster="$build/slurm-test/cluster"
work="$build/slurm-test/work"
rm -rf "$work"
mkdir -p "$work"
unset QCAL_NUM_THREADS OPENBLAS_NUM_THREADS OMP_NUM_THREADS

cleanup() {
  bash "$src/slurm/local-cluster.sh" down "$cluster" > /dev/null 2>&1 || true
}
trap cleanup EXIT
bash "$src/slurm/local-cluster.sh" up "$cluster" --nodes 2 --cpus 2
eval "$(bash "$src/slurm/local-cluster.sh" env "$cluster")"
export QCAL_ADVERTISE_HOST=127.0.0.1  # the emulated nodes' names do not resolve

"$q" import llama2c "$shared/models/stories260K/stories260K.bin" \
  "$shared/models/stories260K/tok512.bin" --out "$work/model" > /dev/null
cp "$src/jobs/quip-e8p-2bit.yaml" "$work/quip2.yaml"
sed -e 's/^name: quip-e8p-2bit-ft/name: quip-e8p-2bit-ft-small/' \
    -e 's/num_sequences: 128/num_sequences: 32/' "$src/jobs/quip-e8p-2bit-ft.yaml" > "$work/ft.yaml"
grep -q 'num_sequences: 32' "$work/ft.yaml" || { echo "could not shorten the ft recipe"; exit 2; }

fail=0
compare() {  # compare REF OUT LABEL
  local ref=$1 out=$2 label=$3 bad=0
  if ! diff <(cd "$ref" && ls | sort) <(cd "$out" && ls | sort) > /dev/null; then
    echo "FAIL $label: file sets differ: $(cd "$ref" && ls | tr '\n' ' ') vs $(cd "$out" && ls | tr '\n' ' ')"
    bad=1
  fi
  for f in "$ref"/*; do
    cmp -s "$f" "$out/$(basename "$f")" || { echo "FAIL $label: $(basename "$f") differs"; bad=1; }
  done
  [ $bad -eq 0 ] && echo "ok   $label: $(ls "$ref" | wc -l) files byte-identical to qcal quantize"
  return $bad
}
job_state() { scontrol show job "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' | head -1; }
wait_job_end() {  # wait_job_end JOBID TIMEOUT_S: until COMPLETED/FAILED/...; prints the state
  local id=$1 limit=$2 s
  for _ in $(seq 1 $((limit * 5))); do
    s=$(job_state "$id")
    case $s in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE) echo "$s"; return 0 ;; esac
    sleep 0.2
  done
  echo "STILL-$(job_state "$id")"
}
journal() {  # journal OUT: "BLOCKS_DONE DUPLICATES JOB_STARTS" from OUT.job/journal.jsonl
  /usr/bin/python3 - "$1.job/journal.jsonl" <<'PY'
import collections, json, sys
try:
    lines = open(sys.argv[1]).read().splitlines()
except OSError:
    lines = []
events = []
for l in lines:
    try:
        events.append(json.loads(l))
    except ValueError:
        pass  # a line being written
done = collections.Counter(e["layer"] for e in events if e.get("event") == "block_done")
dups = sum(1 for n in done.values() if n > 1)
print(sum(done.values()), dups, sum(1 for e in events if e.get("event") == "job_start"))
PY
}
blocks_done() { journal "$1" | cut -d' ' -f1; }
check_no_redo() {  # every block journaled exactly once
  local label=$2 n dups starts
  read -r n dups starts < <(journal "$1")
  if [ "$dups" != 0 ]; then echo "FAIL $label: $dups block(s) quantized twice"; return 1; fi
  echo "ok   $label: $n blocks journaled once each over $starts job start(s)"
}
script_for() {  # script_for RECIPE OUT SCRIPT
  "$q" slurm-script --cpu --recipe "$1" --model "$work/model" --out "$2" --nodes 2 \
    --ranks-per-node 2 --cpus-per-rank 1 --time 30 --data-root "$shared" -o "$3" > /dev/null
}

for recipe in quip2 ft; do
  "$q" quantize --recipe "$work/$recipe.yaml" --model "$work/model" --out "$work/$recipe-ref" \
    --data-root "$shared" > "$work/$recipe-ref.log" 2>&1 \
    || { echo "qcal quantize $recipe failed:"; tail -5 "$work/$recipe-ref.log"; exit 1; }
done

# 1. Uninterrupted runs.
for recipe in quip2 ft; do
  out="$work/$recipe-slurm"
  script_for "$work/$recipe.yaml" "$out" "$work/$recipe.sbatch"
  t0=$(date +%s.%N)
  id=$(sbatch --parsable "$work/$recipe.sbatch")
  state=$(wait_job_end "$id" 900)
  t1=$(date +%s.%N)
  if [ "$state" != COMPLETED ]; then
    echo "FAIL sbatch $recipe: job $id ended $state; its log:"; tail -30 "$out".slurm-*.log; fail=1; continue
  fi
  echo "     sbatch $recipe: job $id $state in $(printf '%.1f' "$(echo "$t1 - $t0" | bc)") s"
  compare "$work/$recipe-ref" "$out" "sbatch $recipe (2 nodes x 2 ranks)" || fail=1
done

# 2, 3. Interrupted mid-way (after the first finished block; the fine-tuning recipe, whose blocks
# take seconds): requeue, and USR1 as before the time limit.
for how in requeue usr1; do
  out="$work/ft-$how"
  script_for "$work/ft.yaml" "$out" "$work/ft-$how.sbatch"
  id=$(sbatch --parsable "$work/ft-$how.sbatch")
  for _ in $(seq 1 30000); do
    grep -q '"event":"block_done"' "$out.job/journal.jsonl" 2>/dev/null && break
    sleep 0.02
  done
  before=$(blocks_done "$out")
  if [ "$how" = requeue ]; then scontrol requeue "$id"; else scancel --batch -s USR1 "$id"; fi
  echo "     $how: job $id interrupted with $before block(s) journaled"
  # The restarted script appends to the same log; wait for the restart to finish.
  for _ in $(seq 1 1500); do
    [ "$(scontrol show job "$id" 2>/dev/null | sed -n 's/.*Restarts=\([0-9]*\).*/\1/p')" -ge 1 ] 2>/dev/null && break
    sleep 0.2
  done
  state=$(wait_job_end "$id" 900)
  restarts=$(scontrol show job "$id" | sed -n 's/.*Restarts=\([0-9]*\).*/\1/p')
  if [ "$state" != COMPLETED ]; then
    echo "FAIL $how: job $id ended $state after $restarts restart(s); its log:"
    tail -40 "$out".slurm-*.log; fail=1; continue
  fi
  echo "     $how: job $id $state after $restarts restart(s)"
  [ "$restarts" -ge 1 ] || { echo "FAIL $how: the job was never restarted"; fail=1; }
  compare "$work/ft-ref" "$out" "sbatch ft after $how" || fail=1
  total=$(journal "$out" | cut -d' ' -f1)
  [ "$before" -lt "$total" ] || { echo "FAIL $how: every block was done before the interruption"; fail=1; }
  check_no_redo "$out" "$how" || fail=1
  [ "$before" -ge 1 ] || { echo "FAIL $how: no block was finished before the interruption"; fail=1; }
done

# 4. The coordinator's Slurm launcher.
coord_state="$work/coord-state"
mkdir -p "$coord_state"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$coord_state/token"
chmod 600 "$coord_state/token"
"$build/coordinator/qcal-coordinator" --listen 127.0.0.1:0 --state "$coord_state" \
  --auth-token-file "$coord_state/token" --address-file "$coord_state/address" \
  --launcher slurm --slurm-ranks-per-node 2 --slurm-cpus-per-rank 1 --slurm-poll 0.5 \
  > "$coord_state/out.log" 2>&1 &
coord_pid=$!
trap 'kill $coord_pid 2>/dev/null; wait $coord_pid 2>/dev/null; cleanup' EXIT
for _ in $(seq 1 100); do [ -s "$coord_state/address" ] && break; sleep 0.1; done
export QCAL_COORDINATOR=$(cat "$coord_state/address") QCAL_AUTH_TOKEN_FILE="$coord_state/token"
out="$work/quip2-launcher"
if "$q" submit "$work/quip2.yaml" --model "$work/model" --out "$out" --data-root "$shared" \
     --workers 4 --threads 1 --watch > "$work/launcher.log" 2>&1; then
  grep -q "Slurm job [0-9]*: RUNNING on n\[1-2\]" "$work/launcher.log" \
    || { echo "FAIL launcher: no 'Slurm job N: RUNNING on n[1-2]' event"; fail=1; }
  compare "$work/quip2-ref" "$out" "coordinator --launcher slurm, 4 ranks on 2 nodes" || fail=1
else
  echo "FAIL launcher: the job did not succeed:"; tail -30 "$work/launcher.log"; fail=1
fi
# Cancel while the workers run: no Slurm job, no worker left.
id=$("$q" submit "$work/quip2.yaml" --model "$work/model" --out "$work/quip2-cancel" \
       --data-root "$shared" --workers 4 --threads 1 --json | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["job_id"])')
for _ in $(seq 1 600); do
  squeue -h -t RUNNING -n "qcal-workers-$id" | grep -q . && break
  sleep 0.1
done
sleep 2
"$q" cancel "$id" > /dev/null
left=""
for _ in $(seq 1 300); do
  left="$(squeue -h -n "qcal-workers-$id" -o '%i %T')$(pgrep -f "qcal-worker .*--job $id" || true)"
  [ -z "$left" ] && break
  sleep 0.1
done
if [ -n "$left" ]; then
  echo "FAIL cancel: left behind: $left"; fail=1
else
  echo "ok   qcal cancel $id: no Slurm job and no worker process left"
fi

# 5. Jobs that must write as the submitting user (docs/service.md, Security): an unprivileged
# user submits the sbatch template itself; its coordinator and workers run in that user's own
# allocation, under its uid, and every file of the output is that user's, with the same bytes.
user=qcal-slurm-user
if ! id "$user" > /dev/null 2>&1; then
  useradd --system --no-create-home --shell /bin/bash "$user" > /dev/null 2>&1 || true
fi
if ! id "$user" > /dev/null 2>&1 || ! su -s /bin/sh "$user" -c true 2> /dev/null; then
  echo "SKIPPED user allocation: cannot create or switch to an unprivileged user here"
else
  home="$work/user-home"
  mkdir -p "$home" && chown "$user" "$home"
  out="$home/quip2-user"
  script_for "$work/quip2.yaml" "$out" "$home/quip2.sbatch"
  chown "$user" "$home/quip2.sbatch"
  cluster_env=$(bash "$src/slurm/local-cluster.sh" env "$cluster")
  id=$(su -s /bin/bash "$user" -c "$cluster_env; cd '$home' && sbatch --parsable quip2.sbatch")
  state=$(wait_job_end "$id" 900)
  uid=$(id -u "$user")
  if [ "$state" != COMPLETED ]; then
    echo "FAIL user allocation: job $id ended $state; its log:"; tail -30 "$out".slurm-*.log; fail=1
  elif [ -n "$(find "$out" "$out.job" ! -uid "$uid" | head -3)" ]; then
    echo "FAIL user allocation: files not owned by $user: $(find "$out" "$out.job" ! -uid "$uid" | head -3)"
    fail=1
  else
    compare "$work/quip2-ref" "$out" "sbatch quip2 as $user (uid $uid), every file its own" || fail=1
  fi
fi
exit $fail
