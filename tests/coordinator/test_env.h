// A small on-disk world for coordinator tests: a model directory holding a valid config.json and a
// model.safetensors with one small tensor per block (the fakes never read weights; the job's
// planning hashes the file and checks every block has tensors), calibration text under a data
// root, and a recipe.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "common/atomic_file.h"
#include "common/safetensors.h"
#include "proto/qcal.pb.h"
#include "tests/test_util.h"

namespace qcal::coordinator::testing {

inline constexpr char kTinyConfig[] = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
  "intermediate_size": 172, "num_hidden_layers": 4, "num_attention_heads": 8,
  "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 512,
  "rms_norm_eps": 1e-05, "tie_word_embeddings": true
})";

inline constexpr char kQuipRecipe[] = R"(name: quip-test
method: quip
bits: 2
codebook: e8p
calibration:
  files: [data/calib.txt]
  num_sequences: 4
  seq_len: 32
)";

struct TestEnv {
  std::string root, model_dir, data_root, out_dir;

  static TestEnv Make(const std::string& prefix) {
    TestEnv e;
    e.root = std::filesystem::path(qcal::testing::MakeTempDir(prefix)).lexically_normal().string();
    e.model_dir = e.root + "/model";
    e.data_root = e.root + "/shared";
    e.out_dir = e.root + "/out";
    EXPECT_TRUE(MakeDirs(e.model_dir).ok());
    EXPECT_TRUE(MakeDirs(e.data_root + "/data").ok());
    EXPECT_TRUE(WriteFileAtomic(e.model_dir + "/config.json", kTinyConfig).ok());
    SafetensorsWriter weights;
    static const std::vector<float> norm(64, 1.0f);
    for (int l = 0; l < 4; ++l) {
      EXPECT_TRUE(weights
                      .AddF32("model.layers." + std::to_string(l) + ".input_layernorm.weight",
                              {64}, norm.data())
                      .ok());
    }
    EXPECT_TRUE(weights.Write(e.model_dir + "/model.safetensors").ok());
    EXPECT_TRUE(WriteFileAtomic(e.data_root + "/data/calib.txt", "Once upon a time.\n").ok());
    return e;
  }

  v1::JobSpec Spec(int workers = 2, const std::string& out = "") const {
    v1::JobSpec s;
    s.set_recipe_path("jobs/quip-test.yaml");
    s.set_recipe_yaml(kQuipRecipe);
    s.set_model_dir(model_dir);
    s.set_out_dir(out.empty() ? out_dir : out);
    s.set_data_root(data_root);
    s.set_workers(workers);
    return s;
  }
};

}  // namespace qcal::coordinator::testing
