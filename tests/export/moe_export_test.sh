#!/usr/bin/env bash
# Issue 53, deliverable 5: `qcal export` of quantized mixture-of-experts checkpoints, on
# stories260K upcycled into the three layouts (tests/reference/moe_reference.py upcycle): Mixtral
# (4 experts, top 2), Llama4ForCausalLM and Llama4ForConditionalGeneration (4 experts, top 1, a
# shared expert, MoE on every other layer beside dense layers of another width, a vision tower).
# Per layout, quantized with GPTQ (4-bit per channel; the multimodal one groups of 32 with
# act-order, so the experts carry g_idx; Mixtral also 3-bit asymmetric groups of 32, its zero
# points exported to compressed-tensors):
#  * dense: `qcal eval` of the export (Hugging Face's float layout; Llama 4's experts fused back
#    into gate_up_proj / down_proj) gives the checkpoint's perplexity (1e-4 relative);
#  * gptq and compressed-tensors: the independent numpy readers (tests/reference/gptq_dequant.py,
#    ct_dequant.py) dequantize every expert linear to exactly the dense export's weights (Llama 4:
#    after moe_reference.py fuse-experts), and their float models give the checkpoint's
#    perplexity;
#  * names: each routed expert's tensors under the names vLLM's loaders map (Mixtral
#    block_sparse_moe.experts.<e>.w1/w3/w2, Llama 4 feed_forward.experts.<e>.gate/up/down_proj),
#    routers in float and listed as unquantized, Llama 4's q/k/v_proj as float weights (vLLM
#    permutes only tensors named `weight` into its RoPE layout) named in GPTQ's "dynamic" and
#    compressed-tensors' "ignore";
#  * the multimodal checkpoint's vision tower and projector come out byte for byte as the source
#    model stores them, in every format.
# Usage (ctest runs it): moe_export_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
shared=${QCAL_SHARED_DIR:-$src/../shared}
q="$build/client/qcal"
py=/usr/bin/python3
ref="$src/tests/reference"
work=$(mktemp -d /tmp/qcal-moe-export.XXXXXX)
trap 'rm -rf "$work"' EXIT
data="$shared/data/tinystories/TinyStories-valid.sample30k.txt"

"$q" import llama2c "$shared/models/stories260K/stories260K.bin" \
  "$shared/models/stories260K/tok512.bin" --out "$work/dense" > /dev/null
common=(--noise 0.05 --seed 1 --experts 4)
"$py" "$ref/moe_reference.py" upcycle --dense "$work/dense" --out "$work/mixtral" \
  --layout mixtral --top-k 2 "${common[@]}" > /dev/null
for layout in llama4 llama4-mm; do
  "$py" "$ref/moe_reference.py" upcycle --dense "$work/dense" --out "$work/$layout" \
    --layout "$layout" --top-k 1 --shared-scale 0.5 --router-scale 16 --moe-step 2 --mlp-pad 4 \
    "${common[@]}" > /dev/null
done

cat > "$work/g4.yaml" <<'EOF'
name: moe-gptq-4bit
method: gptq
bits: 4
scalar: {group_size: -1, symmetric: true, act_order: true, clip_search: true}
calibration: {files: [data/wikitext2/wiki.valid.tokens], num_sequences: 32, seq_len: 128}
EOF
cat > "$work/g4g32.yaml" <<'EOF'
name: moe-gptq-4bit-g32
method: gptq
bits: 4
scalar: {group_size: 32, symmetric: true, act_order: true, clip_search: true}
calibration: {files: [data/wikitext2/wiki.valid.tokens], num_sequences: 32, seq_len: 128}
EOF
cat > "$work/g3.yaml" <<'EOF'
name: moe-gptq-3bit-g32-asym
method: gptq
bits: 3
scalar: {group_size: 32, symmetric: false, act_order: true, clip_search: true}
calibration: {files: [data/wikitext2/wiki.valid.tokens], num_sequences: 32, seq_len: 128}
EOF

fail=0
ppl() {  # ppl MODEL_DIR -> perplexity
  "$q" eval --model "$1" --data "$data" --ctx 256 --bos-per-window --max-tokens 20000 \
    --threads 1 --json | tail -1 |
    "$py" -c 'import json, sys; print(repr(json.load(sys.stdin)["perplexity"]))'
}
source "$src/tests/export/checks.sh"  # close
export_to() {  # export_to FORMAT IN OUT
  if ! "$q" export --format "$1" "$2" "$3" > "$3.log" 2>&1; then
    echo "FAIL export --format $1 $2: $(cat "$3.log")"; fail=1; return 1
  fi
}
dequant_matches() {  # dequant_matches READER EXPORT DENSE LABEL
  local out="$2-deq"
  if [ "$1" = ct_dequant.py ] && ! "$py" "$ref/ct_dequant.py" check "$2" > "$out.check"; then
    echo "FAIL $4: $(cat "$out.check")"; fail=1; return
  fi
  "$py" "$ref/$1" dequant "$2" "$out" > /dev/null
  "$py" "$ref/moe_reference.py" fuse-experts --model "$out" > /dev/null
  if "$py" "$ref/gptq_dequant.py" compare "$out" "$3" > "$out.cmp" &&
     "$py" "$ref/gptq_dequant.py" compare "$3" "$out" > "$out.cmp2"; then
    echo "ok   $4: $(tail -1 "$out.cmp") (numpy reader vs qcal export --format dense)"
  else
    echo "FAIL $4:"; cat "$out.cmp" "$out.cmp2" 2>/dev/null | grep -v '^compared' | head; fail=1
  fi
  close "$(ppl "$5")" "$(ppl "$out")" "$4: checkpoint vs its export read back"
}

for layout in mixtral llama4 llama4-mm; do
  recipe=g4
  [ "$layout" = llama4-mm ] && recipe=g4g32
  ckpt="$work/$layout-$recipe"
  "$q" quantize --recipe "$work/$recipe.yaml" --model "$work/$layout" --out "$ckpt" \
    --data-root "$shared" --threads 1 > "$ckpt.log" 2>&1 || { cat "$ckpt.log"; exit 1; }
  export_to dense "$ckpt" "$ckpt-dense" || continue
  close "$(ppl "$ckpt")" "$(ppl "$ckpt-dense")" "$layout $recipe: checkpoint vs dense export"
  export_to gptq "$ckpt" "$ckpt-gptq" &&
    dequant_matches gptq_dequant.py "$ckpt-gptq" "$ckpt-dense" "$layout $recipe gptq" "$ckpt"
  export_to compressed-tensors "$ckpt" "$ckpt-ct" &&
    dequant_matches ct_dequant.py "$ckpt-ct" "$ckpt-dense" "$layout $recipe compressed-tensors" \
      "$ckpt"

  # What vLLM's loaders read, and what the source model stores outside the text model.
  "$py" - "$layout" "$work/$layout" "$ckpt-gptq" "$ckpt-ct" "$ckpt-dense" <<'EOF' || fail=1
import json, os, re, struct, sys

layout, source, gptq, ct, dense = sys.argv[1:]


def headers(d):
    index = os.path.join(d, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    out = {}
    for name in files:
        with open(os.path.join(d, name), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            h = json.loads(f.read(n))
            base = 8 + n
            for k, v in h.items():
                if k == "__metadata__":
                    continue
                b, e = v["data_offsets"]
                f.seek(base + b)
                out[k] = (v["dtype"], v["shape"], f.read(e - b))
    return out


config = json.load(open(os.path.join(source, "config.json")))
text = config.get("text_config", config)
prefix = "language_model." if layout == "llama4-mm" else ""
experts = text["num_local_experts"]
if layout == "mixtral":
    moe = list(range(text["num_hidden_layers"]))
else:
    moe = [l for l in range(text["num_hidden_layers"]) if (l + 1) % 2 == 0]
problems = []
src = headers(source)
for fmt, d, suffixes in (("gptq", gptq, (".qweight", ".qzeros", ".scales", ".g_idx")),
                         ("compressed-tensors", ct, (".weight_packed", ".weight_scale",
                                                     ".weight_shape")),
                         ("dense", dense, (".weight",))):
    t = headers(d)
    qc = json.load(open(os.path.join(d, "config.json"))).get("quantization_config")
    for l in moe:
        block = f"{prefix}model.layers.{l}."
        if layout == "mixtral":
            names = [f"block_sparse_moe.experts.{e}.{w}" for e in range(experts)
                     for w in ("w1", "w2", "w3")]
            router = block + "block_sparse_moe.gate.weight"
        else:
            names = [f"feed_forward.experts.{e}.{w}" for e in range(experts)
                     for w in ("gate_proj", "up_proj", "down_proj")]
            names += [f"feed_forward.shared_expert.{w}" for w in ("gate_proj", "up_proj", "down_proj")]
            router = block + "feed_forward.router.weight"
        if fmt == "dense" and layout != "mixtral":
            names = [n for n in names if ".experts." not in n]
            for fused in ("feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"):
                if block + fused not in t:
                    problems.append(f"{fmt}: {block + fused} missing")
        for n in names:
            for s in suffixes:
                if block + n + s not in t:
                    problems.append(f"{fmt}: {block + n + s} missing")
        if router not in t or t[router][0] not in ("F32", "BF16", "F16"):
            problems.append(f"{fmt}: router {router} missing or not float")
    if layout != "mixtral" and fmt != "dense":
        for w in ("q_proj", "k_proj", "v_proj"):
            name = f"{prefix}model.layers.0.self_attn.{w}"
            if name + ".weight" not in t or any(name + s in t for s in suffixes):
                problems.append(f"{fmt}: {name} is not a float weight")
        if (f"{prefix}model.layers.0.self_attn.o_proj" + suffixes[0]) not in t:
            problems.append(f"{fmt}: o_proj is not quantized")
    if fmt == "gptq" and layout != "mixtral":
        rules = list((qc or {}).get("dynamic", {}))
        if len(rules) != 1 or not rules[0].startswith("-:"):
            problems.append(f"gptq: dynamic {qc.get('dynamic')}")
        else:
            rule = rules[0][2:]
            for name, want in (("self_attn.qkv_proj", True), ("self_attn.q_proj", True),
                               ("self_attn.o_proj", False), ("feed_forward.experts", False)):
                full = f"{prefix}model.layers.3.{name}"
                if bool(re.match(rule, full)) != want:
                    problems.append(f"gptq: dynamic rule {rule} on {full}: {not want}")
    if fmt == "compressed-tensors":
        ignore = qc["ignore"]
        want = [prefix + "lm_head"]
        if layout == "mixtral":
            want += [r"re:.*block_sparse_moe\.gate$"]
        else:
            want += [r"re:.*feed_forward\.router$", r"re:.*self_attn\.(q|k|v)_proj$"]
        if layout == "llama4-mm":
            want += ["re:vision_model.*", "re:multi_modal_projector.*"]
        if ignore != want:
            problems.append(f"compressed-tensors: ignore {ignore}, want {want}")
    if layout == "llama4-mm":
        outside = [n for n in src if not n.startswith("language_model.")]
        if not outside:
            problems.append("the source model has no vision tensors")
        for n in outside:
            if t.get(n) != src[n]:
                problems.append(f"{fmt}: {n} is not the source's bytes")
for p in problems:
    print("FAIL", layout, p)
if not problems:
    print(f"ok   {layout}: expert, router and attention names and the unquantized lists for "
          f"vLLM in gptq, compressed-tensors and dense"
          + ("; vision tensors byte-identical" if layout == "llama4-mm" else ""))
sys.exit(1 if problems else 0)
EOF
done
# Asymmetric groups on experts (zero points packed along the outputs, g_idx): compressed-tensors.
# (GPTQ v1 stores zero - 1 and refuses a zero point of 0, which 3-bit groups meet here.)
ckpt="$work/mixtral-g3"
"$q" quantize --recipe "$work/g3.yaml" --model "$work/mixtral" --out "$ckpt" \
  --data-root "$shared" --threads 1 > "$ckpt.log" 2>&1 || { cat "$ckpt.log"; exit 1; }
export_to dense "$ckpt" "$ckpt-dense" && export_to compressed-tensors "$ckpt" "$ckpt-ct" &&
  dequant_matches ct_dequant.py "$ckpt-ct" "$ckpt-dense" "mixtral g3 asym compressed-tensors" \
    "$ckpt"
exit $fail
