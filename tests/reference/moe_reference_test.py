#!/usr/bin/python3
"""Checks of the mixture-of-experts reference (tests/reference/moe_reference.py) against the dense
Llama reference (llama_reference.py), before any qcal code is compared with it (issue 53):
  * a Mixtral made of exact copies of each block's MLP computes the dense model's logits (the
    top-k weights renormalize to 1), with top-2 of 4 experts and top-1;
  * a Llama 4 text model made from it (q/k rows reordered for interleaved RoPE pairs, the MLP as
    the shared expert, routed experts' down_proj zero) computes them too, as Llama4ForCausalLM
    and inside a Llama4ForConditionalGeneration checkpoint (language_model. prefix, vision
    tensors beside it);
  * and each check can fail: perturbed experts, a shared/routed split, q/k rows left half-split,
    a NoPE layer with temperature tuning, qk-norm and a short attention chunk each change the
    logits.
Usage: moe_reference_test.py (no arguments; writes only to a temporary directory)."""
import argparse, copy, os, sys, tempfile
import numpy as np

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
import llama_reference as dense_ref  # noqa: E402
import moe_reference as moe_ref  # noqa: E402

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def upcycle(dense, out, layout, **kw):
    a = argparse.Namespace(dense=dense, layout=layout, out=out, experts=4, top_k=2, noise=0.0,
                           seed=3, shared_scale=1.0, router_scale=1.0, moe_step=1, mlp_pad=0, nope_interval=0,
                           qk_norm=False, temperature_tuning=False, floor_scale=8192, chunk=8192)
    for k, v in kw.items():
        setattr(a, k, v)
    moe_ref.upcycle(a)
    return moe_ref.read_model(out)


def main():
    tmp = tempfile.mkdtemp(prefix="qcal-moe-ref.")
    dense = os.path.join(tmp, "dense")
    dense_ref.make(argparse.Namespace(out=dense, seed=7, rope_scaling="null", hidden=64,
                                      intermediate=96, heads=4, kv_heads=2, layers=3, vocab=100,
                                      rope_theta=10000.0, max_position_embeddings=64, std=0.1))
    config, w = moe_ref.read_model(dense)
    ids = np.array([1, 17, 42, 5, 99, 3, 3, 64, 20, 8, 77, 31])
    want = dense_ref.forward(config, w, ids)

    for top_k in (2, 1):
        c, m = upcycle(dense, os.path.join(tmp, f"mixtral{top_k}"), "mixtral", top_k=top_k)
        r = rel(moe_ref.forward(c, m, ids), want)
        check(r < 1e-12, f"Mixtral of exact copies, top-{top_k} of 4: dense logits (rel {r:.1e})")
    for layout in ("llama4", "llama4-mm"):
        c, m = upcycle(dense, os.path.join(tmp, layout), layout)
        r = rel(moe_ref.forward(c, m, ids), want)
        check(r < 1e-12, f"{c['architectures'][0]} (interleaved RoPE, shared expert): dense "
                         f"logits (rel {r:.1e})")
    check(any(n.startswith("vision_model.") for n in m) and
          all(n.startswith(("language_model.", "vision_model.", "multi_modal_projector."))
              for n in m), "the multimodal layout: text under language_model., vision beside it")

    c, m = upcycle(dense, os.path.join(tmp, "interleaved"), "llama4", moe_step=2, mlp_pad=8)
    r = rel(moe_ref.forward(c, m, ids), want)
    check(r < 1e-12 and c["intermediate_size_mlp"] == c["intermediate_size"] + 8 and
          f"model.layers.0.feed_forward.gate_proj.weight" in m and
          "model.layers.1.feed_forward.router.weight" in m,
          f"Llama 4 with MoE on every 2nd layer, dense layers of intermediate_size_mlp: dense "
          f"logits (rel {r:.1e})")
    bare = {k: v for k, v in c.items() if k not in ("no_rope_layers", "use_qk_norm",
                                                    "attn_temperature_tuning",
                                                    "attention_chunk_size")}
    r = rel(moe_ref.forward(bare, m, ids), want)
    check(r > 1e-4, f"absent Llama 4 keys take Hugging Face's defaults (NoPE every 4th layer, "
                    f"qk-norm, temperature tuning): the logits change (rel {r:.1e})")

    # Each check can fail.
    c, m = upcycle(dense, os.path.join(tmp, "noisy"), "mixtral", noise=0.05)
    r = rel(moe_ref.forward(c, m, ids), want)
    check(1e-4 < r < 0.5, f"perturbed Mixtral experts move the logits a little (rel {r:.1e})")
    c, m = upcycle(dense, os.path.join(tmp, "split"), "llama4", shared_scale=0.5)
    r = rel(moe_ref.forward(c, m, ids), want)
    check(r > 1e-4, f"Llama 4 with half the MLP routed (sigmoid-scaled inputs) differs (rel {r:.1e})")
    c, m = upcycle(dense, os.path.join(tmp, "l4"), "llama4")
    unpermuted = dict(m)
    for l in range(c["num_hidden_layers"]):
        for n in ("q", "k"):
            unpermuted[f"model.layers.{l}.self_attn.{n}_proj.weight"] = w[
                f"model.layers.{l}.self_attn.{n}_proj.weight"]
    r = rel(moe_ref.forward(c, unpermuted, ids), want)
    check(r > 1e-4, f"half-split q/k rows under interleaved RoPE differ (rel {r:.1e})")
    for name, change in (("a NoPE layer with temperature tuning",
                          dict(no_rope_layers=[1, 0, 1], attn_temperature_tuning=True,
                               floor_scale=2, attn_scale=0.5)),
                         ("qk-norm on RoPE layers", dict(use_qk_norm=True)),
                         ("attention chunks of 4 tokens", dict(attention_chunk_size=4))):
        c2 = copy.deepcopy(c)
        c2.update(change)
        r = rel(moe_ref.forward(c2, m, ids), want)
        check(r > 1e-4, f"{name} changes the logits (rel {r:.1e})")
    if failures:
        sys.exit(f"{len(failures)} check(s) failed")


if __name__ == "__main__":
    main()
