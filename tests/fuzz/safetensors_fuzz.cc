// libFuzzer entry point for the safetensors parser: any byte string must give either a header
// that satisfies every documented invariant or an error status, never a crash, leak or UB.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/safetensors.h"

namespace {

// A parser bug that lets through a header breaking the contract is as bad as a crash: abort so
// the fuzzer records the input.
void Check(bool condition) {
  if (!condition) std::abort();
}

void CheckInvariants(const qcal::SafetensorsHeader& header, size_t size) {
  Check(header.data_offset >= 8 && header.data_offset <= size);
  const uint64_t data_size = size - header.data_offset;
  uint64_t covered = 0;
  for (const qcal::TensorInfo& info : header.tensors) {
    Check(info.begin == covered);  // sorted, contiguous, no overlap
    Check(info.begin <= info.end && info.end <= data_size);
    Check(info.name != "__metadata__");
    bool has_zero = false;
    for (int64_t dim : info.shape) {
      Check(dim >= 0);
      has_zero = has_zero || dim == 0;
    }
    uint64_t numel = 1;
    if (has_zero) {
      numel = 0;
    } else {
      for (int64_t dim : info.shape) {
        Check(!__builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel));
      }
    }
    Check(info.numel() >= 0 && static_cast<uint64_t>(info.numel()) == numel);
    uint64_t bytes = 0;
    Check(!__builtin_mul_overflow(numel, qcal::DTypeSize(info.dtype), &bytes));
    Check(bytes == info.nbytes());
    covered = info.end;
  }
  Check(covered == data_size);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto header = qcal::ParseSafetensors(data, size, "fuzz");
  if (header.ok()) {
    CheckInvariants(*header, size);
  } else {
    Check(!header.status().message().empty());
  }
  return 0;
}
