#include "common/llama2c.h"

#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/safetensors.h"
#include "common/tokenizer.h"

namespace qcal {
namespace {

Status Invalid(const std::string& path, const std::string& problem) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", problem));
}

}  // namespace

StatusOr<Llama2cModel> ReadLlama2cModel(const std::string& path) {
  QCAL_ASSIGN_OR_RETURN(std::string bytes, ReadFile(path));
  Llama2cModel m;
  constexpr size_t kHeader = 7 * sizeof(int32_t);
  if (bytes.size() < kHeader) {
    return Invalid(path, absl::StrCat("file is ", bytes.size(),
                                      " bytes, shorter than the 28-byte llama2.c header"));
  }
  int32_t h[7];
  std::memcpy(h, bytes.data(), kHeader);
  m.dim = h[0];
  m.hidden_dim = h[1];
  m.n_layers = h[2];
  m.n_heads = h[3];
  m.n_kv_heads = h[4];
  m.shared_classifier = h[5] > 0;
  m.vocab_size = h[5] < 0 ? -h[5] : h[5];
  m.seq_len = h[6];
  const char* names[] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                         "seq_len"};
  const int32_t values[] = {m.dim, m.hidden_dim, m.n_layers, m.n_heads, m.n_kv_heads,
                            m.vocab_size, m.seq_len};
  for (int i = 0; i < 7; ++i) {
    if (values[i] <= 0 || values[i] > (1 << 24)) {
      return Invalid(path, absl::StrCat("header field ", names[i], " = ", values[i],
                                        " is out of range (not a llama2.c v0 checkpoint?)"));
    }
  }
  if (m.dim % m.n_heads != 0 || (m.dim / m.n_heads) % 2 != 0) {
    return Invalid(path, absl::StrCat("dim ", m.dim, " is not an even multiple of n_heads ",
                                      m.n_heads));
  }
  if (m.n_heads % m.n_kv_heads != 0) {
    return Invalid(path, absl::StrCat("n_heads ", m.n_heads, " is not a multiple of n_kv_heads ",
                                      m.n_kv_heads));
  }
  const int64_t dim = m.dim, hid = m.hidden_dim, L = m.n_layers, V = m.vocab_size,
                kv = m.kv_dim(), hd = m.head_dim(), seq = m.seq_len;
  struct Part {
    std::vector<float>* dst;
    int64_t count;
  };
  std::vector<Part> parts = {
      {&m.token_embedding, V * dim}, {&m.rms_att, L * dim},     {&m.wq, L * dim * dim},
      {&m.wk, L * kv * dim},         {&m.wv, L * kv * dim},     {&m.wo, L * dim * dim},
      {&m.rms_ffn, L * dim},         {&m.w1, L * hid * dim},    {&m.w2, L * dim * hid},
      {&m.w3, L * hid * dim},        {&m.rms_final, dim},       {nullptr, seq * hd / 2},
      {nullptr, seq * hd / 2}};
  if (!m.shared_classifier) parts.push_back({&m.wcls, V * dim});
  int64_t total = 0;
  for (const Part& p : parts) total += p.count;
  const uint64_t expected = kHeader + static_cast<uint64_t>(total) * sizeof(float);
  if (bytes.size() != expected) {
    return Invalid(path, absl::StrCat("file is ", bytes.size(), " bytes but its header (dim ", dim,
                                      ", hidden ", hid, ", layers ", L, ", heads ", m.n_heads,
                                      "/", m.n_kv_heads, ", vocab ", V, ", seq ", seq,
                                      m.shared_classifier ? ", shared" : ", unshared",
                                      " classifier) implies ", expected, " bytes"));
  }
  const char* p = bytes.data() + kHeader;
  for (const Part& part : parts) {
    if (part.dst) {
      part.dst->resize(part.count);
      std::memcpy(part.dst->data(), p, part.count * sizeof(float));
    }
    p += part.count * sizeof(float);
  }
  return m;
}

LlamaConfig Llama2cToLlamaConfig(const Llama2cModel& m) {
  LlamaConfig c;
  c.hidden_size = m.dim;
  c.intermediate_size = m.hidden_dim;
  c.num_hidden_layers = m.n_layers;
  c.num_attention_heads = m.n_heads;
  c.num_key_value_heads = m.n_kv_heads;
  c.head_dim = m.head_dim();
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.vocab_size = m.vocab_size;
  c.tie_word_embeddings = m.shared_classifier;
  c.max_position_embeddings = m.seq_len;
  c.torch_dtype = "float32";
  c.bos_token_id = 1;
  c.eos_token_id = 2;
  return c;
}

std::vector<float> PermuteInterleavedToHalfSplit(const std::vector<float>& w, int64_t n_heads,
                                                 int64_t head_dim, int64_t cols) {
  std::vector<float> out(w.size());
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < n_heads; ++h) {
    for (int64_t i = 0; i < half; ++i) {
      for (int64_t parity = 0; parity < 2; ++parity) {
        const int64_t src = h * head_dim + 2 * i + parity;
        const int64_t dst = h * head_dim + i + parity * half;
        std::memcpy(&out[dst * cols], &w[src * cols], cols * sizeof(float));
      }
    }
  }
  return out;
}

StatusOr<ImportResult> ImportLlama2c(const std::string& model_path,
                                     const std::string& tokenizer_path,
                                     const std::string& out_dir) {
  QCAL_ASSIGN_OR_RETURN(Llama2cModel m, ReadLlama2cModel(model_path));
  // Validate the tokenizer before writing anything.
  QCAL_ASSIGN_OR_RETURN(auto tokenizer, LoadLlama2cTokenizer(tokenizer_path));
  if (tokenizer->vocab_size() != m.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        tokenizer_path, ": tokenizer has ", tokenizer->vocab_size(), " pieces but ", model_path,
        " has vocab_size ", m.vocab_size));
  }
  QCAL_RETURN_IF_ERROR(MakeDirs(out_dir));
  const LlamaConfig config = Llama2cToLlamaConfig(m);

  const int64_t dim = m.dim, hid = m.hidden_dim, kv = m.kv_dim(), hd = m.head_dim();
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  writer.SetMetadata("source", "qcal import llama2c");
  int64_t params = 0;
  auto add = [&](const std::string& name, std::vector<int64_t> shape,
                 const float* data) -> Status {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    params += n;
    return writer.AddF32(name, std::move(shape), data);
  };
  QCAL_RETURN_IF_ERROR(add("model.embed_tokens.weight", {m.vocab_size, dim},
                           m.token_embedding.data()));
  for (int64_t l = 0; l < m.n_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    std::vector<float> wq(m.wq.begin() + l * dim * dim, m.wq.begin() + (l + 1) * dim * dim);
    std::vector<float> wk(m.wk.begin() + l * kv * dim, m.wk.begin() + (l + 1) * kv * dim);
    wq = PermuteInterleavedToHalfSplit(wq, m.n_heads, hd, dim);
    wk = PermuteInterleavedToHalfSplit(wk, m.n_kv_heads, hd, dim);
    QCAL_RETURN_IF_ERROR(add(p + "input_layernorm.weight", {dim}, &m.rms_att[l * dim]));
    QCAL_RETURN_IF_ERROR(add(p + "self_attn.q_proj.weight", {dim, dim}, wq.data()));
    QCAL_RETURN_IF_ERROR(add(p + "self_attn.k_proj.weight", {kv, dim}, wk.data()));
    QCAL_RETURN_IF_ERROR(add(p + "self_attn.v_proj.weight", {kv, dim}, &m.wv[l * kv * dim]));
    QCAL_RETURN_IF_ERROR(add(p + "self_attn.o_proj.weight", {dim, dim}, &m.wo[l * dim * dim]));
    QCAL_RETURN_IF_ERROR(add(p + "post_attention_layernorm.weight", {dim}, &m.rms_ffn[l * dim]));
    QCAL_RETURN_IF_ERROR(add(p + "mlp.gate_proj.weight", {hid, dim}, &m.w1[l * hid * dim]));
    QCAL_RETURN_IF_ERROR(add(p + "mlp.up_proj.weight", {hid, dim}, &m.w3[l * hid * dim]));
    QCAL_RETURN_IF_ERROR(add(p + "mlp.down_proj.weight", {dim, hid}, &m.w2[l * dim * hid]));
  }
  QCAL_RETURN_IF_ERROR(add("model.norm.weight", {dim}, m.rms_final.data()));
  if (!m.shared_classifier) {
    QCAL_RETURN_IF_ERROR(add("lm_head.weight", {m.vocab_size, dim}, m.wcls.data()));
  }
  QCAL_RETURN_IF_ERROR(writer.Write(out_dir + "/model.safetensors"));
  QCAL_RETURN_IF_ERROR(
      WriteSentencePieceModelFromLlama2c(tokenizer_path, out_dir + "/tokenizer.model"));

  nlohmann::json tok_config = {{"tokenizer_class", "LlamaTokenizer"},
                               {"add_bos_token", true},
                               {"add_eos_token", false},
                               {"bos_token", "<s>"},
                               {"eos_token", "</s>"},
                               {"unk_token", "<unk>"},
                               {"model_max_length", m.seq_len}};
  QCAL_RETURN_IF_ERROR(
      WriteFileAtomic(out_dir + "/tokenizer_config.json", tok_config.dump(2) + "\n"));
  nlohmann::json gen_config = {{"bos_token_id", 1}, {"eos_token_id", 2}};
  QCAL_RETURN_IF_ERROR(
      WriteFileAtomic(out_dir + "/generation_config.json", gen_config.dump(2) + "\n"));
  // config.json last: its presence marks a complete model directory.
  QCAL_RETURN_IF_ERROR(
      WriteFileAtomic(out_dir + "/config.json", LlamaConfigToJson(config).dump(2) + "\n"));

  ImportResult result;
  result.out_dir = out_dir;
  result.config = config;
  result.num_parameters = params;
  result.num_tensors = 2 + 9 * m.n_layers + (m.shared_classifier ? 0 : 1);
  return result;
}

}  // namespace qcal
