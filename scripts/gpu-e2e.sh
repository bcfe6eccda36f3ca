#!/usr/bin/env bash
# The device block forward's test (worker_gpu_block_forward_test), then a stories260K job on the
# GPU against the same job on the CPU (issue 15): QuIP# 2-bit (E8P) and
# GPTQ 4-bit with `qcal quantize --device cuda` and `--device cpu` on the same machine, then the
# per-linear proxy losses and the TinyStories perplexity of each pair compared.
#
# The GPU machine lacks qcal's build dependencies, so `pack` bundles the qcal binary, the shared
# libraries it loads (not libc or CUDA's), the model and the data files into one archive, split
# into parts small enough for the device tool's 64 MiB per call:
#   here:  scripts/gpu-e2e.sh pack [BUILD_DIR]      -> .device/qcal.part.0, .1, ...
#   there: scripts/gpu-e2e.sh stage N               (one call per part, carrying .device/qcal.part.N;
#                                                    the parts collect in /tmp/qcal-parts)
#          scripts/gpu-e2e.sh run [OUT_DIR]         (assembles, runs, compares; JSON in OUT_DIR)
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  pack)
    build=${2:-build}
    shared=${QCAL_SHARED_DIR:-../shared}
    stage=$(mktemp -d)/qb
    ninja -C "$build" qcal worker_gpu_block_forward_test || exit 1
    bash scripts/gpu-bundle.sh "$build" "$stage" qcal worker_gpu_block_forward_test > /dev/null || exit 1
    strip --strip-debug "$stage/qcal" "$stage/worker_gpu_block_forward_test"
    mkdir -p "$stage/shared/models" "$stage/shared/data/wikitext2" "$stage/shared/data/tinystories"
    cp -r "$shared/models/stories260K" "$stage/shared/models/"
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
    [ -d /tmp/qb ] || { cat /tmp/qcal-parts/qcal.part.* | xz -d | tar -C /tmp -xf - || exit 1; }
    export LD_LIBRARY_PATH=/tmp/qb/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
    Q=/tmp/qb/qcal S=/tmp/qb/shared W=/tmp/qcal-e2e
    rm -rf "$W" && mkdir -p "$W"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
    # The device block forward and its Hessians against the CPU block (fp32 and bf16).
    /tmp/qb/worker_gpu_block_forward_test > "$out/block-forward-test.log" 2>&1
    echo "worker_gpu_block_forward_test: rc=$?"
    grep -E '^\[ +(OK|FAILED|SKIPPED) |seed|Hessian' "$out/block-forward-test.log" | head -20
    $Q import llama2c "$S/models/stories260K/stories260K.bin" "$S/models/stories260K/tok512.bin" \
      --out "$W/float" > /dev/null || exit 1
    for r in quip-e8p-2bit gptq-4bit; do
      for d in cpu cuda; do
        start=$(date +%s.%N)
        $Q --log-level info quantize --recipe "jobs/$r.yaml" --model "$W/float" --out "$W/$r-$d" \
          --data-root "$S" --device "$d" --threads 8 --json > "$out/$r-$d.json" 2> "$out/$r-$d.log"
        rc=$?
        echo "$r --device $d: rc=$rc $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s; $(grep -o 'device [^"]*' "$out/$r-$d.log" | head -1)"
        [ $rc = 0 ] || tail -5 "$out/$r-$d.log"
        $Q eval --model "$W/$r-$d" --reference "$W/float" --data "$S/data/tinystories/TinyStories-valid.sample30k.txt" \
          --ctx 512 --bos-per-window --json > "$out/eval-$r-$d.json" 2>> "$out/$r-$d.log"
      done
    done
    python3 - "$out" <<'PY'
import json, sys, os
out = sys.argv[1]
ok = True
for r in ["quip-e8p-2bit", "gptq-4bit"]:
    try:
        last = lambda f: json.loads(open(f).read().strip().splitlines()[-1])
        cpu = last(f"{out}/{r}-cpu.json"); gpu = last(f"{out}/{r}-cuda.json")
        ecpu = last(f"{out}/eval-{r}-cpu.json"); egpu = last(f"{out}/eval-{r}-cuda.json")
    except Exception as e:
        print(r, "missing output:", e); ok = False; continue
    worst = 0.0; n = 0
    for bc, bg in zip(cpu["blocks"], gpu["blocks"]):
        for lc, lg in zip(bc["linears"], bg["linears"]):
            a, b = lc["proxy_loss"], lg["proxy_loss"]
            if a is None or b is None: continue
            n += 1
            worst = max(worst, abs(b - a) / max(abs(a), 1e-30))
    pc, pg = ecpu["perplexity"], egpu["perplexity"]
    rel = abs(pg - pc) / pc
    print(f"{r}: {n} linears, worst relative proxy-loss difference {worst:.4%}; "
          f"TinyStories perplexity cpu {pc:.4f} gpu {pg:.4f} (relative {rel:.4%}; "
          f"KL to float cpu {ecpu['mean_kl']:.5f} gpu {egpu['mean_kl']:.5f}; float "
          f"{ecpu['reference_perplexity']:.4f})")
    ok &= worst <= 0.01 and rel <= 0.01
print("E2E", "PASS" if ok else "FAIL")
PY
    ;;
  *) echo "usage: scripts/gpu-e2e.sh pack [BUILD_DIR] | stage N | run [OUT_DIR]" >&2; exit 2 ;;
esac
