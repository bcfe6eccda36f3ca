#!/usr/bin/env bash
# Newcomer command (a): install, build, and run the main job on the bundled model.
#   bash scripts/quickstart.sh
# The main job imports ../shared/models/stories260K into a Hugging Face layout and quantizes it
# with QuIP# 2-bit (E8P, jobs/quip-e8p-2bit.yaml) through the distributed service (`qcal run`: a
# local gRPC coordinator and 2 MPI workers), which prints the float and quantized perplexity on
# the WikiText-2 test set and the TinyStories sample; then greedy samples from both.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${QCAL_SHARED_DIR:-../shared}
OUT=${QCAL_OUT_DIR:-out}
bash scripts/install-deps.sh
bash scripts/build.sh
QCAL=build/client/qcal
$QCAL import llama2c "$SHARED/models/stories260K/stories260K.bin" \
  "$SHARED/models/stories260K/tok512.bin" --out "$OUT/stories260K"
echo
echo "== QuIP# 2-bit (E8P) through the service: a local coordinator + 2 MPI workers"
# `qcal run` starts a private qcal-coordinator, launches `mpirun -np 2 qcal-worker`, submits the
# job, shows progress per block, prints the block table, and finally the float and quantized
# perplexity on the WikiText-2 test set and the TinyStories sample (512-token windows).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
$QCAL run jobs/quip-e8p-2bit.yaml --model "$OUT/stories260K" --out "$OUT/stories260K-quip2" \
  --workers 2 --data-root "$SHARED"
echo
echo "== greedy samples: float, then quantized"
$QCAL generate --model "$OUT/stories260K" --prompt "Once upon a time" --tokens 48
$QCAL generate --model "$OUT/stories260K-quip2" --prompt "Once upon a time" --tokens 48
