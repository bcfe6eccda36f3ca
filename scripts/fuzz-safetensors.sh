#!/usr/bin/env bash
# Fuzzes the safetensors parser (ParseSafetensors) with libFuzzer + ASan + UBSan.
#
# Usage: scripts/fuzz-safetensors.sh [SECONDS]    (default 60)
#
# Configures build-fuzz/ with clang and -DQCAL_FUZZ=ON (only common/ and tests/fuzz/ are built),
# writes a small seed corpus of valid files, and runs the fuzzer for SECONDS. Exits non-zero if
# the fuzzer finds a crash, leak, sanitizer report or timeout; the input is kept under
# build-fuzz/fuzz-safetensors/artifacts/. Set JOBS to change the build parallelism (default 2).
set -euo pipefail

DURATION="${1:-60}"
if ! [[ "$DURATION" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 [SECONDS]" >&2
  exit 2
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$ROOT/build-fuzz"
WORK="$BUILD/fuzz-safetensors"

CC=clang CXX=clang++ cmake -S "$ROOT" -B "$BUILD" -G Ninja -DQCAL_FUZZ=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo
ninja -C "$BUILD" -j"${JOBS:-2}" safetensors_fuzz
FUZZER="$BUILD/tests/fuzz/safetensors_fuzz"

mkdir -p "$WORK/seeds" "$WORK/corpus" "$WORK/artifacts"

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
  { le64 "${#header}"; printf '%s' "$header"; printf "$data"; } > "$WORK/seeds/$name"
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

cat > "$WORK/safetensors.dict" <<'DICT'
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

LOG="$WORK/fuzz.log"
echo "fuzzing $FUZZER for ${DURATION}s (corpus $WORK/corpus, log $LOG)"
# libFuzzer exits non-zero on any crash, sanitizer report, leak or timeout.
set +e
"$FUZZER" -max_total_time="$DURATION" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
  -dict="$WORK/safetensors.dict" -artifact_prefix="$WORK/artifacts/" \
  "$WORK/corpus" "$WORK/seeds" > "$LOG" 2>&1
status=$?
set -e
grep -E "^(Done|stat::number_of_executed_units|stat::peak_rss_mb)" "$LOG" || true
if (( status != 0 )); then
  tail -n 60 "$LOG" >&2
  echo "safetensors_fuzz FAILED (exit $status); reproducer(s) in $WORK/artifacts/" >&2
  exit "$status"
fi
echo "safetensors_fuzz: no crash in ${DURATION}s"
