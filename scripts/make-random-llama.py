#!/usr/bin/python3
"""Writes a Llama-shaped Hugging Face checkpoint with random weights, for benchmarks at real layer
shapes (no 7B/70B checkpoint can be fetched here). Uses numpy only (Debian's /usr/bin/python3).

  /usr/bin/python3 scripts/make-random-llama.py --shape 7b --layers 1 \
      --tokenizer-from out/stories260K --out /tmp/llama7b-1block

--shape 7b: hidden 4096, intermediate 11008, 32 heads, 32 KV heads; 70b: 8192 / 28672, 64 heads,
8 KV heads. The vocabulary and tokenizer files come from --tokenizer-from (an HF directory made by
`qcal import`), so the calibration text can be tokenized; the weights are N(0, 0.02²) and the norms 1.
"""
import argparse, json, os, shutil, struct
import numpy as np

SHAPES = {"7b": (4096, 11008, 32, 32), "70b": (8192, 28672, 64, 8)}

def write_safetensors(path, tensors):
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, a in tensors:
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(h))); f.write(h)
        for _, a in tensors:
            f.write(np.ascontiguousarray(a, dtype="<f4").tobytes())
    os.replace(path + ".tmp", path)

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=SHAPES, default="7b")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--tokenizer-from", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    hidden, inter, heads, kv = SHAPES[a.shape]
    src = json.load(open(os.path.join(a.tokenizer_from, "config.json")))
    vocab, hd = src["vocab_size"], hidden // heads
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    g = lambda *s: (rng.standard_normal(s, dtype=np.float32) * 0.02)
    tensors = [("model.embed_tokens.weight", g(vocab, hidden)), ("model.norm.weight", np.ones(hidden, np.float32)),
               ("lm_head.weight", g(vocab, hidden))]
    for l in range(a.layers):
        pre = f"model.layers.{l}."
        tensors += [(pre + "input_layernorm.weight", np.ones(hidden, np.float32)),
                    (pre + "post_attention_layernorm.weight", np.ones(hidden, np.float32)),
                    (pre + "self_attn.q_proj.weight", g(heads * hd, hidden)),
                    (pre + "self_attn.k_proj.weight", g(kv * hd, hidden)),
                    (pre + "self_attn.v_proj.weight", g(kv * hd, hidden)),
                    (pre + "self_attn.o_proj.weight", g(hidden, heads * hd)),
                    (pre + "mlp.gate_proj.weight", g(inter, hidden)),
                    (pre + "mlp.up_proj.weight", g(inter, hidden)),
                    (pre + "mlp.down_proj.weight", g(hidden, inter))]
    write_safetensors(os.path.join(a.out, "model.safetensors"), tensors)
    cfg = dict(src)
    cfg.update({"hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
                "num_key_value_heads": kv, "num_hidden_layers": a.layers, "tie_word_embeddings": False,
                "max_position_embeddings": max(src.get("max_position_embeddings", 2048), 2048)})
    cfg.pop("head_dim", None)
    json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"), indent=2)
    for f in os.listdir(a.tokenizer_from):
        if f.startswith("tokenizer") or f == "generation_config.json":
            shutil.copy(os.path.join(a.tokenizer_from, f), a.out)

if __name__ == "__main__":
    main()
