#!/usr/bin/env bash
# Fuzzes qcal's parsers of untrusted input with libFuzzer + ASan + UBSan (issue 18):
#   safetensors_fuzz  safetensors headers (ParseSafetensors)
#   hf_config_fuzz    config.json (ParseLlamaConfig, and a rewrite of what it accepts)
#   recipe_fuzz       job recipes (YAML: the common keys and every method's keys)
#   tokenizer_fuzz    tokenizer.model (sentencepiece protobuf) and llama2.c tokenizer .bin
#   hf_tokenizer_fuzz tokenizer.json (Hugging Face tokenizers: BPE, regex pre-tokenizers)
#   journal_fuzz      the job journal (journal.jsonl) and its entries
#
# Usage: scripts/fuzz.sh [SECONDS | -runs=N] [TARGET ...]   (default: 60 s each, every target)
#
# Configures build-fuzz/ with clang and -DQCAL_FUZZ=ON (only proto/, common/, the method specs,
# runner/'s torch-free job module and tests/fuzz/ are built), writes a seed corpus per target,
# and runs each fuzzer for SECONDS (or exactly N executions). Exits non-zero if any fuzzer finds
# a crash, leak, sanitizer report or timeout; the input is kept under
# build-fuzz/fuzz-<target>/artifacts/. Prints one summary line per target (executions, seconds, peak RSS). JOBS sets the build parallelism (default 2);
# QCAL_FUZZ_TIMEOUT the seconds one input may take (default 10; raise it when the machine is
# shared, or a starved run reports a timeout).
set -euo pipefail

LIMIT="${1:-60}"
shift || true
if [[ "$LIMIT" =~ ^[0-9]+$ ]]; then
  LIMIT_FLAG="-max_total_time=$LIMIT"
elif [[ "$LIMIT" =~ ^-runs=[0-9]+$ ]]; then
  LIMIT_FLAG="$LIMIT"
else
  echo "usage: $0 [SECONDS | -runs=N] [TARGET ...]" >&2
  exit 2
fi
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
  TARGETS=(safetensors_fuzz hf_config_fuzz recipe_fuzz tokenizer_fuzz hf_tokenizer_fuzz
           journal_fuzz)
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$ROOT/build-fuzz"
SHARED="${QCAL_SHARED_DIR:-$ROOT/../shared}"

CONFIGURE_LOG=$(mktemp)
CC=clang CXX=clang++ cmake -S "$ROOT" -B "$BUILD" -G Ninja -DQCAL_FUZZ=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$CONFIGURE_LOG" 2>&1 \
  || { cat "$CONFIGURE_LOG" >&2; exit 1; }
rm -f "$CONFIGURE_LOG"
ninja -C "$BUILD" -j"${JOBS:-2}" "${TARGETS[@]}"

seeds_safetensors_fuzz() {
# 8-byte little-endian length prefix.
le64() {
  local n=$1 i
  for i in 0 1 2 3 4 5 6 7; do
    printf "\\x$(printf %02x $(((n >> (8 * i)) & 255)))"
  done
}

# write_seed NAME HEADER DATA_PRINTF_ESCAPES: a valid file whose header is padded with spaces to
# a multiple of 8, as the writer does.
write_seed() {
  local name=$1 header=$2 data=$3
  while (( ${#header} % 8 != 0 )); do header+=" "; done
  { le64 "${#header}"; printf '%s' "$header"; printf "$data"; } > "$W/seeds/$name"
}

write_seed empty '{}' ''
write_seed f32_bf16_meta \
  '{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[1,2],"data_offsets":[8,12]}}' \
  '\x00\x00\x80\x3f\x00\x00\x00\xc0\x80\x3f\x00\xc0'
write_seed scalar_and_empty \
  '{"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]},"e":{"dtype":"F16","shape":[0,3],"data_offsets":[8,8]},"m":{"dtype":"BOOL","shape":[3],"data_offsets":[8,11]}}' \
  '\x00\x00\x00\x00\x00\x00\xf0\x3f\x01\x00\x01'
write_seed ints \
  '{"i8":{"dtype":"I8","shape":[2],"data_offsets":[0,2]},"u16":{"dtype":"U16","shape":[1],"data_offsets":[2,4]},"i64":{"dtype":"I64","shape":[1,1],"data_offsets":[4,12]}}' \
  '\x01\xff\x02\x00\x03\x00\x00\x00\x00\x00\x00\x00'

cat > "$W/dict" <<'DICT'
"dtype"
"shape"
"data_offsets"
"__metadata__"
"F64"
"F32"
"F16"
"BF16"
"I64"
"I32"
"I16"
"I8"
"U64"
"U32"
"U16"
"U8"
"BOOL"
"18446744073709551615"
"9223372036854775807"
"-1"
"[]"
"{}"
DICT
}

seeds_hf_config_fuzz() {
  cat > "$W/seeds/llama2.json" <<'JSON'
{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":64,"intermediate_size":172,
 "num_hidden_layers":5,"num_attention_heads":8,"num_key_value_heads":4,"rms_norm_eps":1e-05,
 "rope_theta":10000.0,"vocab_size":512,"tie_word_embeddings":true,"max_position_embeddings":512,
 "torch_dtype":"float32","bos_token_id":1,"eos_token_id":2}
JSON
  cat > "$W/seeds/llama3.json" <<'JSON'
{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":4096,"intermediate_size":14336,
 "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"head_dim":128,
 "rms_norm_eps":1e-05,"rope_theta":500000.0,"vocab_size":128256,"tie_word_embeddings":false,
 "max_position_embeddings":131072,"torch_dtype":"bfloat16","bos_token_id":128000,
 "eos_token_id":[128001,128008,128009],"quantization_config":{"quant_method":"qcal","bits":2}}
JSON
  printf '%s\n' '"hidden_size"' '"num_hidden_layers"' '"num_attention_heads"' \
    '"num_key_value_heads"' '"head_dim"' '"vocab_size"' '"rope_scaling"' '"eos_token_id"' \
    '"tie_word_embeddings"' '"9223372036854775807"' '"-1"' '"1e308"' > "$W/dict"
}

seeds_recipe_fuzz() {
  cp "$ROOT"/jobs/*.yaml "$W/seeds/"
  printf '%s\n' '"method:"' '"bits:"' '"calibration:"' '"num_sequences:"' '"seq_len:"' \
    '"finetune:"' '"files:"' '"quip"' '"gptq"' '"rtn"' '"quarot"' '"e8p"' '"2000000000"' \
    '"!!binary"' '"&a"' '"*a"' '"<<:"' > "$W/dict"
}

seeds_tokenizer_fuzz() {
  # First byte even: llama2.c .bin; odd: sentencepiece tokenizer.model.
  if [ -f "$SHARED/models/stories260K/tok512.bin" ]; then
    { printf '\x00'; cat "$SHARED/models/stories260K/tok512.bin"; } > "$W/seeds/llama2c-tok512"
  fi
  local qcal="$ROOT/build/client/qcal" tmp
  if [ -x "$qcal" ] && [ -f "$SHARED/models/stories260K/stories260K.bin" ]; then
    tmp=$(mktemp -d)
    if "$qcal" import llama2c "$SHARED/models/stories260K/stories260K.bin" \
        "$SHARED/models/stories260K/tok512.bin" --out "$tmp/m" > /dev/null 2>&1; then
      { printf '\x01'; cat "$tmp/m/tokenizer.model"; } > "$W/seeds/sentencepiece-tok512"
    fi
    rm -rf "$tmp"
  fi
  printf '\x01' > "$W/seeds/empty-sentencepiece"
}

seeds_hf_tokenizer_fuzz() {
  # First byte odd: special tokens are parsed. A byte-level file with the Llama 3 pre-tokenizer
  # and a Llama-2-style one (Metaspace / normalizers, byte fallback), both tiny.
  cat > "$W/seeds/llama3-style.json" <<'JSON'
{"version":"1.0","added_tokens":[{"id":9,"content":"<|begin_of_text|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
"normalizer":null,"pre_tokenizer":{"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},"behavior":"Isolated","invert":false},{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":false}]},
"post_processor":{"type":"ByteLevel"},"decoder":{"type":"ByteLevel"},
"model":{"type":"BPE","dropout":null,"unk_token":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":true,
"vocab":{"O":0,"n":1,"c":2,"e":3,"On":4,"ce":5,"Once":6,"\u0120":7,"\u0120O":8},"merges":["O n","c e","On ce",["\u0120","O"]]}}
JSON
  cat > "$W/seeds/llama2-style.json" <<'JSON'
{"version":"1.0","added_tokens":[{"id":0,"content":"<unk>","special":true},{"id":1,"content":"<s>","special":true}],
"normalizer":{"type":"Sequence","normalizers":[{"type":"Prepend","prepend":"\u2581"},{"type":"Replace","pattern":{"String":" "},"content":"\u2581"}]},
"pre_tokenizer":{"type":"Metaspace","replacement":"\u2581","prepend_scheme":"first","split":false},
"post_processor":{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<s>","type_id":0}},{"Sequence":{"id":"A","type_id":0}}]},
"decoder":{"type":"Sequence","decoders":[{"type":"Replace","pattern":{"String":"\u2581"},"content":" "},{"type":"ByteFallback"},{"type":"Fuse"},{"type":"Strip","content":" ","start":1,"stop":0}]},
"model":{"type":"BPE","unk_token":"<unk>","fuse_unk":true,"byte_fallback":true,"vocab":{"<unk>":0,"<s>":1,"<0x41>":2,"\u2581":3,"a":4,"\u2581a":5},"merges":["\u2581 a"]}}
JSON
  { printf '\x01'; cat "$W/seeds/llama3-style.json"; } > "$W/seeds/llama3-style.bin"
  rm -f "$W/seeds/llama3-style.json"
  { printf '\x00'; cat "$W/seeds/llama2-style.json"; } > "$W/seeds/llama2-style.bin"
  rm -f "$W/seeds/llama2-style.json"
  printf '%s\n' '"type"' '"BPE"' '"Split"' '"Regex"' '"String"' '"ByteLevel"' '"Metaspace"' \
    '"Sequence"' '"Isolated"' '"MergedWithNext"' '"Contiguous"' '"Removed"' '"invert"' \
    '"added_tokens"' '"special"' '"lstrip"' '"rstrip"' '"merges"' '"vocab"' '"ignore_merges"' \
    '"byte_fallback"' '"unk_token"' '"fuse_unk"' '"normalizer"' '"pre_tokenizer"' '"decoder"' \
    '"Prepend"' '"Replace"' '"ByteFallback"' '"Fuse"' '"Strip"' '"prepend_scheme"' \
    '"\\p{L}"' '"(?!"' '"(?i:"' '"\\s+"' > "$W/dict"
}

seeds_journal_fuzz() {
  cat > "$W/seeds/journal.jsonl" <<'JSONL'
{"event":"job_start","recipe_hash":"0123456789abcdef","model_dir":"/m","recipe":{"name":"q","method":"quip"}}
{"event":"block_done","layer":0,"shard":"model-00001-of-00005.safetensors","bytes":1234,"checksum":"0123456789abcdef","seconds":1.5,"mse_before_ft":null,"mse_after_ft":0.5,"metrics":[{"name":"self_attn.q_proj","code_bits":2.0,"stored_bits":2.1,"proxy_loss":0.1}],"also_wrote":{"model-00000-of-00005.safetensors":"fedcba9876543210"}}
{"event":"block_part_done","layer":1,"shard":".qcal-part-00001-00000-00002.safetensors","bytes":99,"checksum":"0123456789abcdef","seconds":0.5,"metrics":[],"rank":1,"part":{"index":1,"count":3,"expert_begin":0,"expert_end":2}}
{"event":"e2e_done","checksums":{"model-00000-of-00005.safetensors":"0123456789abcdef"},"kl_before":0.2,"kl_after":0.1,"best_epoch":2,"head_tuned":true,"seconds":3.0}
{"event":"job_done"}
{"event":"block_do
JSONL
  printf '%s\n' '"event"' '"block_done"' '"e2e_done"' '"job_start"' '"job_done"' '"layer"' \
    '"shard"' '"checksum"' '"also_wrote"' '"checksums"' '"metrics"' '"block_part_done"' '"part"' \
    '"expert_begin"' '"expert_end"' > "$W/dict"
}

failed=0
for target in "${TARGETS[@]}"; do
  W="$BUILD/fuzz-${target%_fuzz}"
  mkdir -p "$W/seeds" "$W/corpus" "$W/artifacts"
  : > "$W/dict"
  "seeds_$target"
  dict=()
  [ -s "$W/dict" ] && dict=(-dict="$W/dict")
  LOG="$W/fuzz.log"
  set +e
  "$BUILD/tests/fuzz/$target" "$LIMIT_FLAG" -timeout="${QCAL_FUZZ_TIMEOUT:-10}" -rss_limit_mb=4096 -print_final_stats=1 \
    "${dict[@]}" -artifact_prefix="$W/artifacts/" "$W/corpus" "$W/seeds" > "$LOG" 2>&1
  status=$?
  set -e
  runs=$(grep -E '^stat::number_of_executed_units' "$LOG" | awk '{print $2}')
  secs=$(grep -E '^Done [0-9]+ runs in' "$LOG" | sed -E 's/.* in ([0-9]+) second.*/\1/')
  rss=$(grep -E '^stat::peak_rss_mb' "$LOG" | awk '{print $2}')
  if (( status != 0 )); then
    tail -n 60 "$LOG" >&2
    echo "$target FAILED (exit $status); reproducer(s) in $W/artifacts/" >&2
    failed=1
  else
    echo "$target: no crash in ${runs:-?} executions (${secs:-?} s, peak RSS ${rss:-?} MB)"
  fi
done
exit $failed
