#include "common/phase_trace.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

namespace qcal {
namespace {

// The process's open phases (every trace's running one): id -> the largest marks read for it.
struct OpenPhases {
  std::mutex mu;
  std::map<int64_t, int64_t> peak;
  std::map<int64_t, int64_t> device_peak;
  DevicePeakProbe device_probe;
  int64_t next_id = 1;
};

OpenPhases& Open() {
  static OpenPhases* open = new OpenPhases();
  return *open;
}

int64_t ReadStatusKb(const char* key) {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  const size_t n = std::strlen(key);
  int64_t kb = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::strncmp(line, key, n) == 0 && line[n] == ':') {
      long long v = 0;
      if (std::sscanf(line + n + 1, "%lld", &v) == 1) kb = v;
      break;
    }
  }
  std::fclose(f);
  return kb;
}

// Resets the high-water mark to the current resident size; false when the kernel refuses.
bool ResetResidentPeak() {
  // raw-write: the kernel's own file, not a job's
  const int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, "5", 1) == 1;
  ::close(fd);
  return ok;
}

// Reads the marks into every open phase, then resets them. Under Open().mu.
void FoldAndReset(OpenPhases& open) {
  const int64_t mark = ResidentPeakBytes();
  for (auto& [id, peak] : open.peak) peak = std::max(peak, mark);
  ResetResidentPeak();
  if (open.device_probe) {
    const int64_t device_mark = open.device_probe();
    for (auto& [id, peak] : open.device_peak) peak = std::max(peak, device_mark);
  }
}

}  // namespace

int64_t ResidentPeakBytes() {
  const int64_t kb = ReadStatusKb("VmHWM");
  return kb < 0 ? -1 : kb * 1024;
}

DevicePeakProbe SetDevicePeakProbe(DevicePeakProbe probe) {
  OpenPhases& open = Open();
  std::lock_guard<std::mutex> lock(open.mu);
  FoldAndReset(open);
  std::swap(open.device_probe, probe);
  return probe;
}

PhaseTrace::~PhaseTrace() { End(); }

void PhaseTrace::Begin(const std::string& name) {
  End();
  OpenPhases& open = Open();
  {
    std::lock_guard<std::mutex> lock(open.mu);
    FoldAndReset(open);
    open_id_ = open.next_id++;
    open.peak[open_id_] = ResidentPeakBytes();  // the resident size now, after the reset
    // The device's use now, after the fold (-1 without a probe).
    open.device_peak[open_id_] = open.device_probe ? open.device_probe() : -1;
  }
  v1::PhaseTiming t;
  t.set_name(name);
  t.set_peak_device_bytes(-1);
  phases_.push_back(std::move(t));
  running_ = true;
  started_ = std::chrono::steady_clock::now();
}

void PhaseTrace::End() {
  if (!running_) return;
  running_ = false;
  v1::PhaseTiming& t = phases_.back();
  t.set_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
  OpenPhases& open = Open();
  std::lock_guard<std::mutex> lock(open.mu);
  FoldAndReset(open);
  auto it = open.peak.find(open_id_);
  t.set_peak_host_bytes(it == open.peak.end() ? -1 : it->second);
  if (it != open.peak.end()) open.peak.erase(it);
  auto dev = open.device_peak.find(open_id_);
  t.set_peak_device_bytes(dev == open.device_peak.end() ? -1 : dev->second);
  if (dev != open.device_peak.end()) open.device_peak.erase(dev);
}

void PhaseTrace::AppendTo(google::protobuf::RepeatedPtrField<v1::PhaseTiming>* out) const {
  for (const v1::PhaseTiming& t : phases_) *out->Add() = t;
}

void AppendPhasePart(google::protobuf::RepeatedPtrField<v1::PhaseTiming>* out,
                     const std::string& parent, const std::string& part, double seconds) {
  if (!(seconds > 0)) return;
  v1::PhaseTiming* p = out->Add();
  p->set_name(parent + "/" + part);
  p->set_seconds(seconds);
  p->set_peak_host_bytes(-1);
  p->set_peak_device_bytes(-1);
}

}  // namespace qcal
