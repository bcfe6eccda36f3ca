#include "runner/job_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/io_util.h"
#include "common/log.h"
#include "common/safe_fs.h"

namespace qcal {
namespace {

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool IsFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

std::string DefaultJobDir(const std::string& out_dir) { return out_dir + ".job"; }

std::string JobDirFor(const std::string& job_dir, const std::string& out_dir) {
  return job_dir.empty() ? DefaultJobDir(out_dir) : job_dir;
}

JobPaths::JobPaths(const std::string& job_dir)
    : dir(job_dir),
      journal(job_dir + "/journal.jsonl"),
      lock(job_dir + "/lock"),
      inputs(job_dir + "/inputs.json"),
      hessians(job_dir + "/hessians"),
      activations(job_dir + "/activations"),
      phases(job_dir + "/phases"),
      sequential(job_dir + "/sequential"),
      spill(job_dir + "/spill"),
      report(job_dir + "/report.html"),
      workers_log(job_dir + "/workers.log"),
      workers_pid(job_dir + "/workers.pid") {}

std::string JobPaths::PhaseProducts(const std::string& phase) const {
  return absl::StrCat(phases, "/", phase, ".safetensors");
}

std::string JobPaths::SequentialInputs(int64_t layer) const {
  return absl::StrCat(sequential, "/inputs-", layer, ".safetensors");
}

std::string JobPaths::SequentialFloatInputs(int64_t layer) const {
  return absl::StrCat(sequential, "/float-inputs-", layer, ".safetensors");
}

StatusOr<FoundJob> FindJob(const std::string& dir) {
  if (IsFile(JobPaths(dir).journal)) return FoundJob{dir, ""};
  const JobPaths beside(DefaultJobDir(dir));
  if (IsFile(beside.journal)) return FoundJob{beside.dir, dir};
  return absl::InvalidArgumentError(absl::StrCat(
      dir, ": neither a job directory (no journal.jsonl) nor a job's output directory (no ",
      beside.journal, ")"));
}

Status CheckJobFinished(const std::string& out_dir) {
  if (Exists(out_dir + "/config.json")) return absl::OkStatus();
  if (!Exists(StagingDir(out_dir)) && !Exists(JobPaths(DefaultJobDir(out_dir)).journal)) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      out_dir, ": the quantization job writing it has not finished (no config.json yet); "
      "export it once the job has succeeded (qcal status, or rerun qcal quantize to resume)"));
}

StatusOr<JobDirLock> JobDirLock::Acquire(const std::string& job_dir, const std::string& holder) {
  QCAL_RETURN_IF_ERROR(MakeDirs(job_dir));
  const std::string path = JobPaths(job_dir).lock;
  QCAL_ASSIGN_OR_RETURN(const int fd, OpenNoFollow(path, O_RDWR | O_CREAT, 0644,
                                                   "open the job directory's lock"));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string who;
    char buf[1024];
    const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    if (n > 0) who = io::Printable(absl::string_view(buf, static_cast<size_t>(n)), 400);
    while (!who.empty() && (who.back() == '?' || who.back() == ' ')) who.pop_back();
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          job_dir, ": the job directory is in use by ", who.empty() ? "another qcal process" : who,
          "; wait for it to end, or choose another --job-dir (two runs never share one)"));
    }
    return io::ErrnoError(err, path, "lock the job directory");
  }
  char host[256] = "?";
  ::gethostname(host, sizeof(host) - 1);
  const std::time_t now = std::time(nullptr);
  char when[64];
  std::strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const std::string text =
      absl::StrCat(holder, " (pid ", ::getpid(), " on ", host, ", since ", when, ")\n");
  // Who holds it, for the message a second driver gets; the lock itself is the flock.
  if (::ftruncate(fd, 0) != 0 ||
      ::pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
    const int err = errno;
    ::close(fd);
    return io::ErrnoError(err, path, "write the job directory's lock holder");
  }
  return JobDirLock(fd);
}

JobDirLock& JobDirLock::operator=(JobDirLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) {
      (void)::ftruncate(fd_, 0);
      ::close(fd_);
    }
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

JobDirLock::~JobDirLock() {
  if (fd_ >= 0) {
    (void)::ftruncate(fd_, 0);  // still held: nobody else is writing it
    ::close(fd_);
  }
}

bool HoldsFinishedWork(const std::string& job_dir, const std::string& out_dir) {
  namespace fs = std::filesystem;
  auto any_file = [](const std::string& dir, const std::set<std::string>& ignored_top) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) return false;
    for (auto it = fs::recursive_directory_iterator(dir, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      const fs::path rel = it->path().lexically_relative(dir);
      const std::string top = rel.begin() == rel.end() ? "" : rel.begin()->string();
      if (ignored_top.count(top)) {
        if (it->is_directory(ec)) it.disable_recursion_pending();
        continue;
      }
      if (!it->is_directory(ec)) return true;
    }
    return static_cast<bool>(ec);  // unreadable: keep it
  };
  const JobPaths paths(job_dir);
  const auto name = [](const std::string& p) {
    return std::filesystem::path(p).filename().string();
  };
  return any_file(job_dir, {name(paths.journal), name(paths.lock), name(paths.inputs)}) ||
         any_file(out_dir, {name(StagingDir(out_dir))});
}

StatusOr<OutputDirLock> OutputDirLock::Acquire(const std::string& out_dir) {
  QCAL_ASSIGN_OR_RETURN(const int fd, OpenNoFollow(out_dir, O_RDONLY | O_DIRECTORY, 0,
                                                   "open the output directory"));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          out_dir, ": another qcal job is writing this output directory (it is locked); wait for "
          "it or choose another --out"));
    }
    return io::ErrnoError(err, out_dir, "lock the output directory");
  }
  return OutputDirLock(fd);
}

OutputDirLock& OutputDirLock::operator=(OutputDirLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

OutputDirLock::~OutputDirLock() {
  if (fd_ >= 0) ::close(fd_);
}

std::string StagingDir(const std::string& out_dir) { return out_dir + "/.staging"; }

std::string AttemptToken(const std::string& task_id) {
  std::string token;
  for (char c : task_id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '.';
    token.push_back(ok ? c : '_');
  }
  return token.empty() ? "local" : token;
}

namespace {

bool IsPlainName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

}  // namespace

StatusOr<v1::WrittenFile> WriteStagedFile(const std::string& out_dir, const std::string& name,
                                          const std::string& attempt,
                                          const SafetensorsWriter& writer) {
  const std::string dir = StagingDir(out_dir);
  if (!Exists(dir)) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, " does not exist: the job has ended (or was never planned); not writing ", name));
  }
  v1::WrittenFile file;
  file.set_name(name);
  file.set_staged(absl::StrCat(name, ".", AttemptToken(attempt)));
  const std::string path = dir + "/" + file.staged();
  QCAL_ASSIGN_OR_RETURN(std::string checksum, writer.WriteWithChecksum(path));
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return absl::InternalError(absl::StrCat(path, ": cannot stat what was just written"));
  }
  file.set_bytes(static_cast<uint64_t>(st.st_size));
  file.set_checksum(checksum);
  return file;
}

Status CheckStagedFiles(const std::string& out_dir, const std::vector<v1::WrittenFile>& files) {
  for (const v1::WrittenFile& f : files) {
    if (!IsPlainName(f.name()) || !IsPlainName(f.staged())) {
      return absl::InvalidArgumentError(absl::StrCat("written file '", f.name(), "' (staged as '",
                                                     f.staged(), "') is not a plain file name"));
    }
    const std::string path = StagingDir(out_dir) + "/" + f.staged();
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      return absl::DataLossError(absl::StrCat(path, ": missing (", std::strerror(errno), ")"));
    }
    if (static_cast<uint64_t>(st.st_size) != f.bytes()) {
      return absl::DataLossError(absl::StrCat(path, ": ", st.st_size, " bytes, the result says ",
                                              f.bytes()));
    }
  }
  return absl::OkStatus();
}

Status CommitFiles(const std::string& out_dir, const std::vector<v1::WrittenFile>& files) {
  QCAL_RETURN_IF_ERROR(CheckStagedFiles(out_dir, files));
  for (const v1::WrittenFile& f : files) {
    const std::string from = StagingDir(out_dir) + "/" + f.staged();
    const std::string to = out_dir + "/" + f.name();
    QCAL_RETURN_IF_ERROR(RenameNoFollow(from, to));
  }
  if (files.empty()) return absl::OkStatus();
  return SyncParentDir(out_dir + "/" + files.front().name());
}

Status RemoveStaging(const std::string& out_dir) {
  std::error_code ec;
  std::filesystem::remove_all(StagingDir(out_dir), ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat(StagingDir(out_dir), ": cannot remove: ", ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace qcal

namespace qcal {

namespace {
constexpr char kPartPrefix[] = ".qcal-part-";
constexpr char kPartSuffix[] = ".safetensors";
}  // namespace

std::string PartFileName(int64_t layer, int64_t begin, int64_t end) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%s%05lld-%05lld-%05lld%s", kPartPrefix,
                static_cast<long long>(layer), static_cast<long long>(begin),
                static_cast<long long>(end), kPartSuffix);
  return buf;
}

bool IsPartFileName(const std::string& name) {
  long long layer = 0, begin = 0, end = 0;
  int used = 0;
  if (name.rfind(kPartPrefix, 0) != 0) return false;
  if (std::sscanf(name.c_str() + sizeof(kPartPrefix) - 1, "%lld-%lld-%lld.safetensors%n", &layer,
                  &begin, &end, &used) != 3) {
    return false;
  }
  return name == PartFileName(layer, begin, end);
}

Status RemovePartFiles(const std::string& out_dir) {
  std::error_code ec;
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(out_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (IsPartFileName(name)) names.push_back(name);
  }
  if (ec) return absl::InternalError(absl::StrCat(out_dir, ": cannot list: ", ec.message()));
  for (const std::string& name : names) {
    if (::unlink((out_dir + "/" + name).c_str()) != 0 && errno != ENOENT) {
      return absl::InternalError(
          absl::StrCat(out_dir, "/", name, ": cannot remove: ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

}  // namespace qcal
