#!/usr/bin/python3
"""An independent reader of compressed-tensors' pack-quantized checkpoints (what
`qcal export --format compressed-tensors` writes), written from the format's description
(docs/formats.md, "compressed-tensors export"; compressed-tensors' PackedQuantizationCompressor:
pack_to_int32 / unpack_from_int32 and dequantize), numpy only:

  ct_dequant.py dequant EXPORT_DIR OUT_DIR   a float32 checkpoint with every linear dequantized
  ct_dequant.py check EXPORT_DIR             the config and every tensor's name, dtype and shape

Per linear: weight_packed [out, ceil(in / (32 // b))] int32 holds unsigned values u = q + 2^(b-1)
of the signed codes q, 32 // b per word from the low bits, along the input dimension;
weight_scale [out, groups]; weight_zero_point [ceil(out / (32 // b)), groups] int32 (asymmetric
only) packs zp + 2^(b-1) along the output dimension; weight_g_idx [in] int32 (actorder "group")
gives each column's group, else column // group_size (channel strategy: one group);
weight_shape = [out, in]. W[r, c] = (q[r, c] - zp[r, g(c)]) * scale[r, g(c)], in the scale's dtype.
"""
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gptq_dequant import read_checkpoint, to_float32, write_safetensors  # noqa: E402  (I/O only)

SUFFIXES = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_g_idx",
            ".weight_shape")


def unpack_rows(words, count, bits):
    """words [rows, nwords] int32 -> unsigned values [rows, count]: 32 // bits per word."""
    per_word = 32 // bits
    w = words.astype(np.int64) & 0xFFFFFFFF
    j = np.arange(count)
    return (w[:, j // per_word] >> ((j % per_word) * bits)) & ((1 << bits) - 1)


def weights_args(qc):
    assert qc["quant_method"] == "compressed-tensors", qc
    assert qc["format"] == "pack-quantized" and qc["quantization_status"] == "compressed", qc
    groups = qc["config_groups"]
    assert len(groups) == 1, groups
    group = next(iter(groups.values()))
    assert group["targets"] == ["Linear"] and group.get("input_activations") is None, group
    w = group["weights"]
    assert w["type"] == "int" and not w.get("dynamic"), w
    assert w["strategy"] in ("channel", "group"), w
    return w


def dequant_linear(t, prefix, w):
    bits = w["num_bits"]
    offset = 1 << (bits - 1)
    out_f, in_f = (int(v) for v in t[prefix + ".weight_shape"][1])
    q = unpack_rows(t[prefix + ".weight_packed"][1], in_f, bits) - offset      # [out, in]
    sdtype, scales = t[prefix + ".weight_scale"]
    scale = to_float32(sdtype, scales)                                        # [out, groups]
    if w["symmetric"]:
        zp = np.zeros(scale.shape, dtype=np.int64)
    else:
        zp = unpack_rows(t[prefix + ".weight_zero_point"][1].T, out_f, bits).T - offset
    if prefix + ".weight_g_idx" in t:
        g = t[prefix + ".weight_g_idx"][1].astype(np.int64)
    elif w["strategy"] == "group":
        g = np.arange(in_f) // w["group_size"]
    else:
        g = np.zeros(in_f, dtype=np.int64)
    rows = np.arange(out_f)[:, None]
    diff = (q - zp[rows, g[None, :]]).astype(np.float32)                      # exact integers
    return diff * scale[rows, g[None, :]]                                     # one rounding


def linears_of(t):
    return sorted({name[:-len(s)] for name in t for s in SUFFIXES if name.endswith(s)})


def dequant(src, dst):
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    w = weights_args(config["quantization_config"])
    t = read_checkpoint(src)
    linears = linears_of(t)
    out = {}
    for name, (dtype, arr) in t.items():
        if any(name.startswith(p + ".weight_") for p in linears):
            continue
        out[name] = to_float32(dtype, arr)
    for prefix in linears:
        out[prefix + ".weight"] = dequant_linear(t, prefix, w)
    os.makedirs(dst, exist_ok=True)
    write_safetensors(os.path.join(dst, "model.safetensors"), out)
    del config["quantization_config"]
    config["torch_dtype"] = "float32"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    print(f"dequantized {len(linears)} linears ({w['num_bits']} bits, {w['strategy']}, "
          f"{'symmetric' if w['symmetric'] else 'asymmetric'}, actorder {w.get('actorder')}) "
          f"of {src} into {dst}")


def check(src):
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    w = weights_args(config["quantization_config"])
    t = read_checkpoint(src)
    bits, per_word = w["num_bits"], 32 // w["num_bits"]
    problems = []
    linears = linears_of(t)
    for prefix in linears:
        out_f, in_f = (int(v) for v in t[prefix + ".weight_shape"][1])
        groups = 1 if w["strategy"] == "channel" else -(-in_f // w["group_size"])
        want = {".weight_packed": ("I32", (out_f, -(-in_f // per_word))),
                ".weight_scale": (None, (out_f, groups))}
        if not w["symmetric"]:
            want[".weight_zero_point"] = ("I32", (-(-out_f // per_word), groups))
        if w.get("actorder") == "group":
            want[".weight_g_idx"] = ("I32", (in_f,))
        for suffix, (dtype, shape) in want.items():
            if prefix + suffix not in t:
                problems.append(f"{prefix}{suffix} missing")
                continue
            got_dtype, arr = t[prefix + suffix]
            if (dtype and got_dtype != dtype) or tuple(arr.shape) != shape:
                problems.append(f"{prefix}{suffix}: {got_dtype} {arr.shape}, want {dtype} {shape}")
    if "lm_head" not in config["quantization_config"].get("ignore", []):
        problems.append("lm_head is not in ignore")
    if not linears:
        problems.append("no quantized linear (no .weight_packed / .weight_shape tensors)")
    for p in problems:
        print("FAIL", p)
    print(f"{'FAIL' if problems else 'ok'}: {len(linears)} linears, {bits} bits, "
          f"{w['strategy']}, group_size {w.get('group_size')}, actorder {w.get('actorder')}")
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "dequant":
        dequant(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "check":
        sys.exit(check(sys.argv[2]))
    else:
        sys.exit(__doc__)
