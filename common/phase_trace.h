// Where a job's and a task's time and memory go: named phases, in order, each with its wall
// seconds and the process's peak resident memory while it ran. `qcal quantize --json`, the
// service's block results (v1::BlockResult.phases) and the benchmarks report them.
//
// Peak memory is the kernel's high-water mark of the process's resident set (Linux VmHWM in
// /proc/self/status), reset when a phase begins or ends (/proc/self/clear_refs "5"). Phases nest
// (a job's "quantize" holds each block's "read weights", "quantize", "write") and traces may be
// open on several threads (threads-as-ranks tests): every Begin and End reads the mark into every
// open phase of the process before it resets it, so a phase's peak is the largest resident size
// the process reached while it was open. Where the kernel offers no mark (not Linux), the peak is
// -1; where it cannot be reset, a phase's peak is the process's since it started.
//
// Device memory works the same way when the device layer installs a probe (SetDevicePeakProbe:
// kernels' GPU backend does when a job selects a device): every Begin and End takes the device's
// high-water mark since the probe's last call into every open phase. Without a probe a phase's
// device peak is -1.
//
// Thread-safe; a PhaseTrace itself is used by one thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "proto/job.pb.h"

namespace qcal {

// The process's resident high-water mark in bytes (-1 when unknown).
int64_t ResidentPeakBytes();

// The device's memory high-water mark in bytes since the probe's previous call (the first call:
// since the probe started), -1 when unknown; each call starts a new mark from the memory in use
// now. Called with the process's phase lock held, from any thread.
using DevicePeakProbe = std::function<int64_t()>;
// Installs the process's device probe (nullptr: none) and returns the previous one. Installing a
// probe takes the previous probe's mark first, so no phase loses a peak.
DevicePeakProbe SetDevicePeakProbe(DevicePeakProbe probe);

// Appends a part of phase `parent` measured inside it, named "<parent>/<part>" ("quantize/factor":
// a sum over the block's linears): its seconds, no peaks of its own (-1; the parent's cover it).
// Nothing when seconds <= 0.
void AppendPhasePart(google::protobuf::RepeatedPtrField<v1::PhaseTiming>* out,
                     const std::string& parent, const std::string& part, double seconds);

class PhaseTrace {
 public:
  PhaseTrace() = default;
  ~PhaseTrace();
  PhaseTrace(const PhaseTrace&) = delete;
  PhaseTrace& operator=(const PhaseTrace&) = delete;

  // Ends this trace's running phase, if any, and starts `name`.
  void Begin(const std::string& name);
  // Ends the running phase (nothing when none runs).
  void End();

  // The finished phases, in order (End first to include the running one).
  const std::vector<v1::PhaseTiming>& phases() const { return phases_; }
  // Appends them to a proto's repeated field (BlockResult.phases, ...).
  void AppendTo(google::protobuf::RepeatedPtrField<v1::PhaseTiming>* out) const;

 private:
  std::vector<v1::PhaseTiming> phases_;
  bool running_ = false;
  std::chrono::steady_clock::time_point started_;
  int64_t open_id_ = 0;  // the running phase's entry in the process's open phases
};

}  // namespace qcal
