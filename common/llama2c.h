// llama2.c checkpoints (Karpathy's run.c "v0" format) and their import into a Hugging Face layout.
//
// Format: seven int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a
// negative vocab_size means the classifier is stored separately rather than shared with the
// embedding), then float32 arrays in this order: token_embedding [vocab, dim], rms_att [L, dim],
// wq [L, dim, dim], wk [L, kv_dim, dim], wv [L, kv_dim, dim], wo [L, dim, dim], rms_ffn [L, dim],
// w1 [L, hidden, dim], w2 [L, dim, hidden], w3 [L, hidden, dim], rms_final [dim],
// freq_cis_real [seq, head/2], freq_cis_imag [seq, head/2], and wcls [vocab, dim] if unshared.
// Matrices are PyTorch Linear weights ([out, in], row-major).
//
// llama2.c rotates interleaved pairs (2i, 2i+1) in RoPE; Hugging Face's Llama rotates the halves
// (i, i + head/2). Import permutes the rows of wq and wk within each head so that the HF-layout
// forward computes exactly what llama2.c computes (the permutation of HF's
// convert_llama_weights_to_hf.py).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/hf_config.h"
#include "common/status.h"

namespace qcal {

struct Llama2cModel {
  int32_t dim = 0, hidden_dim = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0, vocab_size = 0,
          seq_len = 0;
  bool shared_classifier = true;
  std::vector<float> token_embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final,
      wcls;
  int32_t head_dim() const { return dim / n_heads; }
  int32_t kv_dim() const { return n_kv_heads * head_dim(); }
};

// Reads and validates a llama2.c checkpoint: header values positive and consistent, file size
// exactly what the header implies. Errors name the file and the problem.
StatusOr<Llama2cModel> ReadLlama2cModel(const std::string& path);

// The HF config equivalent to a llama2.c model (RMSNorm eps 1e-5, rope_theta 10000).
LlamaConfig Llama2cToLlamaConfig(const Llama2cModel& model);

// Permutes the rows of a [n_heads * head_dim, cols] projection from interleaved RoPE pairs to the
// half-split layout: within each head, row 2i goes to i and row 2i+1 to i + head_dim/2.
std::vector<float> PermuteInterleavedToHalfSplit(const std::vector<float>& w, int64_t n_heads,
                                                 int64_t head_dim, int64_t cols);

struct ImportResult {
  std::string out_dir;
  LlamaConfig config;
  int64_t num_parameters = 0;
  int64_t num_tensors = 0;
};

// Writes out_dir/{config.json, model.safetensors, tokenizer.model, tokenizer_config.json,
// generation_config.json}. Creates out_dir if needed; every file is written atomically.
StatusOr<ImportResult> ImportLlama2c(const std::string& model_path,
                                     const std::string& tokenizer_path,
                                     const std::string& out_dir);

}  // namespace qcal
