#!/usr/bin/python3
"""Writes a Llama-shaped Hugging Face checkpoint with random weights, for benchmarks at real layer
shapes (no 7B/70B checkpoint can be fetched here). Uses numpy only (Debian's /usr/bin/python3).

  /usr/bin/python3 scripts/make-random-llama.py --shape 7b --layers 1 \\
      --tokenizer-from out/stories260K --out /tmp/llama7b-1block
  /usr/bin/python3 scripts/make-random-llama.py --shape llama3-8b --layers 2 --dtype bf16 \\
      --out /tmp/llama3-8b-2layers          # the real Llama 3 tokenizer, sharded bf16

Shapes (hidden, intermediate, heads, KV heads):
  7b   4096 / 11008, 32 / 32   Llama 2; vocabulary and tokenizer from --tokenizer-from (an HF
                               directory made by `qcal import`)
  70b  8192 / 28672, 64 / 8    Llama 2 70B, likewise
  llama3-8b   4096 / 14336, 32 / 8     Llama 3.1 8B: vocabulary 128,256, head_dim 128,
  llama3-70b  8192 / 28672, 64 / 8     rope_theta 500,000, llama3 rope_scaling (factor 8,
                                       original context 8192), context 131,072, untied head,
                                       bos 128000, eos [128001, 128008, 128009]; tokenizer.json
                                       and tokenizer_config.json from --tokenizer-from (default
                                       ../shared/models/llama3-tokenizer)
Mixture-of-experts shapes (issue 53); tokenizer from --tokenizer-from (default the Llama 3
tokenizer, whose 128,256 tokens size the tables; a directory with a config.json, such as one made
by `qcal import`, gives its vocab_size instead):
  mixtral-8x7b  4096 / 14336, 32 / 8, 8 experts top 2: MixtralForCausalLM (rope_theta 1e6,
                block_sparse_moe.gate and experts.<e>.w1/w3/w2 per layer)
  llama4-scout  5120 / 8192 (experts; dense MLP 16384), 40 / 8, head_dim 128, 16 experts top 1,
                a shared expert, MoE on every layer, NoPE every 4th layer, qk-norm, chunked
                attention (8192): Llama4ForCausalLM with fused experts.gate_up_proj [16, 5120,
                16384] and experts.down_proj [16, 8192, 5120]
Weights are N(0, 0.02^2), norms 1, each tensor from its own seeded stream, written one at a time
(F32 or BF16, round to nearest even) into shards of at most --max-shard-mb with
model.safetensors.index.json when there is more than one.
"""
import argparse, json, os, shutil, struct, zlib
import numpy as np

SHAPES = {"7b": (4096, 11008, 32, 32), "70b": (8192, 28672, 64, 8),
          "llama3-8b": (4096, 14336, 32, 8), "llama3-70b": (8192, 28672, 64, 8),
          "mixtral-8x7b": (4096, 14336, 32, 8), "llama4-scout": (5120, 8192, 40, 8)}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def to_bf16(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=SHAPES, default="7b")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--tokenizer-from")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--max-shard-mb", type=int, default=5000)
    a = p.parse_args()
    hidden, inter, heads, kv = SHAPES[a.shape]
    llama3 = a.shape.startswith("llama3")
    family = ("mixtral" if a.shape == "mixtral-8x7b" else
              "llama4" if a.shape == "llama4-scout" else "llama")
    tok_dir = a.tokenizer_from or (os.path.join(ROOT, "..", "shared", "models", "llama3-tokenizer")
                                   if llama3 or family != "llama" else None)
    if tok_dir is None:
        p.error("--tokenizer-from is required for Llama 2 shapes")
    hd = 128 if family == "llama4" else hidden // heads
    if family != "llama":
        # The tokenizer's vocabulary sizes the tables (config.json's vocab_size when the
        # directory has one, else the Llama 3 tokenizer's 128,256).
        cfg_path = os.path.join(tok_dir, "config.json")
        vocab = (json.load(open(cfg_path))["vocab_size"] if os.path.exists(cfg_path) else 128256)
        cfg = {"hidden_act": "silu", "head_dim": hd, "rms_norm_eps": 1e-5,
               "max_position_embeddings": 32768, "bos_token_id": 1, "eos_token_id": 2,
               "num_experts_per_tok": 2 if family == "mixtral" else 1,
               "num_local_experts": 8 if family == "mixtral" else 16}
        if family == "mixtral":
            cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                       rope_theta=1e6, sliding_window=None, router_aux_loss_coef=0.02)
        else:
            cfg.update(architectures=["Llama4ForCausalLM"], model_type="llama4_text",
                       rope_theta=500000.0, intermediate_size_mlp=16384,
                       interleave_moe_layer_step=1,
                       no_rope_layers=[int((l + 1) % 4 != 0) for l in range(a.layers)],
                       use_qk_norm=True, attn_temperature_tuning=True, floor_scale=8192,
                       attn_scale=0.1, attention_chunk_size=8192,
                       rope_scaling={"factor": 16.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 1.0,
                                     "original_max_position_embeddings": 8192,
                                     "rope_type": "llama3"})
    elif llama3:
        vocab = 128256
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
               "mlp_bias": False, "hidden_act": "silu", "head_dim": hd, "rms_norm_eps": 1e-5,
               "rope_theta": 500000.0, "max_position_embeddings": 131072,
               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
               "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}
    else:
        src = json.load(open(os.path.join(tok_dir, "config.json")))
        vocab = src["vocab_size"]
        cfg = dict(src)
        cfg.pop("head_dim", None)
        cfg["max_position_embeddings"] = max(src.get("max_position_embeddings", 2048), 2048)
    cfg.update({"hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
                "num_key_value_heads": kv, "num_hidden_layers": a.layers, "vocab_size": vocab,
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16" if a.dtype == "bf16" else "float32"})

    # (name, shape, init): "n" = N(0, 0.02^2), "1" = ones. Order: embeddings, blocks, norm, head.
    specs = [("model.embed_tokens.weight", (vocab, hidden), "n")]
    for l in range(a.layers):
        pre = f"model.layers.{l}."
        specs += [(pre + "input_layernorm.weight", (hidden,), "1"),
                  (pre + "self_attn.q_proj.weight", (heads * hd, hidden), "n"),
                  (pre + "self_attn.k_proj.weight", (kv * hd, hidden), "n"),
                  (pre + "self_attn.v_proj.weight", (kv * hd, hidden), "n"),
                  (pre + "self_attn.o_proj.weight", (hidden, heads * hd), "n"),
                  (pre + "post_attention_layernorm.weight", (hidden,), "1")]
        if family == "mixtral":
            E = cfg["num_local_experts"]
            specs += [(pre + "block_sparse_moe.gate.weight", (E, hidden), "n")]
            for e in range(E):
                x = f"{pre}block_sparse_moe.experts.{e}."
                specs += [(x + "w1.weight", (inter, hidden), "n"),
                          (x + "w3.weight", (inter, hidden), "n"),
                          (x + "w2.weight", (hidden, inter), "n")]
        elif family == "llama4":
            E, f = cfg["num_local_experts"], pre + "feed_forward."
            specs += [(f + "router.weight", (E, hidden), "n"),
                      (f + "experts.gate_up_proj", (E, hidden, 2 * inter), "n"),
                      (f + "experts.down_proj", (E, inter, hidden), "n"),
                      (f + "shared_expert.gate_proj.weight", (inter, hidden), "n"),
                      (f + "shared_expert.up_proj.weight", (inter, hidden), "n"),
                      (f + "shared_expert.down_proj.weight", (hidden, inter), "n")]
        else:
            specs += [(pre + "mlp.gate_proj.weight", (inter, hidden), "n"),
                      (pre + "mlp.up_proj.weight", (inter, hidden), "n"),
                      (pre + "mlp.down_proj.weight", (hidden, inter), "n")]
    specs += [("model.norm.weight", (hidden,), "1"), ("lm_head.weight", (vocab, hidden), "n")]

    elem = 2 if a.dtype == "bf16" else 4
    limit = a.max_shard_mb * 1024 * 1024
    shards, cur, cur_bytes = [], [], 0
    for s in specs:
        n = int(np.prod(s[1])) * elem
        if cur and cur_bytes + n > limit:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(s)
        cur_bytes += n
    shards.append(cur)

    os.makedirs(a.out, exist_ok=True)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, _ in shard:
            n = int(np.prod(shape)) * elem
            header[name] = {"dtype": "BF16" if a.dtype == "bf16" else "F32", "shape": list(shape),
                            "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = fname
        total += offset
        h = json.dumps(header).encode()
        h += b" " * ((8 - len(h) % 8) % 8)
        path = os.path.join(a.out, fname)
        with open(path + ".tmp", "wb") as f:
            f.write(struct.pack("<Q", len(h)))
            f.write(h)
            for name, shape, init in shard:
                # Written in row chunks (a 128256 x 8192 table is 4 GB in float32 and its bf16
                # rounding needs 2x that in uint64): the generator's stream is consumed in the
                # same order, so the bytes are those of one whole draw.
                rng = np.random.default_rng([a.seed, zlib.crc32(name.encode())])
                rows = shape[0]
                cols = int(np.prod(shape[1:])) if len(shape) > 1 else 1
                step = max(1, (64 << 20) // (4 * cols))
                for r0 in range(0, rows, step):
                    sub = (min(step, rows - r0),) + tuple(shape[1:])
                    if init == "1":
                        t = np.ones(sub, np.float32)
                    else:
                        t = rng.standard_normal(sub, dtype=np.float32)
                        t *= np.float32(0.02)
                    f.write(to_bf16(t).tobytes() if a.dtype == "bf16" else t.astype("<f4").tobytes())
                    del t
        os.replace(path + ".tmp", path)
    if len(shards) > 1:
        with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    for f in os.listdir(tok_dir):
        if f.startswith("tokenizer") or f in ("generation_config.json", "special_tokens_map.json"):
            shutil.copyfile(os.path.join(tok_dir, f), os.path.join(a.out, f))
    json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"), indent=2)


if __name__ == "__main__":
    main()
