#!/usr/bin/python3
"""An independent reader of the compressed-tensors checkpoints `qcal export --format
compressed-tensors` writes (pack-quantized and int-quantized, with or without quantized inputs),
written from the format's description (docs/formats.md, "compressed-tensors export";
compressed-tensors' PackedQuantizationCompressor / IntQuantizationCompressor and its
quantize / dequantize), numpy only:

  ct_dequant.py dequant EXPORT_DIR OUT_DIR   a float32 checkpoint with every linear dequantized
  ct_dequant.py check EXPORT_DIR             the config and every tensor's name, dtype and shape
  ct_dequant.py ppl EXPORT_DIR TOKENS CTX    perplexity (one JSON line) of the export on the text
                                             tokens in TOKENS (int32 little-endian, as `qcal eval
                                             --save-tokens` writes them), windows of BOS + CTX-1
                                             tokens (`qcal eval --bos-per-window`), with every
                                             linear input quantized as input_activations says
                                             (float64 elsewhere)

Weights, per linear:
  pack-quantized: weight_packed [out, ceil(in / (32 // b))] int32 holds unsigned values
    u = q + 2^(b-1) of the signed codes q, 32 // b per word from the low bits, along the input
    dimension; weight_zero_point [ceil(out / (32 // b)), groups] int32 (asymmetric only) packs
    zp + 2^(b-1) along the output dimension; weight_shape = [out, in].
  int-quantized: weight [out, in] int8 holds q; weight_zero_point [out, groups] int8 holds zp
    (asymmetric only).
  Both: weight_scale [out, groups]; weight_g_idx [in] int32 (actorder "group") gives each
  column's group, else column // group_size (channel strategy: one group).
  W[r, c] = (q[r, c] - zp[r, g(c)]) * scale[r, g(c)], in the scale's dtype.
Inputs (input_activations, int, symmetric unless input_zero_point says otherwise):
  strategy "token", dynamic, int-quantized weights (vLLM's int8 W8A8 kernels): per token
    s = max|x| / (2^(b-1) - 1) (s = 1 for an all-zero token),
    x -> clamp(round(x / s), -2^(b-1), 2^(b-1) - 1) * s;
  strategy "token", dynamic, pack-quantized weights (vLLM's Humming kernels, int4 and int8
    inputs): in float32, s = max(max(max x, 1e-30) / (qmax + 0.49), -min(min x, -1e-30) /
    (qmax + 1.49)), qmax = 2^(b-1) - 1, x -> round(x * (1 / s)) * s (the float32 product, no
    clamp);
  strategy "tensor", static: s = input_scale [1] float32, zp = input_zero_point [1] int8 (or 0),
    x -> (clamp(round(x / s) + zp, -2^(b-1), 2^(b-1) - 1) - zp) * s.
  round is to nearest, ties to even (torch.round); scales are float32 and the dequantized value
  is the float32 product, as the format's fake quantization computes it.
KV cache (quantization_config.kv_cache_scheme: 8-bit float, strategy "tensor", static): each
  attention A has A.k_scale and A.v_scale (F32 [1]); the cache holds e4m3(x / scale) of the keys
  after RoPE and of the values (the float32 quotient; E4M3 "fn": round to nearest, ties to the
  even code, saturated at +-448) and attention reads float(e4m3) * scale (float32), vLLM's
  paged-attention cache write and read.
Transforms (quantization_config.transform_config, type "hadamard"): a module a group targets
  with location "input" gets x -> x V before its input quantizer, V block-diagonal with blocks
  H_b / sqrt(b) (Sylvester, H_2b = [[H_b, H_b], [H_b, -H_b]]), b = head_dim (the whole input
  without it); the "weight_input" inverse is already in the stored weight.
"""
import json
import math
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gptq_dequant import read_checkpoint, to_float32, write_float_model  # noqa: E402  (I/O only)
from llama_reference import forward  # noqa: E402  (the Hugging Face Llama forward, float64)

FORMATS = ("pack-quantized", "int-quantized")
WEIGHT_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_g_idx",
                   ".weight_shape")
INPUT_SUFFIXES = (".input_scale", ".input_zero_point")


def unpack_rows(words, count, bits):
    """words [rows, nwords] int32 -> unsigned values [rows, count]: 32 // bits per word."""
    per_word = 32 // bits
    w = words.astype(np.int64) & 0xFFFFFFFF
    j = np.arange(count)
    return (w[:, j // per_word] >> ((j % per_word) * bits)) & ((1 << bits) - 1)


def sylvester(b):
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    assert h.shape[0] == b, b
    return h / math.sqrt(b)


def input_transforms(qc, linears):
    """{linear: function x -> x V} for the online input Hadamards of transform_config."""
    out = {}
    groups = (qc.get("transform_config") or {}).get("config_groups", {})
    for name, g in groups.items():
        assert g["type"] == "hadamard" and not g.get("randomize"), (name, g)
        locations = {a["location"] for a in g["apply"]}
        assert locations <= {"input", "weight_input"}, (name, g)
        for a in g["apply"]:
            if a["location"] != "input":
                continue
            assert not a.get("inverse"), a
            for p in linears:
                if any(re.match(t[3:], p) if t.startswith("re:") else t == p
                       for t in a["targets"]):
                    out[p] = g.get("head_dim")
    def transform(b):
        def apply(x):
            n = x.shape[-1]
            size = b or n
            v = sylvester(size)
            return (x.reshape(x.shape[:-1] + (n // size, size)) @ v).reshape(x.shape)
        return apply
    return {p: transform(b) for p, b in out.items()}


KV_SUFFIXES = (".k_scale", ".v_scale")


def e4m3_table():
    """The finite E4M3 values ascending, and whether each one's code is even (+0 once)."""
    vals = {}
    for bits in range(256):
        sign, e, m = bits >> 7, (bits >> 3) & 15, bits & 7
        if e == 15 and m == 7:
            continue  # NaN
        mag = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        v = -mag if sign else mag
        if v == 0 and sign:
            continue
        vals[v] = bits & 1 == 0
    v = np.array(sorted(vals))
    return v, np.array([vals[x] for x in v])


def fp8_e4m3(y):
    """y (float32) -> the nearest E4M3 value (ties to the even code), saturated at +-448."""
    values, even = e4m3_table()
    y = np.clip(y.astype(np.float64), -448, 448)
    hi = np.clip(np.searchsorted(values, y), 1, len(values) - 1)
    lo = hi - 1
    dlo, dhi = y - values[lo], values[hi] - y
    pick_hi = (dhi < dlo) | ((dhi == dlo) & even[hi])
    return np.where(pick_hi, values[hi], values[lo]).astype(np.float32)


def kv_scheme(qc):
    k = qc.get("kv_cache_scheme")
    if k is not None:
        assert (k["num_bits"], k["type"], k["strategy"], bool(k["dynamic"])) == (
            8, "float", "tensor", False), k
    return k


def scheme(qc):
    """(format, weights args, input_activations args or None) of the one config group."""
    assert qc["quant_method"] == "compressed-tensors", qc
    assert qc["format"] in FORMATS and qc["quantization_status"] == "compressed", qc
    groups = qc["config_groups"]
    assert len(groups) == 1, groups
    group = next(iter(groups.values()))
    assert group["targets"] == ["Linear"] and group.get("output_activations") is None, group
    assert group.get("format", qc["format"]) == qc["format"], group
    w = group["weights"]
    assert w["type"] == "int" and not w.get("dynamic"), w
    assert w["strategy"] in ("channel", "group"), w
    a = group.get("input_activations")
    if a is not None:
        assert a["type"] == "int", a
        assert (a["strategy"], bool(a["dynamic"])) in (("token", True), ("tensor", False)), a
        assert a["symmetric"] or not a["dynamic"], a
    return qc["format"], w, a


def linear_shape(t, prefix, fmt):
    if fmt == "pack-quantized":
        return tuple(int(v) for v in t[prefix + ".weight_shape"][1])
    return tuple(t[prefix + ".weight"][1].shape)


def dequant_linear(t, prefix, fmt, w):
    bits = w["num_bits"]
    offset = 1 << (bits - 1)
    out_f, in_f = linear_shape(t, prefix, fmt)
    sdtype, scales = t[prefix + ".weight_scale"]
    scale = to_float32(sdtype, scales)                                        # [out, groups]
    if fmt == "pack-quantized":
        q = unpack_rows(t[prefix + ".weight_packed"][1], in_f, bits) - offset  # [out, in]
    else:
        q = t[prefix + ".weight"][1].astype(np.int64)
    if w["symmetric"]:
        zp = np.zeros(scale.shape, dtype=np.int64)
    elif fmt == "pack-quantized":
        zp = unpack_rows(t[prefix + ".weight_zero_point"][1].T, out_f, bits).T - offset
    else:
        zp = t[prefix + ".weight_zero_point"][1].astype(np.int64)
    if prefix + ".weight_g_idx" in t:
        g = t[prefix + ".weight_g_idx"][1].astype(np.int64)
    elif w["strategy"] == "group":
        g = np.arange(in_f) // w["group_size"]
    else:
        g = np.zeros(in_f, dtype=np.int64)
    rows = np.arange(out_f)[:, None]
    diff = (q - zp[rows, g[None, :]]).astype(np.float32)                      # exact integers
    return diff * scale[rows, g[None, :]]                                     # one rounding


def linears_of(t, fmt):
    if fmt == "pack-quantized":
        return sorted(name[:-len(".weight_shape")] for name in t if name.endswith(".weight_shape"))
    return sorted(name[:-len(".weight_scale")] for name in t if name.endswith(".weight_scale"))


def load(src):
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    fmt, w, a = scheme(config["quantization_config"])
    t = read_checkpoint(src)
    return config, fmt, w, a, t, linears_of(t, fmt)


def dense_weights(t, fmt, w, linears):
    """Every tensor in float32, each quantized linear's dequantized as `.weight`."""
    own = set()
    for p in linears:
        own.update(p + s for s in WEIGHT_SUFFIXES + INPUT_SUFFIXES + (".weight",))
    out = {name: to_float32(dtype, arr) for name, (dtype, arr) in t.items()
           if name not in own and not name.endswith(KV_SUFFIXES)}
    for prefix in linears:
        out[prefix + ".weight"] = dequant_linear(t, prefix, fmt, w)
    return out


def dequant(src, dst):
    config, fmt, w, a, t, linears = load(src)
    write_float_model(src, dst, config, dense_weights(t, fmt, w, linears))
    print(f"dequantized {len(linears)} linears ({fmt}, {w['num_bits']} bits, {w['strategy']}, "
          f"{'symmetric' if w['symmetric'] else 'asymmetric'}, actorder {w.get('actorder')}) "
          f"of {src} into {dst}" + (" (its input quantization is not in the float model)"
                                    if a else ""))


def check(src):
    config, fmt, w, a, t, linears = load(src)
    bits, per_word = w["num_bits"], 32 // w["num_bits"]
    problems = []
    for prefix in linears:
        out_f, in_f = linear_shape(t, prefix, fmt)
        groups = 1 if w["strategy"] == "channel" else -(-in_f // w["group_size"])
        want = {".weight_scale": (None, (out_f, groups))}
        if fmt == "pack-quantized":
            want[".weight_packed"] = ("I32", (out_f, -(-in_f // per_word)))
            if not w["symmetric"]:
                want[".weight_zero_point"] = ("I32", (-(-out_f // per_word), groups))
        else:
            want[".weight"] = ("I8", (out_f, in_f))
            if not w["symmetric"]:
                want[".weight_zero_point"] = ("I8", (out_f, groups))
        if w.get("actorder") == "group":
            want[".weight_g_idx"] = ("I32", (in_f,))
        if a is not None and not a["dynamic"]:
            want[".input_scale"] = ("F32", (1,))
            if not a["symmetric"]:
                want[".input_zero_point"] = ("I8", (1,))
        for suffix, (dtype, shape) in want.items():
            if prefix + suffix not in t:
                problems.append(f"{prefix}{suffix} missing")
                continue
            got_dtype, arr = t[prefix + suffix]
            if (dtype and got_dtype != dtype) or tuple(arr.shape) != shape:
                problems.append(f"{prefix}{suffix}: {got_dtype} {arr.shape}, want {dtype} {shape}")
    if kv_scheme(config["quantization_config"]) is not None:
        attns = sorted(p[:-len(".k_proj")] for p in linears if p.endswith(".k_proj"))
        if len(attns) != config["num_hidden_layers"]:
            problems.append(f"{len(attns)} quantized k_proj for {config['num_hidden_layers']} layers")
        for attn in attns:
            for suffix in KV_SUFFIXES:
                got = t.get(attn + suffix)
                if got is None:
                    problems.append(f"{attn}{suffix} missing")
                elif got[0] != "F32" or tuple(got[1].shape) != (1,) or not got[1][0] > 0:
                    problems.append(f"{attn}{suffix}: {got[0]} {got[1].shape}, want a positive F32 [1]")
    # The head by its module name: "lm_head", or "language_model.lm_head" in a multimodal model.
    if not any(i == "lm_head" or i.endswith(".lm_head")
               for i in config["quantization_config"].get("ignore", [])):
        problems.append("lm_head is not in ignore")
    if not linears:
        problems.append("no quantized linear")
    for p in problems:
        print("FAIL", p)
    inputs = "float inputs" if a is None else (
        f"int{a['num_bits']} inputs, {a['strategy']}, {'dynamic' if a['dynamic'] else 'static'}")
    print(f"{'FAIL' if problems else 'ok'}: {len(linears)} linears, {fmt}, {bits} bits, "
          f"{w['strategy']}, group_size {w.get('group_size')}, actorder {w.get('actorder')}, "
          f"{inputs}")
    return 1 if problems else 0


def input_quantizer(t, prefix, a, fmt):
    """x (float64 rows) -> x as the format's input quantization leaves it."""
    bits = a["num_bits"]
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if a["dynamic"] and fmt == "pack-quantized":  # Humming: per token, symmetric, float32
        pos, neg = np.float32(hi + 0.49), np.float32(hi + 1.49)

        def quant(x):
            x32 = x.astype(np.float32)
            mx = np.maximum(x32.max(-1, keepdims=True), np.float32(1e-30))
            mn = np.minimum(x32.min(-1, keepdims=True), np.float32(-1e-30))
            s = np.maximum(mx / pos, -mn / neg).astype(np.float32)
            inv = (np.float32(1) / s).astype(np.float32)
            q = np.rint((x32 * inv).astype(np.float32))
            return (q * s).astype(np.float32).astype(np.float64)
        return quant
    if a["dynamic"]:  # per token, symmetric
        def quant(x):
            m = np.abs(x).max(-1, keepdims=True)
            s = (m / hi).astype(np.float32)
            s[m == 0] = 1
            q = np.clip(np.rint(x / s.astype(np.float64)), lo, hi)
            return (q.astype(np.float32) * s).astype(np.float64)
        return quant
    s = np.float32(t[prefix + ".input_scale"][1].reshape(()))
    zp = 0
    if prefix + ".input_zero_point" in t:
        zp = int(t[prefix + ".input_zero_point"][1].reshape(()))

    def quant(x):
        q = np.clip(np.rint(x / np.float64(s)) + zp, lo, hi) - zp
        return (q.astype(np.float32) * s).astype(np.float64)
    return quant


def ppl(src, tokens_path, ctx):
    config, fmt, w, a, t, linears = load(src)
    weights = {k: v.astype(np.float64) for k, v in dense_weights(t, fmt, w, linears).items()}
    quantizers = {p: input_quantizer(t, p, a, fmt) for p in linears} if a is not None else {}
    transforms = input_transforms(config["quantization_config"], linears)
    kv = None
    if kv_scheme(config["quantization_config"]) is not None:
        def kv(attn, role, x):
            s = np.float32(t[f"{attn}.{role}_scale"][1].reshape(()))
            q = fp8_e4m3((x.astype(np.float32) / s).astype(np.float32))
            return (q * s).astype(np.float32).astype(np.float64)

    def linear(name, x, W):
        if name in transforms:  # the online transform, then the input quantizer
            x = transforms[name](x)
        if name in quantizers:
            x = quantizers[name](x)
        return x @ W.T

    tokens = np.fromfile(tokens_path, dtype="<i4").astype(np.int64)
    bos = config.get("bos_token_id", 1)
    nll, scored = 0.0, 0
    for s in range(0, len(tokens), ctx - 1):
        targets = tokens[s:s + ctx - 1]
        inputs = np.concatenate([[bos], targets[:-1]])
        logits = forward(config, weights, inputs, linear, kv)
        logits = logits - logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nll -= logp[np.arange(len(targets)), targets].sum()
        scored += len(targets)
    print(json.dumps({"perplexity": math.exp(nll / scored), "tokens_scored": scored,
                      "quantized_inputs": len(quantizers),
                      "transformed_inputs": len(transforms),
                      "fp8_kv_cache": kv is not None}))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "dequant":
        dequant(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "check":
        sys.exit(check(sys.argv[2]))
    elif len(sys.argv) == 5 and sys.argv[1] == "ppl":
        ppl(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(__doc__)
