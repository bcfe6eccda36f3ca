// Calibration data, per-block Hessians and block-boundary activations for a quantization job
// (QuIP# §F / GPTQ convention), data-parallel over the ranks of a Comm.
//
// Sequences: the recipe's text files are read (newlines normalised), concatenated with "\n\n",
// tokenized once, and num_sequences windows of seq_len − 1 tokens are taken at offsets drawn
// uniformly with std::mt19937_64(seed) (GPTQ's sampling); each sequence is BOS + its window.
//
// Canonical chunks: the sequences are processed in chunks of `batch` sequences, chunk k =
// sequences [k·batch, (k+1)·batch) (the last may be shorter). A rank owns the contiguous chunks
// SliceForRank(num_chunks, rank, size), so every forward op sees exactly the inputs (and GEMM
// shapes) it sees in a single process, and the exact fixed-point Hessian sums (hessian.h) make
// the reduced Hessians bit-identical for any number of ranks.
//
// Files (job_dir): hessians/block_<l>.safetensors, per kind "<kind>.fixed" (I64 [n(n+1)/2, 2]:
// the exact int128 sums T as little-endian (low, high) words), "<kind>.dim" (I64, n) and
// "<kind>.count" (I64), metadata calibration_key and hessian_format "3". Files of older formats
// ("2" also held an fp64 copy of the sums, doubling the file; without hessian_format: fp64
// sums only) are treated as stale and recomputed. activations/block_<l>.safetensors:
// tensor "hidden" [N, S, hidden] F32 = the float model's input of block l (l = num_blocks: the
// last block's output), all N sequences in order, metadata calibration_key. Rank 0 writes the
// Hessian files (with sharded Hessians every rank writes its band of each triangle in place, and
// the bytes are the same); every rank writes its own rows of the activation files; all read them
// from the shared job directory when they need them.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/recipe.h"
#include "common/status.h"
#include "common/tokenizer.h"
#include "kernels/gpu_backend.h"
#include "worker/calib/hessian.h"
#include "worker/model/llama.h"
#include "worker/model/model_source.h"
#include "worker/comm/comm.h"

namespace qcal::calib {

// [num_sequences, seq_len] int64. Files are resolved against `data_root` when relative. Errors:
// missing file (named), too little text for one window.
StatusOr<at::Tensor> SampleCalibrationTokens(const Tokenizer& tokenizer,
                                             const CalibrationSpec& spec,
                                             const std::string& data_root, int64_t seq_len,
                                             int32_t bos_id);

// A stable key for cached calibration products: the job's inputs key (common/input_fingerprint.h:
// the model's and the data's content, the recipe, the job format), the config and the sampling
// settings. Products with another key are recomputed, never reused.
std::string CalibrationKey(const std::string& inputs_key, const LlamaConfig& config,
                           const CalibrationSpec& spec, int64_t seq_len);

std::string HessianPath(const std::string& job_dir, int64_t block);
// Every cache file (Hessians, activations) has a checksum beside it, "<file>.fnv1a64" (the hex
// FNV-1a 64 of its bytes), written after the file and verified before any reuse: a missing
// checksum is FailedPrecondition, a mismatch DataLoss naming the file; the calibration phase
// then recomputes the caches instead of using them.
std::string CacheChecksumPath(const std::string& path);
Status WriteCacheChecksum(const std::string& path);
Status VerifyCacheChecksum(const std::string& path);
std::string ActivationPath(const std::string& job_dir, int64_t boundary);

// Saves / loads one block's Hessians (exact sums + counts) under job_dir/hessians/.
Status SaveBlockHessians(const std::string& path, const BlockHessians& h, const std::string& key);
// NotFound when absent; FailedPrecondition when present with another key or in the old format
// (stale cache); DataLoss when malformed. mapped: the sums are not read into the accumulators;
// the file stays mapped (BlockHessians::stored) and each kind's mean is made from it when asked
// for (BlockHessians::Mean, HessianMeans), so a block task holds one kind's fp64 mean at a time
// and never its exact sums (6.6 GB at a 70B down_proj) beside it.
StatusOr<BlockHessians> LoadBlockHessians(const std::string& path, const std::string& key,
                                          bool mapped = false);

// Sums every rank's accumulators (exactly: fixed-point digits through AllReduceSum(int64)); every
// rank ends with the total. The accumulators must have the same dimensions on every rank.
Status AllReduceHessians(runtime::Comm& comm, BlockHessians* h);

// The same for sums still on the devices (h->device, ForwardCollectingHessians with
// flush_device = false): the counts and dimensions over `comm` (host), the sums on the devices
// through `device_sum` (NCCL), so only reduced sums ever come to the host. download: whether this
// rank then moves them into its accumulators (the rank that saves them, or one that keeps them);
// otherwise they are released and the accumulators are left as they were. *rows (when given):
// the reduced row count of the qkv input (the calibration tokens). A rank without sequences gets
// zero device sums first. Collective; every rank needs a GPU backend.
Status AllReduceDeviceHessians(runtime::Comm& comm, const kernels::DeviceInt64Sum& device_sum,
                               bool download, BlockHessians* h, int64_t* rows = nullptr);

// One boundary's activations [N, S, hidden] F32. NotFound when absent, FailedPrecondition for
// another calibration key, DataLoss when malformed or of another shape.
StatusOr<at::Tensor> LoadActivation(const std::string& path, const std::string& key,
                                    const std::vector<int64_t>& shape);
Status SaveActivation(const std::string& path, const at::Tensor& hidden, const std::string& key);

struct CalibrationOptions {
  int64_t batch = 8;              // sequences per canonical chunk
  // Activations this rank holds in memory during the walk; above it they are spilled to
  // job_dir/spill (activation_store.h). Default: no limit.
  int64_t memory_budget_bytes = std::numeric_limits<int64_t>::max();
  bool hessians = true;           // compute (or reuse) every block's Hessians
  bool activations = false;       // compute (or reuse) every block boundary's activations
  bool keep_hessians = true;      // return the Hessians in CalibrationResult::hessians
  // Sharded Hessians: instead of every rank summing its own sequences into whole accumulators
  // (16 bytes per entry of each triangle on every rank: 8.2 GB at a 70B block) and reducing
  // them, each rank owns one band of rows of each triangle (HessianBandForRank) and sums every
  // rank's sequences into it: the ranks gather one chunk's linear inputs from each other at a
  // time. Memory per rank falls to 1/ranks of the sums plus the ranks' inputs of one chunk; the
  // traffic is the calibration inputs (all of them reach every rank) instead of two passes over
  // the sums. The bands are written in place into the same file, so the bytes (and every later
  // result) are those of the unsharded walk. Every rank must pass the same value.
  bool shard_hessians = false;
  // The accumulators' strip height (kHessianStripRows). Tests lower it to cut small Hessians
  // into several bands; both walks give the same bits for the same value.
  int64_t hessian_strip_rows = kHessianStripRows;
  // GPU ranks: an in-place int64 sum over the ranks of a device buffer (NCCL's all-reduce; the
  // worker makes it when it runs on a GPU). When every rank has a GPU backend and this, each
  // block's Hessian sums are reduced on the devices (AllReduceDeviceHessians) instead of being
  // downloaded and reduced through `comm` on the hosts: 32 bytes per value through host memory
  // and MPI (16 GB at a 70B block) become a device-to-device all-reduce. Same bytes either way.
  kernels::DeviceInt64Sum device_sum;
};

struct CalibrationResult {
  std::vector<BlockHessians> hessians;  // one per block when kept (the reduced totals)
  int64_t tokens = 0;                   // calibration tokens per Hessian (all ranks)
  bool from_cache = false;              // Hessians reused from job_dir
  bool activations_from_cache = false;  // activations reused from job_dir
  double seconds = 0;
};

// Collective: every rank of `comm` calls it with the same model, all `tokens`
// [num_sequences, seq_len] and the same options. Reuses cached products whose key matches (rank
// 0 decides and tells the others); otherwise each rank streams the float model block by block
// (one block in memory: `source` reads it when the walk reaches it) over its chunks, whose
// activations it holds in memory up to options.memory_budget_bytes and in a spill file above.
// Hessians are summed over ranks and saved by rank 0; activation files are written in place by
// every rank (its own rows), so no rank holds another's. Ends with a barrier, so the files are
// complete when any rank returns. A failure on any rank makes every rank return an error (the
// failing rank its own, naming the block and Hessian; the others Aborted). progress(block,
// blocks) on every rank.
StatusOr<CalibrationResult> Calibrate(runtime::Comm& comm, model::ModelSource& source,
                                      const at::Tensor& tokens, const std::string& job_dir,
                                      const std::string& key, const CalibrationOptions& options,
                                      const std::function<void(int64_t, int64_t)>& progress =
                                          nullptr);

}  // namespace qcal::calib
