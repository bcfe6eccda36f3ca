#include "runner/budgets.h"

#include <algorithm>

#include "common/log.h"

namespace qcal::job {

namespace {

int64_t BlockParams(const LlamaConfig& c) {
  const int64_t h = c.hidden_size, ff = c.intermediate_size;
  return (c.q_dim() + 2 * c.kv_dim()) * h + h * c.q_dim() + 3 * h * ff;
}
int64_t HessianSumBytes(const LlamaConfig& c) {
  int64_t bytes = 0;
  for (int64_t n : {c.hidden_size, c.q_dim(), c.hidden_size, c.intermediate_size}) {
    bytes += n * (n + 1) / 2 * 16;
  }
  return bytes;
}
}  // namespace

int64_t BlockWorkingBytes(const LlamaConfig& c) {
  const int64_t ff = c.intermediate_size;
  return 2 * BlockParams(c) * 4 + HessianSumBytes(c) + ff * ff * (4 + 8);
}

StatusOr<bool> ShardHessians(comm::Comm& comm, const JobContext& ctx) {
  int64_t want = 0;
  const int64_t need = BlockParams(ctx.config) * 4 + HessianSumBytes(ctx.config);
  if (comm.size() > 1 && ctx.gpu == nullptr &&
      need > ctx.max_memory) {
    want = 1;
  }
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(&want, 1));
  if (want > 0) {
    QCAL_LOG_INFO("calibration: a block's fp32 weights and exact Hessian sums ({:.2f} GiB) exceed "
                  "this rank's memory budget ({:.2f} GiB): the {} ranks shard the sums by row "
                  "bands ({:.2f} GiB each) and gather each other's linear inputs",
                  need / 1073741824.0, ctx.max_memory / 1073741824.0, comm.size(),
                  HessianSumBytes(ctx.config) / static_cast<double>(comm.size()) / 1073741824.0);
  }
  return want > 0;
}

int64_t ActivationBudget(const JobContext& ctx) {
  return std::max<int64_t>(0, ctx.max_memory - BlockWorkingBytes(ctx.config));
}

}  // namespace qcal::job
