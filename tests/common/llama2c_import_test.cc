// llama2.c import: validation errors and the RoPE permutation.
#include <cstdio>
#include <cstring>
#include <fstream>

#include <gtest/gtest.h>

#include "common/atomic_file.h"
#include "common/llama2c.h"
#include "common/safetensors.h"
#include "tests/test_util.h"

namespace qcal {
namespace {

std::string StoriesBin() { return testing::SharedDir() + "/models/stories260K/stories260K.bin"; }

TEST(Llama2cTest, ReadsStoriesHeader) {
  auto m = ReadLlama2cModel(StoriesBin());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->dim, 64);
  EXPECT_EQ(m->hidden_dim, 172);
  EXPECT_EQ(m->n_layers, 5);
  EXPECT_EQ(m->n_heads, 8);
  EXPECT_EQ(m->n_kv_heads, 4);
  EXPECT_EQ(m->vocab_size, 512);
  EXPECT_TRUE(m->shared_classifier);
  EXPECT_EQ(m->wk.size(), 5u * 32 * 64);
}

TEST(Llama2cTest, TruncatedFileIsAClearError) {
  auto bytes = ReadFile(StoriesBin());
  ASSERT_TRUE(bytes.ok());
  const std::string dir = testing::MakeTempDir("l2c");
  const std::string path = dir + "/cut.bin";
  ASSERT_TRUE(WriteFileAtomic(path, bytes->substr(0, bytes->size() - 100)).ok());
  auto m = ReadLlama2cModel(path);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find(path), std::string::npos);
  EXPECT_NE(m.status().message().find("implies"), std::string::npos) << m.status();

  ASSERT_TRUE(WriteFileAtomic(path, "abc").ok());
  m = ReadLlama2cModel(path);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("shorter than the 28-byte"), std::string::npos);

  std::string bad = *bytes;
  int32_t negative_heads = -3;
  std::memcpy(&bad[12], &negative_heads, 4);
  ASSERT_TRUE(WriteFileAtomic(path, bad).ok());
  m = ReadLlama2cModel(path);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("n_heads"), std::string::npos) << m.status();
}

TEST(Llama2cTest, PermutationMovesInterleavedPairsToHalves) {
  // 2 heads of dim 4, 1 column: rows [h0: a0 b0 a1 b1 | h1: ...] -> [a0 a1 b0 b1 | ...]
  std::vector<float> w = {0, 1, 2, 3, 10, 11, 12, 13};
  std::vector<float> p = PermuteInterleavedToHalfSplit(w, 2, 4, 1);
  EXPECT_EQ(p, (std::vector<float>{0, 2, 1, 3, 10, 12, 11, 13}));
}

TEST(Llama2cTest, ImportWritesAHuggingFaceDirectory) {
  const std::string dir = testing::MakeTempDir("import") + "/stories";
  auto r = ImportLlama2c(StoriesBin(),
                         testing::SharedDir() + "/models/stories260K/tok512.bin", dir);
  ASSERT_TRUE(r.ok()) << r.status();
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.model",
                        "tokenizer_config.json", "generation_config.json"}) {
    EXPECT_TRUE(std::ifstream(dir + "/" + f).good()) << f;
  }
  auto ckpt = CheckpointReader::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(static_cast<int64_t>((*ckpt)->TensorNames().size()), r->num_tensors);
  EXPECT_FALSE((*ckpt)->Has("lm_head.weight"));  // tied
  auto m = ReadLlama2cModel(StoriesBin());
  ASSERT_TRUE(m.ok());
  auto v = (*ckpt)->ReadF32("model.layers.2.self_attn.v_proj.weight");
  ASSERT_TRUE(v.ok());
  EXPECT_TRUE(std::equal(v->begin(), v->end(), m->wv.begin() + 2 * 32 * 64));
  EXPECT_EQ(r->num_parameters, 512 * 64 + 5 * (64 * 2 + 64 * 64 * 2 + 32 * 64 * 2 + 172 * 64 * 3) + 64);

  // A tokenizer whose vocabulary does not match the model is refused before anything is written.
  const std::string dir2 = testing::MakeTempDir("import") + "/bad";
  auto bad = ImportLlama2c(StoriesBin(), StoriesBin(), dir2);
  ASSERT_FALSE(bad.ok());
  EXPECT_FALSE(std::ifstream(dir2 + "/config.json").good());
}

}  // namespace
}  // namespace qcal
