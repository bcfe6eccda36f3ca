#!/usr/bin/env bash
# The device block forward's test (engine_gpu_block_forward_test), then stories260K jobs of every
# method family on the GPU against the same jobs on the CPU (issue 37, deliverable 2):
# `qcal quantize --device cuda` and `--device cpu` on the same machine for quip-e8p-2bit,
# quip-e8p-2bit-ft, rtn-4bit, gptq-4bit, quarot-w4a4kv4, prefixquant-w4a4kv4-ft and
# spinquant-w4a4kv4 (the recipes' calibration precision: fp32), then for each pair the per-linear
# proxy losses, the TinyStories perplexity and the KL to the float model compared against the
# tolerance (QCAL_E2E_TOL, default 0.001: the fp32 device forward's, docs/algorithms.md "On a
# GPU"); and gptq-4bit and quip-e8p-2bit-ft on stories260K upcycled into Mixtral and Llama 4
# mixture-of-experts models (issue 53), compared the same way. One summary line per step; every
# log and JSON lands in OUT_DIR as it goes.
#
# The GPU machine lacks qcal's build dependencies, so `pack` bundles the qcal binary, the shared
# libraries it loads (not libc or CUDA's), the model and the data files into one archive, split
# into parts small enough for the device tool's 64 MiB per call:
#   here:  scripts/gpu-e2e.sh pack [BUILD_DIR]      -> .device/qcal.part.0, .1, ...
#   there: scripts/gpu-e2e.sh stage N               (one call per part, carrying .device/qcal.part.N;
#                                                    the parts collect in /tmp/qcal-parts)
#          scripts/gpu-e2e.sh run [OUT_DIR]         (assembles, runs, compares; JSON in OUT_DIR)
# Here, without a GPU, the run's logic can be tried on two CPU jobs:
#   QCAL_E2E_BIN=build/client/qcal QCAL_E2E_DEVICES="cpu cpu" scripts/gpu-e2e.sh run /tmp/e2e
# QCAL_E2E_RECIPES narrows the recipes, QCAL_E2E_MOE_RECIPES the MoE ones ("" for none);
# QCAL_E2E_STEP_S is each job's time budget (default 240 s); QCAL_E2E_PYTHON a python3 with numpy
# (the upcycling; default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  pack)
    build=${2:-build}
    shared=${QCAL_SHARED_DIR:-../shared}
    stage=$(mktemp -d)/qb
    ninja -C "$build" qcal engine_gpu_block_forward_test || exit 1
    bash scripts/gpu-bundle.sh "$build" "$stage" qcal engine_gpu_block_forward_test > /dev/null || exit 1
    strip --strip-debug "$stage/qcal" "$stage/engine_gpu_block_forward_test"
    mkdir -p "$stage/shared/models" "$stage/shared/data/wikitext2" "$stage/shared/data/tinystories"
    cp -r "$shared/models/stories260K" "$stage/shared/models/"
    cp -r "$shared/models/llama3-tokenizer" "$stage/shared/models/"  # bench/gpu-scale.sh
    cp "$shared/data/wikitext2/wiki.valid.tokens" "$stage/shared/data/wikitext2/"
    cp "$shared/data/tinystories/TinyStories-valid.sample30k.txt" "$stage/shared/data/tinystories/"
    mkdir -p .device && rm -f .device/qcal.part.*
    tar -C "$(dirname "$stage")" -cf - qb | xz -T0 -6 | split -b 58000000 -d -a 1 - .device/qcal.part.
    ls -la .device/qcal.part.*
    ;;
  stage)
    mkdir -p /tmp/qcal-parts && cp ".device/qcal.part.$2" /tmp/qcal-parts/ && ls -la /tmp/qcal-parts
    ;;
  run)
    out=${2:-${OUT:-.device/e2e-out}}
    mkdir -p "$out"
    read -r ref_dev test_dev <<< "${QCAL_E2E_DEVICES:-cpu cuda}"
    recipes=(${QCAL_E2E_RECIPES:-quip-e8p-2bit quip-e8p-2bit-ft rtn-4bit gptq-4bit quarot-w4a4kv4 prefixquant-w4a4kv4-ft spinquant-w4a4kv4})
    budget=${QCAL_E2E_STEP_S:-240}
    if [ -n "${QCAL_E2E_BIN:-}" ]; then  # a dry run here: this build's qcal, ../shared
      Q=$QCAL_E2E_BIN S=${QCAL_SHARED_DIR:-../shared} W=$(mktemp -d /tmp/qcal-e2e.XXXXXX)
    else
      [ -d /tmp/qb ] || { cat /tmp/qcal-parts/qcal.part.* | xz -d | tar -C /tmp -xf - || exit 1; }
      export LD_LIBRARY_PATH=/tmp/qb/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
      Q=/tmp/qb/qcal S=/tmp/qb/shared W=/tmp/qcal-e2e
      rm -rf "$W" && mkdir -p "$W"
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
      # The device block forward and its Hessians against the CPU block (fp32 and bf16), and its
      # batch invariance.
      timeout 300 /tmp/qb/engine_gpu_block_forward_test > "$out/block-forward-test.log" 2>&1
      echo "STEP engine_gpu_block_forward_test rc=$?"
      grep -E '^\[ +(OK|FAILED|SKIPPED) |seed|Hessian' "$out/block-forward-test.log" | head -20
    fi
    $Q import llama2c "$S/models/stories260K/stories260K.bin" "$S/models/stories260K/tok512.bin" \
      --out "$W/float" > /dev/null || exit 1
    # Runs: NAME|RECIPE|MODEL. The dense model with every recipe, then stories260K upcycled into
    # mixture-of-experts models (tests/reference/moe_reference.py: Mixtral 4 experts top 2; Llama 4
    # 4 experts top 1 with a shared expert, MoE on every other layer) with the MoE recipes
    # (QCAL_E2E_MOE_RECIPES; "" for none).
    runs=()
    for r in "${recipes[@]}"; do runs+=("$r|$r|float"); done
    moe_recipes=(${QCAL_E2E_MOE_RECIPES-gptq-4bit quip-e8p-2bit-ft})
    if [ ${#moe_recipes[@]} -gt 0 ]; then
      for m in "mixtral|--layout mixtral --top-k 2" \
               "llama4|--layout llama4 --top-k 1 --shared-scale 0.5 --router-scale 16 --moe-step 2"; do
        name=${m%%|*}
        "${QCAL_E2E_PYTHON:-python3}" tests/reference/moe_reference.py upcycle --dense "$W/float" --out "$W/$name" \
          --experts 4 --noise 0.05 --seed 1 ${m#*|} > /dev/null || exit 1
        for r in "${moe_recipes[@]}"; do runs+=("$name-$r|$r|$name"); done
      done
    fi
    names=()
    for run in "${runs[@]}"; do
      IFS='|' read -r n r m <<< "$run"
      names+=("$n")
      for side in ref test; do
        d=$ref_dev; [ $side = test ] && d=$test_dev
        tag=$n-$side
        start=$(date +%s.%N)
        timeout "$budget" $Q --log-level info quantize --recipe "jobs/$r.yaml" --model "$W/$m" \
          --out "$W/$tag" --data-root "$S" --device "$d" --threads "${QCAL_E2E_THREADS:-8}" --json \
          > "$out/$tag.json" 2> "$out/$tag.log"
        rc=$?
        echo "STEP quantize $n --device $d: rc=$rc $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s; $(grep -o 'device [^"]*' "$out/$tag.log" | head -1)"
        [ $rc = 0 ] || { tail -5 "$out/$tag.log"; continue; }
        timeout "$budget" $Q eval --model "$W/$tag" --reference "$W/$m" \
          --data "$S/data/tinystories/TinyStories-valid.sample30k.txt" --ctx 512 --bos-per-window \
          --json > "$out/eval-$tag.json" 2>> "$out/$tag.log"
        echo "STEP eval $n --device $d: rc=$?"
      done
    done
    python3 - "$out" "$ref_dev" "$test_dev" "${QCAL_E2E_TOL:-0.001}" "${names[@]}" <<'PY'
import json, sys
out, ref_dev, test_dev, tol = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
recipes = sys.argv[5:]
last = lambda f: json.loads(open(f).read().strip().splitlines()[-1])
rel = lambda a, b: abs(b - a) / max(abs(a), 1e-30)
ok = True
print(f"tolerance {tol:.4%} (relative): --device {ref_dev} (reference) against --device {test_dev}")
for r in recipes:
    try:
        ref = last(f"{out}/{r}-ref.json"); got = last(f"{out}/{r}-test.json")
        eref = last(f"{out}/eval-{r}-ref.json"); egot = last(f"{out}/eval-{r}-test.json")
    except Exception as e:
        print(f"RESULT {r}: FAIL (missing output: {e})"); ok = False; continue
    worst, n = 0.0, 0
    for br, bg in zip(ref["blocks"], got["blocks"]):
        for lr, lg in zip(br["linears"], bg["linears"]):
            if lr["proxy_loss"] is None or lg["proxy_loss"] is None: continue
            n += 1
            worst = max(worst, rel(lr["proxy_loss"], lg["proxy_loss"]))
    ppl = rel(eref["perplexity"], egot["perplexity"])
    kl = rel(eref["mean_kl"], egot["mean_kl"])
    good = worst <= tol and ppl <= tol and kl <= tol
    ok &= good
    print(f"RESULT {r}: {'PASS' if good else 'FAIL'}; {n} linears, worst proxy-loss difference "
          f"{worst:.4%}; perplexity {eref['perplexity']:.4f} / {egot['perplexity']:.4f} ({ppl:.4%}); "
          f"KL to float {eref['mean_kl']:.5f} / {egot['mean_kl']:.5f} ({kl:.4%}); float "
          f"{eref['reference_perplexity']:.4f}")
print("E2E", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
    ;;
  *) echo "usage: scripts/gpu-e2e.sh pack [BUILD_DIR] | stage N | run [OUT_DIR]" >&2; exit 2 ;;
esac
