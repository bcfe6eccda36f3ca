// libFuzzer entry point for the job journal (journal.jsonl: one JSON object per line, the last
// possibly torn): any bytes open as a journal or give an error status; every entry that opens is
// then read back as a block result, an end-to-end result and a block_done check against an empty
// output directory, without a crash, an uncaught exception or UB.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/job_layout.h"

namespace {
void Check(bool condition) {
  if (!condition) std::abort();
}

std::string WriteInput(const uint8_t* data, size_t size) {
  static const std::string path = [] {
    const char* dir = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    return std::string(dir) + "/qcal-journal-fuzz-" + std::to_string(::getpid()) + ".jsonl";
  }();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = WriteInput(data, size);
  auto journal = qcal::Journal::Open(path);
  if (!journal.ok()) {
    Check(!journal.status().message().empty());
    return 0;
  }
  for (const nlohmann::json& entry : journal->entries()) {
    Check(entry.is_object());
    (void)qcal::BlockResultFromEntry(entry);
    const qcal::Status s = qcal::CheckBlockDoneEntry(entry, "/nonexistent-qcal-out", 8);
    Check(!s.ok());  // no shard exists there
    Check(!s.message().empty());
  }
  return 0;
}
