// Activations a rank walks block by block (calibration, evaluation), held in memory up to a
// budget and spilled to a file in the job directory above it, so a worker's memory is bounded by
// one block and one chunk of activations whatever the size of the calibration set or the model.
//
// The store holds a sequence of chunks (tensors of any shape, float32, fixed once written: a
// chunk may be rewritten in place with a tensor of the same shape, which is what a block-by-block
// walk does — chunk c's block-l outputs replace its block-l inputs). Whether it spills is decided
// up front from the total size of the chunks, so a walk never changes mode half-way.
//
// Not thread-safe; one store per rank.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/status.h"

namespace qcal::model {

class ActivationStore {
 public:
  // `shapes`: every chunk's shape. In memory when their total size is at most `budget_bytes`,
  // else in the file `spill_path` (created, truncated; removed by the destructor), whose
  // directory must exist. Errors name the file.
  static StatusOr<std::unique_ptr<ActivationStore>> Create(
      std::vector<std::vector<int64_t>> shapes, int64_t budget_bytes,
      const std::string& spill_path);
  ~ActivationStore();
  ActivationStore(const ActivationStore&) = delete;
  ActivationStore& operator=(const ActivationStore&) = delete;

  int64_t chunks() const { return static_cast<int64_t>(shapes_.size()); }
  bool spilled() const { return fd_ >= 0; }
  int64_t total_bytes() const { return total_bytes_; }
  // Chunk c (a copy when spilled; the held tensor otherwise). FailedPrecondition when it was
  // never written.
  StatusOr<at::Tensor> Get(int64_t c) const;
  // Writes chunk c (converted to contiguous float32 on the CPU); InvalidArgument for another
  // shape than declared.
  Status Put(int64_t c, const at::Tensor& x);

 private:
  ActivationStore() = default;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<int64_t> offsets_;  // byte offset of each chunk in the spill file
  std::vector<at::Tensor> held_;  // in memory
  std::vector<bool> written_;
  int64_t total_bytes_ = 0;
  std::string path_;
  int fd_ = -1;
};

// The default memory budget of one rank: half of the machine's physical memory divided among
// the ranks on this node (OMPI_COMM_WORLD_LOCAL_SIZE, SLURM_NTASKS_PER_NODE, else 1).
int64_t DefaultMaxMemory();

}  // namespace qcal::model
