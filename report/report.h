// The job report: one self-contained HTML page (inline SVG plots, no external resources) that
// shows a quantization job the way people judge one — per-layer proxy loss by linear, block
// output error before and after fine-tuning, fine-tuning and rotation-training curves,
// perplexity and KL against the float model, time per phase and per block, peak memory per rank.
//
// Everything comes from the job directory (docs/formats.md "Job directory"): journal.jsonl's
// job_start / block_done / e2e_done / job_done entries (the latest block_done of each layer) and
// phases/rotations.safetensors (SpinQuant's training losses). Perplexity and KL are not in the
// journal: the caller measures them (`qcal report --eval`) and passes them in. Torch-free, so
// both job drivers write JOB/report.html when a job finishes (runner/workspace.cc).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace qcal::report {

// Perplexity of the float and the quantized model on one text, and the mean KL(float ‖ quant).
struct EvalRow {
  std::string label;  // the text file
  int64_t ctx = 0;
  int64_t tokens_scored = 0;
  double float_perplexity = 0;
  double quantized_perplexity = 0;
  double mean_kl = 0;  // nats per token
};

struct ReportInputs {
  std::string job_dir;  // holds journal.jsonl
  std::string out_dir;  // the job's output checkpoint (from the journal when empty)
  std::vector<EvalRow> evals;
};

// A job directory (it holds journal.jsonl) or an output directory (its job directory is
// OUT.job, the drivers' default); the output directory is the journal's. InvalidArgument
// naming the directory when neither.
StatusOr<ReportInputs> ResolveJobDirs(const std::string& dir);

// The output checkpoint's model directory as the journal's job_start names it ("" if none).
StatusOr<std::string> JournaledModelDir(const std::string& job_dir);

// The page. InvalidArgument naming the file for an unreadable journal; a journal without
// finished blocks renders (it says so).
StatusOr<std::string> RenderReport(const ReportInputs& inputs);

// RenderReport written atomically to `path`.
Status WriteReport(const ReportInputs& inputs, const std::string& path);

}  // namespace qcal::report
