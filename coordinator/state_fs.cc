#include "coordinator/state_fs.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/atomic_file.h"

namespace qcal::coordinator {
namespace {

class LocalStateFs : public StateFs {
 public:
  Status MakeDirs(const std::string& path) override { return qcal::MakeDirs(path); }
  Status WriteFileAtomic(const std::string& path, const std::string& contents) override {
    return qcal::WriteFileAtomic(path, contents);
  }
  StatusOr<std::string> ReadFile(const std::string& path) override {
    return qcal::ReadFile(path);
  }
  StatusOr<std::vector<std::string>> ListFiles(const std::string& dir) override {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) {
      const int err = errno;
      std::string what = absl::StrCat(dir, ": cannot list directory: ", std::strerror(err));
      return err == ENOENT ? absl::NotFoundError(what) : absl::UnavailableError(what);
    }
    std::vector<std::string> names;
    while (struct dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      struct stat st;
      if (::stat((dir + "/" + name).c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
        names.push_back(name);
      }
    }
    ::closedir(d);
    std::sort(names.begin(), names.end());
    return names;
  }
};

}  // namespace

std::unique_ptr<StateFs> MakeLocalStateFs() { return std::make_unique<LocalStateFs>(); }

}  // namespace qcal::coordinator
