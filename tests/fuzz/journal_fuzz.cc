// libFuzzer entry point for the job journal (journal.jsonl: one JSON object per line, the last
// possibly torn): any bytes open as a journal or give an error status; every entry that opens is
// then read back as a block result and checked as a block_done entry against an empty
// output directory, without a crash, an uncaught exception or UB.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "runner/journal.h"
#include "tests/fuzz/fuzz_util.h"

using qcal::fuzz::Check;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = qcal::fuzz::WriteInput("journal", data, size);
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
