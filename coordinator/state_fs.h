// The coordinator's view of its state directory, behind an interface so the job store is
// testable against an in-memory fake (tests/coordinator/fakes.h) as well as the real disk.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace qcal::coordinator {

class StateFs {
 public:
  virtual ~StateFs() = default;
  // mkdir -p.
  virtual Status MakeDirs(const std::string& path) = 0;
  // Readers see the old or the new contents, never a mix (temp file, fsync, rename).
  virtual Status WriteFileAtomic(const std::string& path, const std::string& contents) = 0;
  // NotFound when absent; other errors name the path.
  virtual StatusOr<std::string> ReadFile(const std::string& path) = 0;
  // Names (not paths) of the regular files directly inside `dir`, sorted.
  virtual StatusOr<std::vector<std::string>> ListFiles(const std::string& dir) = 0;
};

// The local filesystem (common/atomic_file). Thread-safe.
std::unique_ptr<StateFs> MakeLocalStateFs();

}  // namespace qcal::coordinator
