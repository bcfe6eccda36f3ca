#!/usr/bin/env bash
# What a user is told (issue 51, deliverables 3 and 4), each case a real `qcal` run on
# stories260K:
#   * a finished checkpoint is never replaced silently: a fresh --job-dir onto it is refused with
#     the advice --overwrite, which then replaces it; rerunning the same job is no question;
#   * exporting a job's output before the job finished says so (not "config.json: cannot open");
#   * tie_word_embeddings false without lm_head.weight is refused before anything runs;
#   * a tokenizer with more tokens than the model's embedding rows is refused naming both;
#   * `qcal eval` without --ctx uses the model's own context (512 for the bundled models).
# Usage (ctest runs it): user_messages_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
shared=${QCAL_SHARED_DIR:-$src/../shared}
q="$build/client/qcal"
work=$(mktemp -d /tmp/qcal-messages.XXXXXX)
trap 'rm -rf "$work"' EXIT
"$q" import llama2c "$shared/models/stories260K/stories260K.bin" \
  "$shared/models/stories260K/tok512.bin" --out "$work/model" > /dev/null

expect_fail() {  # $1: what, $2: phrase the output must hold, then the command
  local what=$1 phrase=$2 rc=0; shift 2
  "$@" > "$work/out.log" 2>&1 || rc=$?
  if [ "$rc" = 0 ] || ! grep -q -F -- "$phrase" "$work/out.log"; then
    echo "FAIL: $what (exit $rc), expected \"$phrase\":"; cat "$work/out.log"; exit 1
  fi
  echo "ok: $what: $(grep -F -- "$phrase" "$work/out.log" | head -1 | cut -c1-160)"
}
expect_ok() {  # $1: what, then the command
  local what=$1; shift
  "$@" > "$work/out.log" 2>&1 || { echo "FAIL: $what:"; cat "$work/out.log"; exit 1; }
  echo "ok: $what"
}
rtn=(--model "$work/model" --data-root "$shared")

# ---- a finished checkpoint is not replaced silently
expect_ok "rtn-4bit into a fresh directory" \
  "$q" quantize --recipe "$src/jobs/rtn-4bit.yaml" "${rtn[@]}" --out "$work/ckpt"
before=$(sha256sum "$work/ckpt/config.json")
expect_fail "another recipe onto it with a fresh --job-dir" "pass --overwrite to replace it" \
  "$q" quantize --recipe "$src/jobs/rtn-2bit.yaml" "${rtn[@]}" --out "$work/ckpt" \
  --job-dir "$work/fresh.job"
[ "$(sha256sum "$work/ckpt/config.json")" = "$before" ] ||
  { echo "FAIL: the refused run changed the checkpoint"; exit 1; }
expect_ok "the same job again (its own job directory)" \
  "$q" quantize --recipe "$src/jobs/rtn-4bit.yaml" "${rtn[@]}" --out "$work/ckpt"
expect_ok "--overwrite replaces it" \
  "$q" quantize --recipe "$src/jobs/rtn-2bit.yaml" "${rtn[@]}" --out "$work/ckpt" \
  --job-dir "$work/fresh.job" --overwrite
grep -q '"bits": 2' "$work/ckpt/config.json" ||
  { echo "FAIL: --overwrite did not write the 2-bit checkpoint"; exit 1; }

# ---- exporting a job that has not finished
mkdir -p "$work/unfinished/.staging"
cp "$work/ckpt/model-00001-of-00005.safetensors" "$work/unfinished/"
expect_fail "export of an unfinished job" "has not finished" \
  "$q" export "$work/unfinished" "$work/exported" --format gptq

# ---- an untied head without its weights
cp -r "$work/model" "$work/untied"
python3 - "$work/untied/config.json" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1])); c["tie_word_embeddings"] = False
json.dump(c, open(sys.argv[1], "w"))
EOF
if ! python3 -c "import json,struct,sys; f=open(sys.argv[1],'rb'); n=struct.unpack('<Q',f.read(8))[0]; sys.exit(0 if 'lm_head.weight' in json.loads(f.read(n)) else 1)" \
    "$work/untied/model.safetensors" 2>/dev/null; then
  expect_fail "tie_word_embeddings false without lm_head.weight" \
    "tie_word_embeddings is false but the checkpoint has no lm_head.weight" \
    "$q" quantize --recipe "$src/jobs/rtn-4bit.yaml" --model "$work/untied" --out "$work/u" \
    --data-root "$shared"
else
  echo "skip: the imported model stores lm_head.weight"
fi

# ---- a tokenizer that does not fit the model
cp -r "$work/model" "$work/mismatch"
rm -f "$work/mismatch"/tokenizer.model "$work/mismatch"/tokenizer_config.json
cp "$shared/models/llama3-tokenizer/tokenizer.json" "$work/mismatch/"
expect_fail "a 128k-token tokenizer on a 512-row model" "the tokenizer files do not belong" \
  "$q" quantize --recipe "$src/jobs/gptq-4bit.yaml" --model "$work/mismatch" --out "$work/m" \
  --data-root "$shared"

# ---- qcal eval's default window fits the model
expect_ok "qcal eval without --ctx" \
  "$q" eval --model "$work/model" --data "$shared/data/tinystories/TinyStories-valid.sample30k.txt" --max-tokens 2000
grep -q "ctx 512" "$work/out.log" || { echo "FAIL: eval did not use ctx 512:"; cat "$work/out.log"; exit 1; }
echo "user messages: all cases hold"
