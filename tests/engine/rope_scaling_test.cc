// RoPE scaling (issue 12): a Llama-3.1-shaped tiny random model (hidden 128, 2 layers, 4 heads /
// 2 KV heads, llama3 rope_scaling with original_max_position_embeddings 32 and a 160-token
// context) made by the independent numpy reference tests/reference/llama_reference.py: qcal's
// logits equal the reference's (Hugging Face's formulas, float64) within 1e-4 relative; the same
// weights without scaling give logits more than 1e-2 away from them, so the comparison can fail;
// `linear` likewise. Needs /usr/bin/python3 with numpy (scripts/install-deps.sh installs it).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"
#include "engine/model/llama.h"

namespace qcal {
namespace {

using testing::MakeTempDir;
using testing::RelMaxDiff;
using testing::SourceDir;

constexpr int64_t kVocab = 300;
constexpr int64_t kSeq = 160;

std::string Script() { return SourceDir() + "/tests/reference/llama_reference.py"; }

void Run(const std::string& cmd) {
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

// Makes the reference model with `scaling` (a JSON object or "null"), seed fixed so that every
// variant has the same weights.
std::string MakeModel(const std::string& name, const std::string& scaling) {
  const std::string dir = MakeTempDir(name);
  Run(absl::StrCat("/usr/bin/python3 ", Script(), " make --out ", dir, " --seed 7 --vocab ", kVocab,
                   " --rope-scaling '", scaling, "'"));
  return dir;
}

std::vector<int64_t> Tokens() {
  std::mt19937_64 rng(12345);
  std::vector<int64_t> ids(kSeq);
  for (auto& t : ids) t = static_cast<int64_t>(rng() % kVocab);
  return ids;
}

at::Tensor ReferenceLogits(const std::string& dir) {
  const std::string out = dir + "/reference_logits.f32";
  Run(absl::StrCat("/usr/bin/python3 ", Script(), " logits --model ", dir, " --tokens ",
                   absl::StrJoin(Tokens(), ","), " --out ", out));
  std::ifstream in(out, std::ios::binary);
  std::vector<float> v(kSeq * kVocab);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
  EXPECT_EQ(in.gcount(), static_cast<std::streamsize>(v.size() * 4)) << out;
  return at::from_blob(v.data(), {kSeq, kVocab}, at::kFloat).clone();
}

at::Tensor QcalLogits(const std::string& dir) {
  auto m = model::LlamaModel::Load(dir);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return at::Tensor();
  std::vector<int64_t> ids = Tokens();
  const at::Tensor t = at::from_blob(ids.data(), {1, kSeq}, at::kLong).clone();
  return (*m)->Forward(t)[0];
}

class RopeScalingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::system("/usr/bin/python3 -c 'import numpy' 2>/dev/null") != 0) {
      FAIL() << "/usr/bin/python3 with numpy is needed (scripts/install-deps.sh installs it)";
    }
    model::SetComputeThreads(1);
  }
};

TEST_F(RopeScalingTest, Llama3ScalingMatchesTheNumpyReference) {
  const std::string scaled = MakeModel(
      "llama31", R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,)"
                 R"( "high_freq_factor": 4.0, "original_max_position_embeddings": 32})");
  const std::string plain = MakeModel("plain", "null");
  const at::Tensor ref = ReferenceLogits(scaled);
  const at::Tensor got = QcalLogits(scaled);
  ASSERT_TRUE(got.defined());
  const double err = RelMaxDiff(ref, got);
  const double plain_vs_ref = RelMaxDiff(ref, QcalLogits(plain));
  const double plain_err = RelMaxDiff(ReferenceLogits(plain), QcalLogits(plain));
  std::printf("llama3 scaling: qcal vs reference %.3g; unscaled qcal vs scaled reference %.3g; "
              "unscaled qcal vs unscaled reference %.3g\n",
              err, plain_vs_ref, plain_err);
  EXPECT_LT(err, 1e-4);
  EXPECT_GT(plain_vs_ref, 1e-2) << "the scaling must change the logits for the test to mean much";
  EXPECT_LT(plain_err, 1e-4);
}

TEST_F(RopeScalingTest, LinearScalingMatchesTheNumpyReference) {
  const std::string scaled = MakeModel("linear", R"({"type": "linear", "factor": 4.0})");
  const std::string plain = MakeModel("plain", "null");
  const at::Tensor ref = ReferenceLogits(scaled);
  const at::Tensor got = QcalLogits(scaled);
  ASSERT_TRUE(got.defined());
  const double err = RelMaxDiff(ref, got);
  const double plain_vs_ref = RelMaxDiff(ref, QcalLogits(plain));
  std::printf("linear scaling: qcal vs reference %.3g; unscaled qcal vs scaled reference %.3g\n",
              err, plain_vs_ref);
  EXPECT_LT(err, 1e-4);
  EXPECT_GT(plain_vs_ref, 1e-2);
}

}  // namespace
}  // namespace qcal
