// The calibration's collectives over the ranks of a Comm: exact Hessian reductions (host and
// device), gathering every rank's captured inputs, and agreeing on success.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "engine/calib/hessian.h"
#include "engine/comm/comm.h"
#include "kernels/gpu_backend.h"

namespace qcal::calib {

// Sums every rank's accumulators (exactly: fixed-point digits through AllReduceSum(int64)); every
// rank ends with the total. The accumulators must have the same dimensions on every rank.
Status AllReduceHessians(comm::Comm& comm, BlockHessians* h);

// The same for sums still on the devices (h->device, ForwardCollectingHessians with
// flush_device = false): the counts and dimensions over `comm` (host), the sums on the devices
// through `device_sum` (NCCL), so only reduced sums ever come to the host. download: whether this
// rank then moves them into its accumulators (the rank that saves them, or one that keeps them);
// otherwise they are released and the accumulators are left as they were. *rows (when given):
// the reduced row count of the qkv input (the calibration tokens). A rank without sequences gets
// zero device sums first. Collective; every rank needs a GPU backend.
Status AllReduceDeviceHessians(comm::Comm& comm, const kernels::DeviceInt64Sum& device_sum,
                               bool download, BlockHessians* h, int64_t* rows = nullptr);

// Every rank learns whether every rank succeeded: the failing rank keeps its own error, the
// others get Aborted naming `what`. A collective: every rank must call it at the same point.
Status AgreeOk(comm::Comm& comm, const Status& local, const std::string& what);

// Every rank's captured inputs [s_r, seq, n] (fp32, contiguous) concatenated in rank order:
// [Σ s_r, seq, n] on every rank. Collective.
StatusOr<at::Tensor> GatherSequences(comm::Comm& comm, const at::Tensor& mine);

}  // namespace qcal::calib
