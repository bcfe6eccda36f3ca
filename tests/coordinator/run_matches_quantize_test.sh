#!/usr/bin/env bash
# Issue 18: `qcal run` (a private coordinator + mpirun with its default binding, which on a
# 2-core machine pins each of 1 or 2 ranks to one core) gives output byte-identical to the
# single-process `qcal quantize`, whatever --workers and --threads, for QuIP# 2-bit and for a
# fine-tuning recipe (quip-e8p-2bit-ft with 32 calibration sequences, to keep the test short),
# and with Hessian sums sharded over 2 ranks (--max-memory below a block's working set); and for
# one recipe of every other method family (rtn, gptq, quarot, prefixquant with Block-AP,
# spinquant) and QuIP#'s trellis codebook (qtip-2bit) with 2 workers: both drivers are the one
# job runner (runner/), so a family whose bytes differ between them is a bug in the runner, not
# in the method (issue 39).
# Before the fix the fine-tuning recipe differed in every shard with 1 or 2 workers: OpenBLAS
# splits a GEMM over the CPUs of the affinity mask, and the split changed the bits.
# Usage (ctest runs it): run_matches_quantize_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
shared=${QCAL_SHARED_DIR:-$src/../shared}
q="$build/client/qcal"
work=$(mktemp -d /tmp/qcal-run-vs-quantize.XXXXXX)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
unset QCAL_NUM_THREADS OPENBLAS_NUM_THREADS OMP_NUM_THREADS

"$q" import llama2c "$shared/models/stories260K/stories260K.bin" \
  "$shared/models/stories260K/tok512.bin" --out "$work/model" > /dev/null
cp "$src/jobs/quip-e8p-2bit.yaml" "$work/quip2.yaml"
sed -e 's/^name: quip-e8p-2bit-ft/name: quip-e8p-2bit-ft-small/' \
    -e 's/num_sequences: 128/num_sequences: 32/' "$src/jobs/quip-e8p-2bit-ft.yaml" > "$work/ft.yaml"
grep -q 'num_sequences: 32' "$work/ft.yaml" || { echo "could not shorten the ft recipe"; exit 2; }
families=(rtn-4bit gptq-4bit quarot-w4a4kv4 prefixquant-w4a4kv4-ft spinquant-w4a4kv4 qtip-2bit)
for f in "${families[@]}"; do cp "$src/jobs/$f.yaml" "$work/$f.yaml"; done

fail=0
compare() {  # compare REF OUT LABEL: every file of REF byte-identical in OUT, same file set
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

for recipe in quip2 ft "${families[@]}"; do
  ref="$work/$recipe-quantize"
  "$q" quantize --recipe "$work/$recipe.yaml" --model "$work/model" --out "$ref" \
    --data-root "$shared" > "$work/$recipe-quantize.log" 2>&1 \
    || { echo "qcal quantize $recipe failed:"; tail -5 "$work/$recipe-quantize.log"; exit 1; }
  # (workers, threads[, max-memory]): 0 threads = the job's automatic choice. A 64K budget is
  # below a block's working set, so the 2 ranks shard the Hessian sums by row bands.
  combos=("1 0" "2 0" "2 1" "1 2")
  [ "$recipe" = quip2 ] && combos+=("2 0 64K")
  case "$recipe" in quip2|ft) ;; *) combos=("2 0") ;; esac
  for combo in "${combos[@]}"; do
    set -- $combo
    mem=${3:-}
    label="$recipe run --workers $1 --threads $2${mem:+ --max-memory $mem}"
    out="$work/$recipe-w$1-t$2${mem:+-m$mem}"
    if ! "$q" run "$work/$recipe.yaml" --model "$work/model" --out "$out" --data-root "$shared" \
        --workers "$1" --threads "$2" ${mem:+--max-memory "$mem"} --no-eval > "$out.log" 2>&1; then
      echo "FAIL $label: qcal run exited non-zero:"; tail -8 "$out.log"; fail=1; continue
    fi
    if [ -n "$mem" ] && ! grep -q "shard the sums by row bands" "$out.job/workers.log"; then
      echo "FAIL $label: the workers did not shard the Hessian sums"; fail=1
    fi
    compare "$ref" "$out" "$label" || fail=1
    # A global phase that trained is journaled by the coordinator as by `qcal quantize`
    # (phase_done, from rank 0's calibration result), so the reports plot the same curve.
    if [ "$recipe" = spinquant-w4a4kv4 ]; then
      a=$(grep '"phase_done"' "$ref.job/journal.jsonl" | tail -1)
      b=$(grep '"phase_done"' "$out.job/journal.jsonl" | tail -1)
      if [ -z "$a" ] || [ "$a" != "$b" ]; then
        echo "FAIL $label: phase_done differs from qcal quantize's or is missing"; fail=1
      else
        echo "ok   $label: the same phase_done as qcal quantize (${#a} bytes)"
      fi
    fi
  done
done
exit $fail
