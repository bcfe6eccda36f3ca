// The job report: one self-contained HTML page (inline SVG plots, no external resources) that
// shows a quantization job the way people judge one — per-layer proxy loss by linear, block
// output error before and after fine-tuning, fine-tuning and rotation-training curves,
// perplexity and KL against the float model, time per phase and per block, peak memory per rank.
//
// Everything comes from the files of a job the caller names (runner/workspace.h ReportInputsOf
// names them in the job directory, docs/formats.md "Job directory"): the journal's job_start /
// block_done / e2e_done / phase_done / job_done entries (the latest block_done of each layer;
// the latest phase_done of each global phase that trained, whose losses and held-out scores are
// plotted under the phase's name: the report names no method).
// Perplexity and KL are not in the journal: the caller measures them (`qcal report --eval`) and
// passes them in. Torch-free, so both job drivers write the report when a job finishes.
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
  std::string journal;     // the job's journal
  std::string out_dir;     // the job's output checkpoint (from the journal when empty)
  std::vector<EvalRow> evals;
};

// The directories the journal's last job_start names ("" where it names none). InvalidArgument
// naming the journal when it is unreadable or has no job_start.
struct JournaledJob {
  std::string model_dir, out_dir;
};
StatusOr<JournaledJob> ReadJournaledJob(const std::string& journal);

// The page. InvalidArgument naming the file for an unreadable journal; a journal without
// finished blocks renders (it says so).
StatusOr<std::string> RenderReport(const ReportInputs& inputs);

// RenderReport written atomically to `path`.
Status WriteReport(const ReportInputs& inputs, const std::string& path);

}  // namespace qcal::report
