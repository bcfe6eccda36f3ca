// `qcal import`, `qcal eval`, `qcal generate`, `qcal export`: commands that work on a model
// directory in this process (no coordinator). Each Run* returns the process exit code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace qcal::client {

struct ImportOptions {
  std::string format = "llama2c";
  std::string model_path;
  std::string tokenizer_path;
  std::string out_dir;
  bool json = false;
};

struct ExportCommandOptions {
  std::string format = "gptq";  // gptq | dense
  std::string in_dir;
  std::string out_dir;
  std::string max_shard_size = "5G";
  bool json = false;
};

struct EvalOptions {
  std::string model_dir;
  std::string data_path;
  int64_t ctx = 0;  // 0: the model's context (max_position_embeddings), at most 2048
  int64_t max_tokens = -1;
  int64_t batch = 1;
  bool bos_per_window = false;
  bool json = false;
  int threads = 0;
  // A reference model (the float one): also its perplexity on the same tokens and the mean
  // KL(reference || model) of the next-token distributions (tools::CompareToReference).
  std::string reference_dir;
  // Where LibTorch evaluates (model::ResolveTorchDevice): auto picks a GPU when this build's
  // LibTorch has CUDA. A model with a layer that cannot move is evaluated on the CPU (said).
  std::string device = "auto";
  // Also write the evaluated text tokens (after --max-tokens) here, int32 little-endian, so
  // that other programs score exactly the same windows (tests/reference/ct_dequant.py ppl).
  std::string save_tokens;
};

struct GenerateOptions {
  std::string model_dir;
  std::string prompt;
  int64_t max_new_tokens = 64;
  bool json = false;
  int threads = 0;
};

struct ReportCommandOptions {
  std::string dir;                      // a job directory or a job's output directory
  std::vector<std::string> eval_paths;  // texts to measure perplexity and KL on (optional)
  int64_t ctx = 512;
  int64_t max_tokens = -1;
  bool bos_per_window = false;
  int threads = 0;
  std::string out;  // default JOB/report.html
  bool json = false;
};

// Registers the subcommands on `app`; the callbacks store their exit code in *exit_code.
void AddModelCommands(CLI::App& app, int* exit_code);

int RunImport(const ImportOptions& options);
int RunEval(const EvalOptions& options);
int RunGenerate(const GenerateOptions& options);
int RunExport(const ExportCommandOptions& options);

}  // namespace qcal::client
