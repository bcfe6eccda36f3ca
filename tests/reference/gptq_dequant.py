#!/usr/bin/python3
"""An independent reader of GPTQ (checkpoint_format "gptq", v1) checkpoints, written from
docs/formats.md "GPTQ export" with numpy only (it does not call qcal).

  gptq_dequant.py dequant GPTQ_DIR OUT_DIR
      Unpacks every linear (qweight, qzeros, scales, g_idx) into W[c, j] = float32(scales[g, c]) *
      (u[j, c] - (z[g, c] + 1)), g = g_idx[j], and writes OUT_DIR: a float32 Hugging Face model
      (model.safetensors with every tensor in float32, config.json without quantization_config,
      the tokenizer files copied).
  gptq_dequant.py compare A_DIR B_DIR
      Every tensor of A equals B's of the same name bit for bit after conversion to float32; prints
      a line per differing tensor and exits 1 if any differs or a name is missing.
"""
import json
import os
import shutil
import struct
import sys

import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
          "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        arr = np.frombuffer(data[base + begin:base + end], dtype=DTYPES[info["dtype"]])
        out[name] = (info["dtype"], arr.reshape(info["shape"]))
    return out


def read_checkpoint(directory):
    index = os.path.join(directory, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for name in files:
        tensors.update(read_safetensors(os.path.join(directory, name)))
    return tensors


def to_float32(dtype, arr):
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def write_safetensors(path, tensors):
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name, arr in tensors.items():
        blob = np.ascontiguousarray(arr, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def unpack(words, count, bits):
    """words [nwords, k] int32 (each column one packed run) -> values [count, k] (the bit stream
    of docs/formats.md: value j at stream bits [bits*j, bits*(j+1)), word w = bits [32w, 32w+32))."""
    w = words.astype(np.int64) & 0xFFFFFFFF
    w = np.concatenate([w, np.zeros((1, w.shape[1]), dtype=np.int64)], axis=0)
    j = np.arange(count)
    bit = j * bits
    word, shift = bit // 32, bit % 32
    low = w[word] >> shift[:, None]
    high = (w[word + 1] << (32 - shift)[:, None]) & 0xFFFFFFFF
    return (low | np.where(shift[:, None] + bits > 32, high, 0)) & ((1 << bits) - 1)


def dequant_linear(t, prefix, bits, n_in, n_out):
    qweight = t[prefix + ".qweight"][1]
    qzeros = t[prefix + ".qzeros"][1]
    scales = t[prefix + ".scales"][1].astype(np.float32)  # fp16 -> exact float32
    g_idx = t[prefix + ".g_idx"][1].astype(np.int64)
    u = unpack(qweight, n_in, bits)                       # [in, out]
    z = unpack(qzeros.T, n_out, bits).T                   # [groups, out]
    q = (u - (z[g_idx] + 1)).astype(np.float32)           # exact small integers
    w = scales[g_idx] * q                                 # float32 product, one rounding
    return w.T.copy()                                     # [out, in]


def dequant(src, dst):
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    qc = config["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc.get("checkpoint_format", "gptq") == "gptq", qc
    bits = qc["bits"]
    t = read_checkpoint(src)
    out = {}
    linears = set()
    for name in t:
        for suffix in (".qweight", ".qzeros", ".scales", ".g_idx"):
            if name.endswith(suffix):
                linears.add(name[:-len(suffix)])
    for name, (dtype, arr) in t.items():
        if any(name.startswith(p + ".") for p in linears):
            continue
        out[name] = to_float32(dtype, arr)
    for prefix in sorted(linears):
        n_in = t[prefix + ".g_idx"][1].shape[0]
        n_out = t[prefix + ".scales"][1].shape[1]
        out[prefix + ".weight"] = dequant_linear(t, prefix, bits, n_in, n_out)
    write_float_model(src, dst, config, out)
    print(f"dequantized {len(linears)} linears ({bits} bits) of {src} into {dst}")


def write_float_model(src, dst, config, tensors):
    """dst: a float32 model of `tensors` with src's config (less its quantization_config) and
    tokenizer files."""
    os.makedirs(dst, exist_ok=True)
    write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
    config = dict(config)
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def compare(a_dir, b_dir):
    a, b = read_checkpoint(a_dir), read_checkpoint(b_dir)
    bad = 0
    for name, (dtype, arr) in sorted(a.items()):
        if name not in b:
            print(f"{name}: missing in {b_dir}")
            bad += 1
            continue
        x, y = to_float32(dtype, arr), to_float32(*b[name])
        if x.shape != y.shape or not np.array_equal(x.view(np.uint32), y.view(np.uint32)):
            diff = np.abs(x - y).max() if x.shape == y.shape else "shape"
            print(f"{name}: differs (max |diff| {diff})")
            bad += 1
    print(f"compared {len(a)} tensors: {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "dequant":
        dequant(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        print(__doc__)
        sys.exit(2)
