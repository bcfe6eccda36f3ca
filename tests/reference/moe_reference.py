#!/usr/bin/python3
"""An independent numpy reference (float64) of the Hugging Face mixture-of-experts Llama-family
forward passes, for issue 53's tests: MixtralForCausalLM, and the text model of Llama 4 both as
Llama4ForCausalLM and as Llama4ForConditionalGeneration (weights under "language_model.", the
vision tower and projector beside it). Written from transformers' formulas (modeling_mixtral.py,
modeling_llama4.py); it shares no code with qcal.

Mixtral: RoPE on half-split pairs; per token, softmax over the router's logits, the top k
experts, their weights renormalized to sum 1; an expert is w2(silu(w1 x) * w3 x); an optional
sliding window. Llama 4: RoPE on interleaved pairs (2i, 2i+1) with the config's rope_scaling;
NoPE layers (no_rope_layers[l] == 0) with attention temperature tuning (queries times
log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1); L2 qk-norm (no weight) after RoPE on
RoPE layers when use_qk_norm; chunked attention (attention_chunk_size) on RoPE layers, full
causal attention on NoPE layers; on MoE layers (moe_layers, else every interleave_moe_layer_step-th)
the router's top-k logits through a sigmoid scale each chosen expert's *input*, the experts are
fused ([E, D, 2I] gate_up_proj, [E, I, D] down_proj), and the shared expert is added; other
layers are a dense MLP of intermediate_size_mlp.

  moe_reference.py upcycle --dense DIR --layout mixtral|llama4|llama4-mm --out DIR
        [--experts 4 --top-k 2 --noise 0.0 --seed 0 --shared-scale 1.0 --router-scale 1.0]
        [--moe-step 1 --mlp-pad 0 --nope-interval 0 --qk-norm --temperature-tuning
         --floor-scale 8192 --chunk 8192]  (Llama 4 layouts)
      a MoE model made from a dense Llama (DIR/config.json + DIR/model.safetensors, F32): every
      expert a copy of the block's MLP (perturbed by N(0, noise^2) relative noise); Llama 4's
      q/k rows permuted from half-split to interleaved RoPE pairs (the same model), its shared
      expert the MLP times shared-scale and its routed experts' down_proj times 1 - shared-scale.
      With noise 0 the Mixtral layout, and the Llama 4 layouts with shared-scale 1, compute the
      dense model's logits. Other files of the dense directory (the tokenizer's) are copied.
  moe_reference.py bf16-shards --model DIR --out DIR [--shards 2]
      the model as bfloat16 (rounded to nearest even) in shards with model.safetensors.index.json
  moe_reference.py fuse-experts --model DIR
      a Llama 4 model with per-expert float weights (a quantized export dequantized by
      tests/reference/gptq_dequant.py or ct_dequant.py) rewritten in place in the fused layout
  moe_reference.py logits --model DIR --tokens 1,2,3 --out FILE
      the logits [len(tokens), vocab] as little-endian float32
  moe_reference.py expert-hessians --model DIR --tokens 1,2,3/4,5,6 --out DIR [--route-all]
      each routed expert's input Hessians over the sequences (separated by "/"): for MoE layer
      l and expert e, OUT/l<l>.e<e>.gate_up.f64 and OUT/l<l>.e<e>.down.f64, the means of x x^T
      over its rows as little-endian float64 [n, n], and OUT/counts.json {"l": {"e": [routed
      tokens, rows]}}. Its rows: the tokens the router chose it for (Llama 4: scaled by the
      sigmoid of its logit), or with --route-all every token (Llama 4: scaled by the sigmoid of
      its own logit for that token).
"""
import argparse, json, math, os, shutil, struct, sys
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_reference import inv_freq, read_safetensors, rms_norm, rotate_half, write_safetensors  # noqa: E402


def silu(x):
    return x / (1 + np.exp(-x))


def softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def attention(q, k, v, mask):
    """q [s, heads, hd], k/v [s, kv, hd] (GQA), mask [s, s] additive -> [s, heads * hd]."""
    s, heads, hd = q.shape
    k = np.repeat(k, heads // k.shape[1], axis=1)
    v = np.repeat(v, heads // v.shape[1], axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + mask
    return np.einsum("hqk,khd->qhd", softmax(scores), v).reshape(s, heads * hd)


def causal_mask(s, window=None, chunk=None):
    qi, ki = np.arange(s)[:, None], np.arange(s)[None, :]
    allowed = ki <= qi
    if window:  # Mixtral's sliding window: the last `window` positions
        allowed &= qi - ki < window
    if chunk:  # Llama 4's chunked attention: within the same chunk
        allowed &= (qi // chunk) == (ki // chunk)
    return np.where(allowed, 0.0, -np.inf)


def mixtral_forward(c, w, ids, stats=None):
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or c["hidden_size"] // heads
    eps, s = c["rms_norm_eps"], len(ids)
    emb = np.outer(np.arange(s, dtype=np.float64), inv_freq(c))
    emb = np.concatenate([emb, emb], -1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
    mask = causal_mask(s, window=c.get("sliding_window"))
    experts, top_k = c["num_local_experts"], c["num_experts_per_tok"]
    x = w["model.embed_tokens.weight"][ids]
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(s, heads, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(s, kv, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(s, kv, hd)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        x = x + attention(q, k, v, mask) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        m = p + "block_sparse_moe."
        probs = softmax(h @ w[m + "gate.weight"].T)  # [s, E]
        chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
        if stats is not None:
            for e in range(experts):
                ep = f"{m}experts.{e}."
                routed = np.array([t for t in range(s) if e in chosen[t]], dtype=np.int64)
                xin = h if stats["route_all"] else h[routed]
                d = silu(xin @ w[ep + "w1.weight"].T) * (xin @ w[ep + "w3.weight"].T)
                add_expert_stats(stats, l, e, len(routed), xin, d)
        out = np.zeros_like(h)
        for t in range(s):
            weights = probs[t, chosen[t]]
            weights = weights / weights.sum()
            for e, r in zip(chosen[t], weights):
                ep = f"{m}experts.{e}."
                y = silu(h[t] @ w[ep + "w1.weight"].T) * (h[t] @ w[ep + "w3.weight"].T)
                out[t] += r * (y @ w[ep + "w2.weight"].T)
        x = x + out
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
    return rms_norm(x, w["model.norm.weight"], eps) @ head.T


def rope_interleaved(x, cos, sin):
    """x [s, heads, hd]: pairs (2i, 2i+1) rotated by the angle of frequency i."""
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def llama4_moe_layers(c):
    if c.get("moe_layers") is not None:
        return set(c["moe_layers"])
    step = c.get("interleave_moe_layer_step", 1)
    return set(range(step - 1, c["num_hidden_layers"], step))


def llama4_forward(c, w, ids, prefix="", stats=None):
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or c["hidden_size"] // heads
    eps, s = c["rms_norm_eps"], len(ids)
    freqs = np.outer(np.arange(s, dtype=np.float64), inv_freq(c))
    cos, sin = np.cos(freqs)[:, None, :], np.sin(freqs)[:, None, :]  # [s, 1, hd / 2]
    # Hugging Face's Llama4TextConfig defaults: absent (or empty) no_rope_layers make every 4th
    # layer NoPE; qk-norm and temperature tuning on; 8192-token chunks (null: none).
    no_rope = c.get("no_rope_layers") or [int((l + 1) % c.get("no_rope_layer_interval", 4) != 0)
                                           for l in range(c["num_hidden_layers"])]
    moe = llama4_moe_layers(c)
    top_k, experts = c.get("num_experts_per_tok", 1), c.get("num_local_experts", 16)
    chunk = c.get("attention_chunk_size", 8192)
    qk_norm, tuning = c.get("use_qk_norm", True), c.get("attn_temperature_tuning", True)
    pos = np.arange(s, dtype=np.float64)
    temperature = np.log1p(np.floor((pos + 1.0) / c.get("floor_scale", 8192))) * c.get(
        "attn_scale", 0.1) + 1.0
    g = lambda n: w[prefix + n]  # noqa: E731
    x = g("model.embed_tokens.weight")[ids]
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        use_rope = bool(no_rope[l])
        h = rms_norm(x, g(p + "input_layernorm.weight"), eps)
        q = (h @ g(p + "self_attn.q_proj.weight").T).reshape(s, heads, hd)
        k = (h @ g(p + "self_attn.k_proj.weight").T).reshape(s, kv, hd)
        v = (h @ g(p + "self_attn.v_proj.weight").T).reshape(s, kv, hd)
        if use_rope:
            q, k = rope_interleaved(q, cos, sin), rope_interleaved(k, cos, sin)
            if qk_norm:
                q = q / np.sqrt((q * q).mean(-1, keepdims=True) + eps)
                k = k / np.sqrt((k * k).mean(-1, keepdims=True) + eps)
        elif tuning:
            q = q * temperature[:, None, None]
        mask = causal_mask(s, chunk=chunk if use_rope else None)
        x = x + attention(q, k, v, mask) @ g(p + "self_attn.o_proj.weight").T
        h = rms_norm(x, g(p + "post_attention_layernorm.weight"), eps)
        f = p + "feed_forward."
        if l not in moe:
            y = silu(h @ g(f + "gate_proj.weight").T) * (h @ g(f + "up_proj.weight").T)
            x = x + y @ g(f + "down_proj.weight").T
            continue
        logits = h @ g(f + "router.weight").T  # [s, E]
        chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
        gate_up, down = g(f + "experts.gate_up_proj"), g(f + "experts.down_proj")
        inter = down.shape[1]
        if stats is not None:
            score = 1 / (1 + np.exp(-logits))  # [s, E]
            for e in range(experts):
                routed = np.array([t for t in range(s) if e in chosen[t]], dtype=np.int64)
                rows = np.arange(s) if stats["route_all"] else routed
                xin = h[rows] * score[rows, e][:, None]
                gu = xin @ gate_up[e]
                add_expert_stats(stats, l, e, len(routed), xin, gu[:, inter:] * silu(gu[:, :inter]))
        sh = f + "shared_expert."
        out = (silu(h @ g(sh + "gate_proj.weight").T) * (h @ g(sh + "up_proj.weight").T)) @ g(
            sh + "down_proj.weight").T
        for t in range(s):
            for e in chosen[t]:
                xin = h[t] / (1 + np.exp(-logits[t, e]))  # the sigmoid score scales the input
                gu = xin @ gate_up[e]
                out[t] += (gu[inter:] * silu(gu[:inter])) @ down[e]
        x = x + out
    head = prefix + ("lm_head.weight" if prefix + "lm_head.weight" in w else "model.embed_tokens.weight")
    return rms_norm(x, g("model.norm.weight"), eps) @ w[head].T


def read_model(d):
    """config.json and the weights of model.safetensors or of the shards its index names."""
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    index = os.path.join(d, "model.safetensors.index.json")
    if not os.path.exists(index):
        return config, read_safetensors(os.path.join(d, "model.safetensors"))
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    w = {}
    for name in files:
        w.update(read_safetensors(os.path.join(d, name)))
    return config, w


def to_bf16(x):
    """float -> bfloat16 bits, rounded to nearest even."""
    u = np.ascontiguousarray(x, dtype="<f4").view("<u4").astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def bf16_shards(a):
    """The model of --model as bfloat16 in --shards files with an index, as Hugging Face
    checkpoints are stored (tensors in name order, split into contiguous runs)."""
    config, w = read_model(a.model)
    names = sorted(w)
    per = -(-len(names) // a.shards)
    os.makedirs(a.out, exist_ok=True)
    weight_map = {}
    for i in range(a.shards):
        fname = f"model-{i + 1:05d}-of-{a.shards:05d}.safetensors"
        chunk = names[i * per:(i + 1) * per]
        header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
        for name in chunk:
            b = to_bf16(w[name]).tobytes()
            header[name] = {"dtype": "BF16", "shape": list(w[name].shape),
                            "data_offsets": [offset, offset + len(b)]}
            offset += len(b)
            blobs.append(b)
            weight_map[name] = fname
        h = json.dumps(header).encode()
        h += b" " * ((8 - len(h) % 8) % 8)
        with open(os.path.join(a.out, fname), "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    for name in os.listdir(a.model):
        src = os.path.join(a.model, name)
        if os.path.isfile(src) and not name.endswith(".safetensors") and not name.endswith(
                ".index.json"):
            shutil.copyfile(src, os.path.join(a.out, name))
    with open(os.path.join(a.out, "config.json")) as f:
        c = json.load(f)
    (c.get("text_config") or c)["torch_dtype"] = "bfloat16"
    c["torch_dtype"] = "bfloat16"
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(c, f, indent=1)


def add_expert_stats(stats, l, e, routed, xin, d):
    """Adds one sequence's rows of expert e of layer l: sums of x x^T of its two inputs."""
    key = (l, e)
    if key not in stats["sums"]:
        stats["sums"][key] = [np.zeros((xin.shape[1],) * 2), np.zeros((d.shape[1],) * 2), 0, 0]
    acc = stats["sums"][key]
    acc[0] += xin.T @ xin
    acc[1] += d.T @ d
    acc[2] += routed
    acc[3] += xin.shape[0]


def forward(config, w, ids, stats=None):
    arch = config["architectures"][0]
    if arch == "MixtralForCausalLM":
        return mixtral_forward(config, w, ids, stats)
    if arch == "Llama4ForCausalLM":
        return llama4_forward(config, w, ids, stats=stats)
    if arch == "Llama4ForConditionalGeneration":
        return llama4_forward(config["text_config"], w, ids, prefix="language_model.", stats=stats)
    raise ValueError(f"not a mixture-of-experts architecture: {arch}")


def expert_hessians(a):
    config, w = read_model(a.model)
    stats = {"route_all": a.route_all, "sums": {}}
    for seq in a.tokens.split("/"):
        forward(config, w, np.array([int(t) for t in seq.split(",")]), stats)
    os.makedirs(a.out, exist_ok=True)
    counts = {}
    for (l, e), (gu, down, routed, rows) in sorted(stats["sums"].items()):
        for name, m in (("gate_up", gu), ("down", down)):
            (m / max(rows, 1)).astype("<f8").tofile(os.path.join(a.out, f"l{l}.e{e}.{name}.f64"))
        counts.setdefault(str(l), {})[str(e)] = [int(routed), int(rows)]
    with open(os.path.join(a.out, "counts.json"), "w") as f:
        json.dump(counts, f)


def interleave_rows(W, heads, hd):
    """Rows of a q/k projection reordered so interleaved RoPE pairs (2i, 2i+1) rotate what the
    half-split pairs (i, i + hd/2) rotated: the same attention scores."""
    W = W.reshape(heads, 2, hd // 2, -1)  # [head, half, i, in]
    return W.transpose(0, 2, 1, 3).reshape(heads * hd, -1)


def upcycle(a):
    c, w = read_model(a.dense)
    rng = np.random.default_rng(a.seed)
    E, L = a.experts, c["num_hidden_layers"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or c["hidden_size"] // heads
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    f32 = lambda x: np.asarray(x, dtype=np.float32)  # noqa: E731
    noisy = lambda W: f32(W * (1 + a.noise * rng.standard_normal(W.shape)))  # noqa: E731
    router = lambda: f32(rng.standard_normal((E, hidden)) * a.router_scale /  # noqa: E731
                         math.sqrt(hidden))
    tensors = [(n, f32(w[n])) for n in ("model.embed_tokens.weight", "model.norm.weight")]
    if "lm_head.weight" in w:
        tensors.append(("lm_head.weight", f32(w["lm_head.weight"])))
    llama4 = a.layout.startswith("llama4")
    for l in range(L):
        p = f"model.layers.{l}."
        mlp = {k: w[p + f"mlp.{k}_proj.weight"] for k in ("gate", "up", "down")}
        tensors += [(p + n, f32(w[p + n])) for n in ("input_layernorm.weight",
                                                     "post_attention_layernorm.weight",
                                                     "self_attn.v_proj.weight",
                                                     "self_attn.o_proj.weight")]
        qk = {"q": w[p + "self_attn.q_proj.weight"], "k": w[p + "self_attn.k_proj.weight"]}
        if llama4:
            qk = {"q": interleave_rows(qk["q"], heads, hd), "k": interleave_rows(qk["k"], kv, hd)}
        tensors += [(p + f"self_attn.{n}_proj.weight", f32(W)) for n, W in qk.items()]
        if not llama4:
            m = p + "block_sparse_moe."
            tensors.append((m + "gate.weight", router()))
            for e in range(E):
                for name, key in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
                    tensors.append((f"{m}experts.{e}.{name}.weight", noisy(mlp[key])))
            continue
        f = p + "feed_forward."
        if (l + 1) % a.moe_step != 0:  # a dense layer: the MLP widened by mlp_pad inert channels
            pad = rng.standard_normal((a.mlp_pad, hidden)) * 0.1
            tensors += [(f + "gate_proj.weight", f32(np.concatenate([mlp["gate"], pad]))),
                        (f + "up_proj.weight", f32(np.concatenate([mlp["up"], pad]))),
                        (f + "down_proj.weight",
                         f32(np.concatenate([mlp["down"], np.zeros((hidden, a.mlp_pad))], 1)))]
            continue
        tensors.append((f + "router.weight", router()))
        routed = 1.0 - a.shared_scale
        gate_up = np.stack([np.concatenate([noisy(mlp["gate"]).T, noisy(mlp["up"]).T], 1)
                            for _ in range(E)])  # [E, D, 2I]
        down = np.stack([noisy(mlp["down"]).T * routed for _ in range(E)])  # [E, I, D]
        tensors += [(f + "experts.gate_up_proj", f32(gate_up)), (f + "experts.down_proj", f32(down))]
        tensors += [(f + "shared_expert.gate_proj.weight", f32(mlp["gate"])),
                    (f + "shared_expert.up_proj.weight", f32(mlp["up"])),
                    (f + "shared_expert.down_proj.weight", f32(mlp["down"] * a.shared_scale))]
    base = {k: c[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                              "num_key_value_heads", "rms_norm_eps", "rope_theta", "vocab_size",
                              "tie_word_embeddings", "max_position_embeddings", "bos_token_id",
                              "eos_token_id", "hidden_act", "rope_scaling") if k in c}
    base.update(head_dim=hd, num_local_experts=E, num_experts_per_tok=a.top_k,
                torch_dtype="float32")
    if not llama4:
        config = dict(base, architectures=["MixtralForCausalLM"], model_type="mixtral",
                      intermediate_size=inter, sliding_window=None, router_aux_loss_coef=0.02)
    else:
        no_rope = [int(a.nope_interval == 0 or (l + 1) % a.nope_interval != 0) for l in range(L)]
        text = dict(base, model_type="llama4_text", intermediate_size=inter,
                    intermediate_size_mlp=inter + a.mlp_pad, interleave_moe_layer_step=a.moe_step,
                    no_rope_layers=no_rope, use_qk_norm=a.qk_norm,
                    attn_temperature_tuning=a.temperature_tuning,
                    attention_chunk_size=a.chunk or None, floor_scale=a.floor_scale,
                    attn_scale=0.1)
        config = dict(text, architectures=["Llama4ForCausalLM"])
        if a.layout == "llama4-mm":
            vision = {"model_type": "llama4_vision_model", "hidden_size": 32, "vision_output_dim": 16}
            config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
                      "text_config": text, "vision_config": vision, "torch_dtype": "float32"}
            tensors = [("language_model." + n, t) for n, t in tensors]
            tensors += [("vision_model.patch_embedding.linear.weight",
                         f32(rng.standard_normal((32, 48)))),
                        ("multi_modal_projector.linear_1.weight",
                         f32(rng.standard_normal((hidden, 16))))]
    os.makedirs(a.out, exist_ok=True)
    write_safetensors(os.path.join(a.out, "model.safetensors"), tensors)
    # The tokenizer files (and anything else beside the weights) come along unchanged.
    for name in os.listdir(a.dense):
        src = os.path.join(a.dense, name)
        if os.path.isfile(src) and name not in ("config.json", "model.safetensors"):
            shutil.copyfile(src, os.path.join(a.out, name))
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def fuse_experts(a):
    """A Llama 4 model whose routed experts are stored per expert (feed_forward.experts.<e>.
    gate_proj / up_proj / down_proj.weight, [out, in]: the names vLLM reads from quantized
    checkpoints) rewritten in place into Hugging Face's fused float layout (experts.gate_up_proj
    [E, D, 2I] = [gate^T | up^T] per expert, experts.down_proj [E, I, D] = down^T), as one
    model.safetensors. Other models are left as they are."""
    config, w = read_model(a.model)
    fused, out = 0, {}
    for name, t in w.items():
        head, sep, tail = name.partition(".feed_forward.experts.")
        if not sep:
            out[name] = t
            continue
        e, proj = tail.split(".")[0], tail.split(".")[1]
        if not e.isdigit():
            out[name] = t
            continue
        if int(e) != 0 or proj != "gate_proj":
            continue
        n = 0
        while f"{head}.feed_forward.experts.{n}.gate_proj.weight" in w:
            n += 1
        one = lambda i, p: w[f"{head}.feed_forward.experts.{i}.{p}.weight"]  # noqa: E731
        f = head + ".feed_forward.experts."
        out[f + "gate_up_proj"] = np.stack(
            [np.concatenate([one(i, "gate_proj").T, one(i, "up_proj").T], axis=1)
             for i in range(n)]).astype(np.float32)
        out[f + "down_proj"] = np.stack([one(i, "down_proj").T for i in range(n)]).astype(
            np.float32)
        fused += 1
    if fused == 0:
        print(f"{a.model}: no per-expert Llama 4 tensors, left as it is")
        return
    for name in os.listdir(a.model):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            os.remove(os.path.join(a.model, name))
    write_safetensors(os.path.join(a.model, "model.safetensors"),
                      [(k, np.asarray(v, dtype=np.float32)) for k, v in out.items()])
    print(f"{a.model}: fused the routed experts of {fused} layers")


def logits(a):
    config, w = read_model(a.model)
    ids = np.array([int(t) for t in a.tokens.split(",")])
    forward(config, w, ids).astype("<f4").tofile(a.out)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("upcycle")
    u.add_argument("--dense", required=True)
    u.add_argument("--layout", choices=["mixtral", "llama4", "llama4-mm"], required=True)
    u.add_argument("--out", required=True)
    u.add_argument("--experts", type=int, default=4)
    u.add_argument("--top-k", type=int, default=2)
    u.add_argument("--noise", type=float, default=0.0)
    u.add_argument("--seed", type=int, default=0)
    u.add_argument("--shared-scale", type=float, default=1.0)
    # The router's rows are N(0, router_scale^2 / hidden): a larger scale gives larger logits
    # (Llama 4: sigmoid scores nearer 1 for the chosen experts; Mixtral: peakier softmax).
    u.add_argument("--router-scale", type=float, default=1.0)
    # Llama 4 only: MoE on every moe-step-th layer (the others dense, their MLP widened by mlp-pad
    # inert channels so intermediate_size_mlp differs); NoPE on every nope-interval-th layer (0:
    # none); qk-norm; temperature tuning with floor-scale; attention chunks (0: none).
    u.add_argument("--moe-step", type=int, default=1)
    u.add_argument("--mlp-pad", type=int, default=0)
    u.add_argument("--nope-interval", type=int, default=0)
    u.add_argument("--qk-norm", action="store_true")
    u.add_argument("--temperature-tuning", action="store_true")
    u.add_argument("--floor-scale", type=int, default=8192)
    u.add_argument("--chunk", type=int, default=8192)
    g = sub.add_parser("logits")
    g.add_argument("--model", required=True)
    g.add_argument("--tokens", required=True)
    g.add_argument("--out", required=True)
    b = sub.add_parser("bf16-shards")
    b.add_argument("--model", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--shards", type=int, default=2)
    x = sub.add_parser("expert-hessians")
    x.add_argument("--model", required=True)
    x.add_argument("--tokens", required=True)
    x.add_argument("--out", required=True)
    x.add_argument("--route-all", action="store_true")
    f = sub.add_parser("fuse-experts")
    f.add_argument("--model", required=True)
    a = p.parse_args()
    {"upcycle": upcycle, "logits": logits, "bf16-shards": bf16_shards,
     "expert-hessians": expert_hessians, "fuse-experts": fuse_experts}[a.cmd](a)


if __name__ == "__main__":
    main()
