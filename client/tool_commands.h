// `qcal tool ...`: developer tools that work on a model directory in this process.
//   plant-outliers  function-preserving variant with planted activation outliers
//                   (tools/plant_outliers.h)
//   outlier-stats   max/median channel ratios of the down_proj input, o_proj input and K
//                   (tools/outlier_stats.h)
//   kv-eval         perplexity with a BFP K cache (BFP12 keys, BFP16 queries), with or without
//                   K-sort (engine/qsim/bfp_kv.h, ksort.h)
// Each Run* returns the process exit code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace qcal::client {

struct PlantOutliersCliOptions {
  std::string model_dir;
  std::string out_dir;
  double alpha = 50;
  double beta = 50;
  int64_t channels = 2;  // down_proj-input and o_proj-input channels per layer
  int64_t k_pairs = 1;   // K RoPE pairs per KV head
  uint64_t seed = 0;
  bool json = false;
};

struct OutlierStatsOptions {
  std::string model_dir;
  std::string data_path;
  int64_t tokens = 4096;
  int64_t ctx = 128;
  // Token-wise statistics (PrefixQuant): per layer the largest token max/median at the down_proj
  // input, outlier counts, the detected prefix; with prefix == "detect", measured again with the
  // detected prefix installed.
  bool token_stats = false;
  double eta = 64;
  std::string prefix = "none";  // none | detect
  bool json = false;
};

struct PlantSinksCliOptions {
  std::string model_dir;
  std::string out_dir;
  std::vector<std::string> data_paths;
  std::vector<std::string> delimiters = {"."};  // token pieces, or id:N
  int64_t max_tokens = 200000;
  int64_t sampled_sequences = 64;
  int64_t writer_layer = -1;
  int64_t eraser_layer = -1;
  double massive_ratio = 300;
  double residual_ratio = 500;
  double sink_score = 2.0;
  int64_t steps = 0;
  int64_t batch = 8;
  int64_t seq_len = 128;
  double lr = 1e-3;
  uint64_t seed = 0;
  int threads = 0;
  bool json = false;
};

struct KvEvalOptions {
  std::string model_dir;
  std::string data_path;
  int64_t ctx = 2048;
  int64_t max_tokens = -1;
  int64_t batch = 1;
  bool bos_per_window = false;
  int key_bits = 4;                    // BFP key mantissa bits (4 = BFP12); 16 = float keys
  int query_bits = 8;                  // BFP query mantissa bits (8 = BFP16); 16 = float queries
  int64_t block = 0;                   // BFP block size along head_dim (0 = head_dim)
  std::string key_point = "pre-rope";  // pre-rope (the paper) | post-rope
  bool k_sort = false;
  std::string k_sort_order = "channels";  // channels (Algorithm 1) | pairs
  bool sort_values = true;
  bool kl = false;  // also evaluate the float model: its perplexity and KL(float || quantized)
  int threads = 0;
  bool json = false;
};

// `qcal tool expert-load`: tokens per expert of each MoE layer on a text (tools/expert_load.h).
struct ExpertLoadOptions {
  std::string model_dir;
  std::string data_path;
  int64_t tokens = 4096;  // the first N text tokens (0: all)
  int64_t ctx = 128;      // window length: BOS + ctx-1 text tokens
  int threads = 0;
  bool json = false;
};

// Registers `tool` and its subcommands on `app`; callbacks store their exit code in *exit_code.
void AddToolCommands(CLI::App& app, int* exit_code);

int RunPlantOutliers(const PlantOutliersCliOptions& options);
int RunOutlierStats(const OutlierStatsOptions& options);
int RunPlantSinks(const PlantSinksCliOptions& options);
int RunKvEval(const KvEvalOptions& options);
int RunExpertLoad(const ExpertLoadOptions& options);

}  // namespace qcal::client
