# Shared by the recipe-comparison benches on the two bundled models (bench/w4a4-servable.sh,
# bench/kv-fp8.sh); sourced, not run. Needs Q (the qcal binary), SHARED (the shared folder) and
# TS (the evaluation text) set.

# prepare_model OUT_DIR MODEL: imports ../shared/models/MODEL into OUT_DIR/MODEL and plants
# outliers into OUT_DIR/MODEL-planted (qcal tool plant-outliers --alpha 50 --beta 50, as the
# QuaRot and SpinQuant tables), once each; prints the evaluation context (512, or the model's
# max_position_embeddings when shorter: aidreams260K's 128).
prepare_model() {
  local base="$1/$2"
  [ -f "$base/config.json" ] || $Q import llama2c "$SHARED/models/$2/$2.bin" \
      "$SHARED/models/$2/tok512.bin" --out "$base" > /dev/null
  [ -f "$base-planted/config.json" ] || $Q tool plant-outliers --model "$base" \
      --out "$base-planted" --alpha 50 --beta 50 > /dev/null
  /usr/bin/python3 -c "import json,sys; print(min(512, json.load(open(sys.argv[1]))['max_position_embeddings']))" \
      "$base/config.json"
}

# float_eval MODEL_DIR CTX: the float model's perplexity (qcal eval --json's last line).
float_eval() {
  $Q eval --model "$1" --data "$TS" --ctx "$2" --bos-per-window --threads 1 --json | tail -1
}

# job_eval RECIPE MODEL_DIR OUT CTX: the recipe as a job (`qcal quantize`, one thread; log in
# OUT.log), then `qcal eval --reference MODEL_DIR --bos-per-window` on TS (perplexity and mean
# KL(float || quantized) per token): prints the job's seconds and the eval's JSON line, tab apart.
job_eval() {
  local t0 t1 j
  rm -rf "$3" "$3.job"
  t0=$(date +%s.%N)
  $Q --log-level info quantize --recipe "$1" --model "$2" --out "$3" --data-root "$SHARED" \
    --threads 1 > "$3.log" 2>&1
  t1=$(date +%s.%N)
  j=$($Q eval --model "$3" --reference "$2" --data "$TS" --ctx "$4" --bos-per-window \
    --threads 1 --json | tail -1)
  printf '%.2f\t%s\n' "$(echo "$t1 - $t0" | bc)" "$j"
}
