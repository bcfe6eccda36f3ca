// The calibration walk of a quantization job (QuIP# §F / GPTQ convention): per-block Hessians and
// block-boundary activations of the float model, data-parallel over the ranks of a Comm. Its
// pieces: the calibration sequences (tokens.h), the cached products in the job directory
// (cache.h: keys, checksums, files), the collectives (reduce.h), and this walk.
//
// Canonical chunks: the sequences are processed in chunks of `batch` sequences, chunk k =
// sequences [k·batch, (k+1)·batch) (the last may be shorter). A rank owns the contiguous chunks
// SliceForRank(num_chunks, rank, size), so every forward op sees exactly the inputs (and GEMM
// shapes) it sees in a single process, and the exact fixed-point Hessian sums (hessian.h) make
// the reduced Hessians bit-identical for any number of ranks.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "engine/calib/cache.h"
#include "engine/calib/hessian.h"
#include "engine/calib/reduce.h"
#include "engine/calib/tokens.h"
#include "engine/comm/comm.h"
#include "engine/model/model_source.h"
#include "kernels/gpu_backend.h"

namespace qcal::calib {

struct CalibrationOptions {
  int64_t batch = 8;              // sequences per canonical chunk
  // Activations this rank holds in memory during the walk; above it they are spilled to
  // CalibrationDirs::spill (activation_store.h). Default: no limit.
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
  // The rank's GPU backend (null: the CPU): the block forward and the Hessian sums run there.
  kernels::GpuBackend* gpu = nullptr;
  // The device block forward's arithmetic (CalibrationSpec::precision; the CPU's is fp32).
  kernels::BlockForwardPrecision precision = kernels::BlockForwardPrecision::kFloat32;
  // MoE blocks (CalibrationSpec::moe_route_all, moe_min_tokens). The starved-expert rule: unless
  // every expert calibrates on every token, a first pass over the block's chunks counts the
  // router's tokens per expert (attention and the router only, CountRoutedTokens), summed over
  // the ranks; an expert below the minimum then calibrates on every token in the Hessian pass
  // (ExpertHessians::route_all), and rank 0 logs a warning naming the block and the expert. An
  // expert is never left without a Hessian: one no token reaches gets every token's.
  bool moe_route_all = false;
  int64_t moe_min_tokens = -1;  // -1: the model's hidden size; 0: no minimum
};

// The device block forward's arithmetic a recipe asks for (CalibrationSpec::precision).
kernels::BlockForwardPrecision ForwardPrecision(const CalibrationSpec& spec);

// The same rule for a block task that holds every calibration input of its block itself (a
// sequential method's: QuaRot's block l calibrates on the outputs of the quantized blocks before
// it): which of MoE block `layer`'s experts calibrate on every token of x [seqs, seq, hidden]
// (BlockHessians::route_all). spec.moe_route_all: every expert; else, unless moe_min_tokens is 0,
// the experts the router sends fewer than moe_min_tokens of x's tokens (-1: the hidden size),
// each logged as a warning naming the block and the expert. Empty for a dense block or no rule.
// The counts are exact integers, so the flags do not depend on batching.
StatusOr<std::vector<bool>> ExpertsOnEveryToken(model::DecoderBlock& block, const at::Tensor& x,
                                                const model::Rope& rope, int64_t batch,
                                                const CalibrationSpec& spec, int64_t layer);

struct CalibrationResult {
  std::vector<BlockHessians> hessians;  // one per block when kept (the reduced totals)
  int64_t tokens = 0;                   // calibration tokens per Hessian (all ranks)
  bool from_cache = false;              // Hessians reused from dirs.hessians
  bool activations_from_cache = false;  // activations reused from dirs.activations
  double seconds = 0;
  // Where the walk's seconds went on this rank: reading the float blocks, the forward passes
  // with the Hessian products summed on the way, the reduction over the ranks, writing the
  // Hessian and activation files (rank 0 writes the Hessians; every rank its activation rows).
  double read_seconds = 0;
  double forward_seconds = 0;
  double reduce_seconds = 0;
  double save_seconds = 0;
  // MoE blocks walked here or kept from the cache (keep_hessians): the calibration tokens the
  // router sent each expert (all ranks); the experts the starved-expert rule calibrated on every
  // token (walked blocks).
  std::map<int64_t, std::vector<int64_t>> expert_tokens;
  std::map<int64_t, std::vector<int64_t>> starved_experts;
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
StatusOr<CalibrationResult> Calibrate(comm::Comm& comm, model::ModelSource& source,
                                      const at::Tensor& tokens, const CalibrationDirs& dirs,
                                      const std::string& key, const CalibrationOptions& options,
                                      const std::function<void(int64_t, int64_t)>& progress =
                                          nullptr);

}  // namespace qcal::calib
