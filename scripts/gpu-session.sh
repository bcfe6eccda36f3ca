#!/usr/bin/env bash
# Every GPU step of issues 37 and 38 in one prepared run, for a session lent a GPU machine (15
# minutes of device time; one call runs at most 10 minutes and the machine stays warm 30 s after
# it, so a second call soon after picks up where the first stopped).
#
#   here:  scripts/gpu-session.sh pack        .device/deps.tar.xz (scripts/device-build.sh pack)
#                                             and .device/shared.tar.xz (stories260K, the Llama 3
#                                             tokenizer, the WikiText-2 and TinyStories files the
#                                             steps read): about 32 MB, one call's worth
#   there: scripts/gpu-session.sh run [OUT]   (device tool: carry [".device"], timeout_s 600)
# Steps, in order, each skipped when an earlier call on the same machine finished it:
#   1. build   scripts/device-build.sh build: qcal and the gpu-labelled tests against the
#              machine's CUDA LibTorch, then `ctest -L gpu` (kernels, NCCL, the device block
#              forward and its batch invariance, fine-tuning on CUDA against the CPU)
#   2. e2e     scripts/gpu-e2e.sh run with that qcal: seven method families, --device cuda
#              against --device cpu on stories260K, and gptq / QuIP# with fine-tuning on it
#              upcycled into Mixtral and Llama 4 MoE models, within the stated tolerance
#   3. scale   bench/gpu-scale.sh run with that qcal: 8B/70B-shaped layers, per-phase seconds
#              and peaks, the 8-GPU projection
# A step starts only when the call's budget (QCAL_SESSION_S, default 570 s) leaves it its
# minimum; each prints "STEP ..." lines, and "SESSION <step>: done|failed|not started (time)".
# Here, the logic of steps 2-3 runs on the CPU with this build's qcal:
#   QCAL_SESSION_BIN=$PWD/build/client/qcal QCAL_SESSION_STEPS="e2e" QCAL_E2E_DEVICES="cpu cpu" \
#     QCAL_E2E_RECIPES=rtn-4bit scripts/gpu-session.sh run /tmp/session
# OUT (default $OUT) gets summary.txt and logs.tar.xz (every log and JSON), renewed after each
# step, so a call cut off at its limit still brings back what finished.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  pack)
    shared=${QCAL_SHARED_DIR:-../shared}
    [ -f .device/deps.tar.xz ] || bash scripts/device-build.sh pack || exit 1
    stage=$(mktemp -d)/shared
    mkdir -p "$stage/models" "$stage/data/wikitext2" "$stage/data/tinystories"
    cp -r "$shared/models/stories260K" "$shared/models/llama3-tokenizer" "$stage/models/"
    cp "$shared/data/wikitext2/wiki.valid.tokens" "$stage/data/wikitext2/"
    cp "$shared/data/tinystories/TinyStories-valid.sample30k.txt" "$stage/data/tinystories/"
    tar -C "$(dirname "$stage")" -cJf .device/shared.tar.xz shared || exit 1
    du -ch .device/deps.tar.xz .device/shared.tar.xz
    ;;
  run)
    out=${2:-${OUT:-.device/session-out}}
    mkdir -p "$out"
    # The device tool brings back at most 8 files from $OUT: every log goes to $logs, packed
    # into $out/logs.tar.xz after each step, beside $out/summary.txt (the SESSION and STEP lines).
    logs=/tmp/qcal-session/logs
    mkdir -p "$logs"
    begin=$(date +%s)
    budget=${QCAL_SESSION_S:-570}
    left() { echo $(( budget - ($(date +%s) - begin) )); }
    marks=/tmp/qcal-session
    mkdir -p "$marks"
    [ -d /tmp/qcal-shared ] || { mkdir -p /tmp/qcal-shared && tar -C /tmp/qcal-shared -xJf .device/shared.tar.xz; }
    export QCAL_SHARED_DIR=/tmp/qcal-shared/shared
    Q=${QCAL_SESSION_BIN:-$PWD/build-device/client/qcal}
    steps=" ${QCAL_SESSION_STEPS:-build e2e scale} "
    # step NAME MIN_SECONDS COMMAND...: runs unless done before or too little time is left.
    step() {
      local name=$1 min=$2; shift 2
      if [[ "$steps" != *" $name "* ]]; then return 0; fi
      if [ -f "$marks/$name" ]; then echo "SESSION $name: done in an earlier call"; return 0; fi
      local l=$(left)
      if [ "$l" -lt "$min" ]; then echo "SESSION $name: not started ($l s left, needs $min)"; return 1; fi
      local start=$(date +%s)
      timeout "$l" "$@" 2>&1 | tee "$logs/$name.log" |
        grep -E '^(STEP|RESULT|E2E|\||torch|[0-9]+% tests|.*(Passed|Failed|Skipped|\*\*\*))' |
        tee -a "$out/summary.txt"
      local rc=${PIPESTATUS[0]}
      echo "SESSION $name: $([ "$rc" = 0 ] && echo done || echo "failed (rc=$rc)") ($(( $(date +%s) - start )) s)" |
        tee -a "$out/summary.txt"
      tar -C "$(dirname "$logs")" -cJf "$out/logs.tar.xz" "$(basename "$logs")"
      [ "$rc" = 0 ] && touch "$marks/$name"
      return "$rc"
    }
    QCAL_BUILD_S=$(( $(left) - 60 )) step build 240 bash scripts/device-build.sh build "$logs/build"
    if [ -x "$Q" ]; then
      QCAL_E2E_BIN=$Q QCAL_E2E_THREADS=16 QCAL_E2E_STEP_S=60 step e2e 120 bash scripts/gpu-e2e.sh run "$logs/e2e"
      QCAL_SCALE_BIN=$Q QCAL_SCALE_STEP_S=120 step scale 150 bash bench/gpu-scale.sh run "$logs/scale"
    else
      echo "SESSION e2e, scale: not started (no qcal built)"
    fi
    ;;
  *) echo "usage: scripts/gpu-session.sh pack | run [OUT_DIR]" >&2; exit 2 ;;
esac
