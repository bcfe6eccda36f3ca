// The calibration products cached in the job directory: their keys, file names and checksums,
// and their files.
//
// Files (in the directories the job driver gives, CalibrationDirs: runner/job_dir.h names them
// JOB/hessians, JOB/activations, JOB/spill): HESSIANS/block_<l>.safetensors, per kind "<kind>.fixed" (I64 [n(n+1)/2, 2]:
// the exact int128 sums T as little-endian (low, high) words), "<kind>.dim" (I64, n) and
// "<kind>.count" (I64), metadata calibration_key and hessian_format "3"; a mixture-of-experts
// block's file also holds "experts.routed_tokens" and "experts.route_all" (I64 [E]) and each
// routed expert's sums as "experts.<e>.gate_up.{fixed,dim,count}" and "experts.<e>.down.*"
// (hessian.h ExpertHessians; a dense block's file is unchanged). Files of older formats
// ("2" also held an fp64 copy of the sums, doubling the file; without hessian_format: fp64
// sums only) are treated as stale and recomputed. ACTIVATIONS/block_<l>.safetensors:
// tensor "hidden" [N, S, hidden] F32 = the float model's input of block l (l = num_blocks: the
// last block's output), all N sequences in order, metadata calibration_key. Rank 0 writes the
// Hessian files (with sharded Hessians every rank writes its band of each triangle in place, and
// the bytes are the same); every rank writes its own rows of the activation files
// (SharedSafetensorsFile); all read them from the shared job directory when they need them.
// Activations above the memory budget are spilled to SPILL/calibration-rank<r>.f32.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/hf_config.h"
#include "common/recipe.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "engine/calib/hessian.h"
#include "engine/comm/comm.h"

namespace qcal::calib {

// A stable key for cached calibration products: the job's inputs key (runner/input_fingerprint.h:
// the model's and the data's content, the recipe, the job format), the config and the sampling
// settings. Products with another key are recomputed, never reused.
std::string CalibrationKey(const std::string& inputs_key, const LlamaConfig& config,
                           const CalibrationSpec& spec, int64_t seq_len);

// Where the calibration products go: directories on the shared filesystem, named by the caller
// (the engine names the files inside them, never the directories).
struct CalibrationDirs {
  std::string hessians;     // block_<l>.safetensors (+ checksums)
  std::string activations;  // block_<l>.safetensors (+ checksums)
  std::string spill;        // calibration-rank<r>.f32 above the memory budget
};

// HESSIANS/block_<block>.safetensors.
std::string HessianPath(const std::string& hessian_dir, int64_t block);
// Every cache file (Hessians, activations) has a checksum beside it, "<file>.fnv1a64" (the hex
// FNV-1a 64 of its bytes), written after the file and verified before any reuse: a missing
// checksum is FailedPrecondition, a mismatch DataLoss naming the file; the calibration phase
// then recomputes the caches instead of using them.
std::string CacheChecksumPath(const std::string& path);
Status WriteCacheChecksum(const std::string& path);
Status VerifyCacheChecksum(const std::string& path);
// ACTIVATIONS/block_<boundary>.safetensors.
std::string ActivationPath(const std::string& activation_dir, int64_t boundary);

// Saves / loads one block's Hessians (exact sums + counts) at `path` (HessianPath).
Status SaveBlockHessians(const std::string& path, const BlockHessians& h, const std::string& key);
// NotFound when absent; FailedPrecondition when present with another key or in the old format
// (stale cache); DataLoss when malformed. mapped: the sums are not read into the accumulators;
// the file stays mapped (BlockHessians::stored) and each kind's mean is made from it when asked
// for (BlockHessians::Mean, HessianMeans), so a block task holds one kind's fp64 mean at a time
// and never its exact sums (6.6 GB at a 70B down_proj) beside it.
StatusOr<BlockHessians> LoadBlockHessians(const std::string& path, const std::string& key,
                                          bool mapped = false);

// One boundary's activations [N, S, hidden] F32. NotFound when absent, FailedPrecondition for
// another calibration key, DataLoss when malformed or of another shape.
StatusOr<at::Tensor> LoadActivation(const std::string& path, const std::string& key,
                                    const std::vector<int64_t>& shape);
Status SaveActivation(const std::string& path, const at::Tensor& hidden, const std::string& key);

// A safetensors file filled in place by every rank, so that no rank holds what the others
// write: rank 0 creates "<path>.partial" with the header of `layout` (whose tensors are all
// Reserve()d) and the full size; every rank writes its parts of the tensors at their offsets
// (Write); Finish renames the file once every rank has synced, and writes its checksum. The bytes
// equal SafetensorsWriter::Write's for the same tensors. Collective: Begin and Finish on every
// rank at the same point. Used for the activation files (each rank its sequences' rows) and for
// sharded Hessians (each rank its band of each triangle).
class SharedSafetensorsFile {
 public:
  static StatusOr<std::unique_ptr<SharedSafetensorsFile>> Begin(comm::Comm& comm,
                                                                const std::string& path,
                                                                SafetensorsWriter layout);
  ~SharedSafetensorsFile();
  SharedSafetensorsFile(const SharedSafetensorsFile&) = delete;
  SharedSafetensorsFile& operator=(const SharedSafetensorsFile&) = delete;

  // `bytes` bytes at byte `offset` of tensor `name`'s data.
  Status Write(const std::string& name, uint64_t offset, const void* data, size_t bytes);
  Status Finish(comm::Comm& comm);

 private:
  SharedSafetensorsFile() = default;
  std::string path_, partial_;
  SafetensorsWriter layout_;
  int64_t data_offset_ = 0;
  int fd_ = -1;
};

// Whether a usable activation cache file is at `path` (its key, checksum and shape): NotFound
// when absent, FailedPrecondition for another calibration key, DataLoss when malformed.
Status CheckActivationCache(const std::string& path, const std::string& key,
                            const std::vector<int64_t>& shape);

// One boundary's activation file: every rank writes its own sequences' rows. Collective.
StatusOr<std::unique_ptr<SharedSafetensorsFile>> BeginActivationFile(
    comm::Comm& comm, const std::string& path, const std::string& key,
    const std::vector<int64_t>& shape);

// Sequences [first, first + x.size(0)) of an activation file [N, S, hidden].
Status WriteActivationRows(SharedSafetensorsFile& file, int64_t first, const at::Tensor& x);

// Writes a block's Hessians whose sums are spread over the ranks, in place: each dense kind as
// bands (sharded calibration: every rank writes its band, rank 0 the dimension and count) or
// whole (the same on every rank after a reduction: rank 0 writes it); in a MoE block each
// expert's sums whole on the one rank that holds them (dimension > 0; expert-parallel
// calibration), and rank 0's routed tokens and route-all flags. The file's bytes equal
// SaveBlockHessians's for the whole sums. InvalidArgument when an expert is held by no rank or
// by several. Collective.
Status SaveShardedBlockHessians(comm::Comm& comm, const std::string& path,
                                const BlockHessians& h, const std::string& key);

}  // namespace qcal::calib
