// Model fixtures shared by the tests that run real models: the bundled llama2.c models imported
// once per process into a temp HF directory, loading, text tokens, and logit comparison.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/llama2c.h"
#include "common/text.h"
#include "common/tokenizer.h"
#include "tests/test_util.h"
#include "engine/model/llama.h"

namespace qcal::testing {

// The HF directory of a real model (stories260K or aidreams260K), imported on first use.
inline std::string RealModelDir(const std::string& name) {
  static std::string* root = new std::string(MakeTempDir("models"));
  const std::string dir = *root + "/" + name;
  if (!std::ifstream(dir + "/config.json").good()) {
    const std::string src = SharedDir() + "/models/" + name;
    auto r = ImportLlama2c(src + "/" + name + ".bin", src + "/tok512.bin", dir);
    EXPECT_TRUE(r.ok()) << r.status();
  }
  return dir;
}

// Aborts the test binary with the load error: every caller needs the model.
inline std::unique_ptr<model::LlamaModel> LoadModelOrDie(const std::string& dir) {
  auto m = model::LlamaModel::Load(dir);
  if (!m.ok()) {
    std::fprintf(stderr, "LoadModelOrDie(%s): %s\n", dir.c_str(), m.status().ToString().c_str());
    std::abort();
  }
  return std::move(*m);
}

// The first `count` tokens of the TinyStories sample, encoded with the model's tokenizer.
inline std::vector<int32_t> StoryTokens(const std::string& model_dir, size_t count) {
  auto tok = LoadTokenizerFromModelDir(model_dir);
  EXPECT_TRUE(tok.ok()) << tok.status();
  auto text = ReadTextFile(SharedDir() + "/data/tinystories/TinyStories-valid.sample30k.txt");
  EXPECT_TRUE(text.ok()) << text.status();
  if (!tok.ok() || !text.ok()) return {};
  std::vector<int32_t> ids = (*tok)->Encode(*text);
  if (ids.size() > count) ids.resize(count);
  return ids;
}

// The id of the vocabulary piece `piece` of a model's tokenizer (a test failure when absent).
inline int32_t PieceId(const std::string& model_dir, const std::string& piece) {
  auto tok = LoadTokenizerFromModelDir(model_dir);
  EXPECT_TRUE(tok.ok()) << tok.status();
  if (!tok.ok()) return -1;
  for (int32_t i = 0; i < (*tok)->vocab_size(); ++i) {
    if ((*tok)->Piece(i) == piece) return i;
  }
  ADD_FAILURE() << "no piece '" << piece << "'";
  return -1;
}

// [b, s] int64: b consecutive pieces of the TinyStories sample's tokens, each BOS (1) and s - 1
// tokens.
inline at::Tensor StoryBatch(const std::string& model_dir, int64_t b, int64_t s) {
  const std::vector<int32_t> ids = StoryTokens(model_dir, static_cast<size_t>(b * (s - 1)));
  at::Tensor t = at::empty({b, s}, at::kLong);
  for (int64_t i = 0; i < b; ++i) {
    t[i][0] = 1;
    for (int64_t j = 1; j < s; ++j) t[i][j] = ids[i * (s - 1) + j - 1];
  }
  return t;
}

// [1, n] int64: BOS followed by the tokens.
inline at::Tensor WithBos(const std::vector<int32_t>& tokens, int64_t n, int32_t bos = 1) {
  std::vector<int64_t> ids = {bos};
  for (int64_t i = 0; i + 1 < n && i < static_cast<int64_t>(tokens.size()); ++i) {
    ids.push_back(tokens[i]);
  }
  return at::from_blob(ids.data(), {1, static_cast<int64_t>(ids.size())}, at::kLong).clone();
}

// A float copy of a block's weights, every linear dense (a method consumes the weights it
// quantizes).
inline model::BlockWeights CopyBlock(const model::BlockWeights& w) {
  model::BlockWeights c;
  c.input_norm = w.input_norm.clone();
  c.post_norm = w.post_norm.clone();
  for (model::LinearKind k : model::kAllLinears) {
    c.linears[static_cast<int>(k)] =
        std::make_unique<model::DenseLinear>(w.linear(k).DenseWeight().clone());
  }
  return c;
}

// max |a - b| / max |a|.
inline double RelMaxDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / a.abs().max().item<double>();
}

}  // namespace qcal::testing
