#!/usr/bin/python3
"""An independent numpy reference of the Hugging Face Llama forward pass (float64), with the RoPE
scaling types of transformers' modeling_rope_utils (default, linear, llama3), for
tests/engine/rope_scaling_test.cc. Written from the Hugging Face formulas; it shares no code with
qcal.

  llama_reference.py make --out DIR --seed N [--rope-scaling JSON] [--hidden 128 ...]
      writes DIR/config.json and DIR/model.safetensors (F32, random N(0, s^2) weights, untied head)
  llama_reference.py logits --model DIR --tokens 1,2,3 --out FILE
      writes the logits [len(tokens), vocab] as little-endian float32 to FILE
"""
import argparse, json, math, os, struct
import numpy as np


def write_safetensors(path, tensors):
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, a in tensors:
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _, a in tensors:
            f.write(np.ascontiguousarray(a, dtype="<f4").tobytes())


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = data[8 + n + b:8 + n + e]
        if info["dtype"] == "F32":
            a = np.frombuffer(raw, dtype="<f4")
        elif info["dtype"] == "BF16":  # the upper half of a float32
            a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view("<f4")
        else:
            raise ValueError(f"{path}: tensor {name} is {info['dtype']} (F32 and BF16 are read)")
        out[name] = a.reshape(info["shape"]).astype(np.float64)
    return out


def make(a):
    rng = np.random.default_rng(a.seed)
    hidden, inter, heads, kv, layers, vocab = a.hidden, a.intermediate, a.heads, a.kv_heads, a.layers, a.vocab
    hd = hidden // heads
    g = lambda *s: rng.standard_normal(s).astype(np.float32) * np.float32(a.std)
    norm = lambda: (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    tensors = [("model.embed_tokens.weight", g(vocab, hidden)), ("model.norm.weight", norm()),
               ("lm_head.weight", g(vocab, hidden))]
    for l in range(layers):
        p = f"model.layers.{l}."
        tensors += [(p + "input_layernorm.weight", norm()), (p + "post_attention_layernorm.weight", norm()),
                    (p + "self_attn.q_proj.weight", g(heads * hd, hidden)),
                    (p + "self_attn.k_proj.weight", g(kv * hd, hidden)),
                    (p + "self_attn.v_proj.weight", g(kv * hd, hidden)),
                    (p + "self_attn.o_proj.weight", g(hidden, heads * hd)),
                    (p + "mlp.gate_proj.weight", g(inter, hidden)),
                    (p + "mlp.up_proj.weight", g(inter, hidden)),
                    (p + "mlp.down_proj.weight", g(hidden, inter))]
    os.makedirs(a.out, exist_ok=True)
    write_safetensors(os.path.join(a.out, "model.safetensors"), tensors)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "rms_norm_eps": 1e-5, "rope_theta": a.rope_theta,
        "vocab_size": vocab, "tie_word_embeddings": False,
        "max_position_embeddings": a.max_position_embeddings, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": [2, 3], "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "rope_scaling": json.loads(a.rope_scaling),
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def inv_freq(config):
    """transformers' _compute_default_rope_parameters / _linear / _llama3, in float64."""
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    base = config["rope_theta"]
    inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = config.get("rope_scaling")
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / rs["factor"]
    assert kind == "llama3", kind
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    inv_llama = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, inv_llama)


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)


def forward(config, w, ids, linear=None, kv=None):
    """Logits [len(ids), vocab] (float64) of the Llama `config` with float64 weights `w` (HF
    names) for the token ids. linear(name, x, W), name the module ("model.layers.0.mlp.up_proj"),
    computes a linear layer (default x @ W.T): readers of formats that quantize linear inputs
    pass their quantizer through it. kv(attn, role, t), attn the attention module
    ("model.layers.0.self_attn"), role "k" or "v", returns the cached keys (after RoPE) or values
    [s, kv_heads, head_dim] as the cache holds them (default: unchanged)."""
    if linear is None:
        linear = lambda name, x, W: x @ W.T  # noqa: E731
    kv_hook = kv if kv is not None else (lambda attn, role, t: t)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // heads
    eps = config["rms_norm_eps"]
    s = len(ids)
    freqs = np.outer(np.arange(s, dtype=np.float64), inv_freq(config))
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]  # [s, 1, hd]
    mask = np.triu(np.full((s, s), -np.inf), 1)
    x = w["model.embed_tokens.weight"][ids]
    lin = lambda p, x: linear(p, x, w[p + ".weight"])  # noqa: E731
    for l in range(config["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = lin(p + "self_attn.q_proj", h).reshape(s, heads, hd)
        k = lin(p + "self_attn.k_proj", h).reshape(s, kv_heads, hd)
        v = lin(p + "self_attn.v_proj", h).reshape(s, kv_heads, hd)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = kv_hook(p + "self_attn", "k", k)
        v = kv_hook(p + "self_attn", "v", v)
        k = np.repeat(k, heads // kv_heads, axis=1)
        v = np.repeat(v, heads // kv_heads, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + mask
        scores -= scores.max(-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(s, heads * hd)
        x = x + lin(p + "self_attn.o_proj", attn)
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = lin(p + "mlp.gate_proj", h)
        up = lin(p + "mlp.up_proj", h)
        x = x + lin(p + "mlp.down_proj", gate / (1 + np.exp(-gate)) * up)
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
    return rms_norm(x, w["model.norm.weight"], eps) @ head.T


def logits(a):
    with open(os.path.join(a.model, "config.json")) as f:
        config = json.load(f)
    w = read_safetensors(os.path.join(a.model, "model.safetensors"))
    ids = np.array([int(t) for t in a.tokens.split(",")])
    forward(config, w, ids).astype("<f4").tofile(a.out)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--rope-scaling", default="null")
    m.add_argument("--hidden", type=int, default=128)
    m.add_argument("--intermediate", type=int, default=256)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--vocab", type=int, default=300)
    m.add_argument("--rope-theta", type=float, default=10000.0)
    m.add_argument("--max-position-embeddings", type=int, default=256)
    m.add_argument("--std", type=float, default=0.08)
    g = sub.add_parser("logits")
    g.add_argument("--model", required=True)
    g.add_argument("--tokens", required=True)
    g.add_argument("--out", required=True)
    a = p.parse_args()
    make(a) if a.cmd == "make" else logits(a)


if __name__ == "__main__":
    main()
