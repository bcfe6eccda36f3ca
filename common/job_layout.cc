#include "common/job_layout.h"

#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <limits>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <set>
#include <tuple>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/hash.h"
#include "common/io_util.h"
#include "common/log.h"

namespace qcal {
namespace {

std::string RealPath(const std::string& p) {
  char buf[PATH_MAX];
  return ::realpath(p.c_str(), buf) ? std::string(buf) : p;
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// Fills the journal-derived fields of *plan (config, num_blocks and job_dir already set). The
// last block_done per layer counts; the last e2e_done counts only if no block_done follows it
// (a redone block invalidates the end-to-end stage).
Status EvaluateJournal(const Recipe& recipe, const std::string& out_dir,
                       const std::vector<nlohmann::json>& entries, const std::string& journal_path,
                       JobPlan* plan, bool report = true) {
  const int64_t blocks = plan->num_blocks;
  std::map<int64_t, nlohmann::json> done;
  nlohmann::json e2e_done;
  // Finished work counts only under a job_start of the same inputs (model, data, recipe, format):
  // a job directory reused for another model must not hand its blocks to this one.
  bool same_inputs = false, same_out = true;
  nlohmann::json other_inputs;
  int64_t stale = 0, elsewhere = 0;
  std::set<int64_t> other_out;  // layers whose last block_done was written into another output
  const std::string out_real = RealPath(out_dir);
  for (const auto& e : entries) {
    const std::string event = e.value("event", "");
    if (event == "job_start" && e.value("recipe_hash", "") != plan->recipe_hash) {
      return absl::FailedPreconditionError(absl::StrCat(
          journal_path, " belongs to another recipe ('", e.value("recipe", std::string("?")),
          "'); give this recipe another --out, or replace that recipe's output with a fresh "
          "--job-dir and --overwrite"));
    }
    if (event == "job_start") {
      same_inputs = e.value("inputs_key", "") == plan->inputs.key;
      if (!same_inputs) other_inputs = e.contains("inputs") ? e["inputs"] : nlohmann::json();
      // Older journals name no output directory: their blocks are checked against this one.
      same_out = !e.contains("out") || e.value("out", "") == out_real;
      continue;
    }
    if ((event == "block_done" || event == "e2e_done") && !same_inputs) {
      stale += event == "block_done" ? 1 : 0;
      continue;
    }
    if (event == "block_done") {
      // A block another run wrote into another output still counts when this output holds the
      // same bytes (a moved output directory), but its absence here is no news.
      const int64_t layer = e.value("layer", int64_t{-1});
      if (same_out) {
        other_out.erase(layer);
      } else {
        other_out.insert(layer);
      }
      done[layer] = e;
      e2e_done = nlohmann::json();
    }
    if (event == "e2e_done") e2e_done = e;
  }
  plan->stale_blocks = stale;
  if (stale > 0 && report) {
    std::string note = absl::StrCat(
        journal_path, ": ", stale, " finished block(s) were computed from other inputs (",
        DescribeInputsChange(other_inputs, plan->inputs),
        "); they are redone, and calibration products of those inputs are recomputed");
    QCAL_LOG_WARN("{}", note);
    plan->notes.push_back(std::move(note));
  }
  plan->e2e_enabled = recipe.finetune.end_to_end.enabled;
  plan->e2e_finished = false;
  plan->e2e_done = nlohmann::json();
  plan->block_finished.assign(blocks, false);
  plan->block_done.clear();
  if (plan->e2e_enabled && e2e_done.is_object()) {
    // Every shard was rewritten by the end-to-end stage; its checksums are the ones to match.
    bool ok = e2e_done.contains("checksums") && e2e_done["checksums"].is_object() &&
              e2e_done["checksums"].size() == static_cast<size_t>(blocks + 1);
    for (int64_t shard = 0; shard <= blocks && ok; ++shard) {
      const std::string name = ShardName(shard, blocks);
      auto sum = FileChecksum(out_dir + "/" + name);
      ok = sum.ok() && e2e_done["checksums"].value(name, "") == *sum;
    }
    for (int64_t l = 0; l < blocks && ok; ++l) ok = done.count(l) > 0;
    if (ok) {
      plan->e2e_finished = true;
      plan->e2e_done = e2e_done;
      plan->block_finished.assign(blocks, true);
      for (int64_t l = 0; l < blocks; ++l) plan->block_done[l] = done[l];
      return absl::OkStatus();
    }
    QCAL_LOG_WARN("journal says end-to-end fine-tuning is done but a shard is missing or "
                  "changed; redoing every block and the end-to-end stage");
    return absl::OkStatus();
  }
  for (const auto& [layer, e] : done) {
    if (layer < 0 || layer >= blocks) continue;
    plan->block_finished[layer] = CheckBlockDoneEntry(e, out_dir, blocks).ok();
    if (plan->block_finished[layer]) {
      plan->block_done[layer] = e;
    } else if (other_out.count(layer)) {
      ++elsewhere;
    } else {
      QCAL_LOG_WARN("block {}: journal says done but its shard is missing or changed; redoing",
                    layer);
    }
  }
  if (elsewhere > 0 && report) {
    QCAL_LOG_INFO("{}: {} block(s) were journaled by a run into another output directory and "
                  "are not in {}; they are done here too", journal_path, elsewhere, out_dir);
  }
  if (recipe.needs().sequential) {
    // Block l was calibrated on the outputs of blocks < l as quantized: a block redone
    // invalidates every later one.
    for (int64_t l = 0; l < blocks; ++l) {
      if (plan->block_finished[l]) continue;
      for (int64_t later = l + 1; later < blocks; ++later) {
        if (!plan->block_finished[later]) continue;
        QCAL_LOG_WARN("block {}: redone because block {} is (sequential calibration)", later, l);
        plan->block_finished[later] = false;
        plan->block_done.erase(later);
      }
      break;
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string ShardName(int64_t shard, int64_t num_blocks) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05lld-of-%05lld.safetensors",
                static_cast<long long>(shard), static_cast<long long>(num_blocks));
  return buf;
}

// ---- Staged output files

std::string JobDirLockPath(const std::string& job_dir) { return job_dir + "/lock"; }

StatusOr<JobDirLock> JobDirLock::Acquire(const std::string& job_dir, const std::string& holder) {
  QCAL_RETURN_IF_ERROR(MakeDirs(job_dir));
  const std::string path = JobDirLockPath(job_dir);
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
  return any_file(job_dir, {"journal.jsonl", "lock", "inputs.json"}) ||
         any_file(out_dir, {".staging"});
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

// ---- Results <-> journal entries

namespace {

nlohmann::json FiniteOrNull(double v) {
  return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json();
}

double NumberOrNan(const nlohmann::json& e, const char* key) {
  return e.contains(key) && e[key].is_number() ? e[key].get<double>() : std::nan("");
}

}  // namespace

nlohmann::json BlockDoneEntry(const v1::BlockResult& r) {
  nlohmann::json metrics = nlohmann::json::array();
  for (const v1::LinearMetrics& m : r.metrics()) {
    metrics.push_back({{"name", m.name()},
                       {"proxy_loss", FiniteOrNull(m.proxy_loss())},
                       {"relative", FiniteOrNull(m.relative())},
                       {"code_bits", m.code_bits()},
                       {"stored_bits", m.stored_bits()},
                       {"seconds", m.seconds()}});
  }
  nlohmann::json e = {{"event", "block_done"},
                      {"layer", r.layer()},
                      {"shard", r.shard().name()},
                      {"bytes", r.shard().bytes()},
                      {"checksum", r.shard().checksum()},
                      {"seconds", r.seconds()},
                      {"mse_before_ft", FiniteOrNull(r.mse_before_ft())},
                      {"mse_after_ft", FiniteOrNull(r.mse_after_ft())},
                      {"metrics", metrics}};
  if (r.also_wrote_size() > 0) {
    nlohmann::json also = nlohmann::json::object();
    for (const v1::WrittenFile& f : r.also_wrote()) also[f.name()] = f.checksum();
    e["also_wrote"] = also;
  }
  e["rank"] = r.rank();
  if (r.ft_curves_size() > 0) {
    nlohmann::json curves = nlohmann::json::array();
    for (const v1::FinetuneCurve& c : r.ft_curves()) {
      nlohmann::json heldout = nlohmann::json::array(), train = nlohmann::json::array();
      for (double v : c.heldout()) heldout.push_back(FiniteOrNull(v));
      for (double v : c.train()) train.push_back(FiniteOrNull(v));
      curves.push_back({{"heldout", heldout}, {"train", train}});
    }
    e["ft_curves"] = curves;
  }
  if (r.phases_size() > 0) {
    nlohmann::json phases = nlohmann::json::array();
    for (const v1::PhaseTiming& p : r.phases()) {
      phases.push_back({{"name", p.name()},
                        {"seconds", p.seconds()},
                        {"peak_host_bytes", p.peak_host_bytes()},
                        {"peak_device_bytes", p.peak_device_bytes()}});
    }
    e["phases"] = phases;
  }
  return e;
}

v1::BlockResult BlockResultFromEntry(const nlohmann::json& e) {
  v1::BlockResult r;
  if (!e.is_object()) return r;
  r.set_layer(e.value("layer", int64_t{-1}));
  r.mutable_shard()->set_name(e.value("shard", ""));
  r.mutable_shard()->set_bytes(e.value("bytes", uint64_t{0}));
  r.mutable_shard()->set_checksum(e.value("checksum", ""));
  r.set_seconds(NumberOrNan(e, "seconds"));
  r.set_mse_before_ft(NumberOrNan(e, "mse_before_ft"));
  r.set_mse_after_ft(NumberOrNan(e, "mse_after_ft"));
  if (e.contains("rank") && e["rank"].is_number_integer()) r.set_rank(e["rank"].get<int32_t>());
  if (e.contains("ft_curves") && e["ft_curves"].is_array()) {
    for (const auto& j : e["ft_curves"]) {
      if (!j.is_object()) continue;
      v1::FinetuneCurve* c = r.add_ft_curves();
      for (const char* key : {"heldout", "train"}) {
        if (!j.contains(key) || !j[key].is_array()) continue;
        auto* values = std::string(key) == "heldout" ? c->mutable_heldout() : c->mutable_train();
        for (const auto& v : j[key]) {
          values->Add(v.is_number() ? v.get<double>() : std::numeric_limits<double>::quiet_NaN());
        }
      }
    }
  }
  if (e.contains("metrics") && e["metrics"].is_array()) {
    for (const auto& j : e["metrics"]) {
      if (!j.is_object()) continue;
      v1::LinearMetrics* m = r.add_metrics();
      m->set_name(j.value("name", ""));
      m->set_proxy_loss(NumberOrNan(j, "proxy_loss"));
      m->set_relative(NumberOrNan(j, "relative"));
      m->set_code_bits(j.value("code_bits", 0.0));
      m->set_stored_bits(j.value("stored_bits", 0.0));
      m->set_seconds(j.value("seconds", 0.0));
    }
  }
  if (e.contains("also_wrote") && e["also_wrote"].is_object()) {
    for (const auto& [name, sum] : e["also_wrote"].items()) {
      v1::WrittenFile* f = r.add_also_wrote();
      f->set_name(name);
      if (sum.is_string()) f->set_checksum(sum.get<std::string>());
    }
  }
  if (e.contains("phases") && e["phases"].is_array()) {
    for (const auto& j : e["phases"]) {
      if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) continue;
      v1::PhaseTiming* p = r.add_phases();
      p->set_name(j["name"].get<std::string>());
      p->set_seconds(NumberOrNan(j, "seconds"));
      const auto bytes = [&](const char* key) -> int64_t {
        return j.contains(key) && j[key].is_number_integer() ? j[key].get<int64_t>() : -1;
      };
      p->set_peak_host_bytes(bytes("peak_host_bytes"));
      p->set_peak_device_bytes(bytes("peak_device_bytes"));
    }
  }
  return r;
}

nlohmann::json E2eDoneEntry(const v1::FinetuneResult& r) {
  nlohmann::json checksums = nlohmann::json::object();
  for (const v1::WrittenFile& f : r.shards()) checksums[f.name()] = f.checksum();
  return {{"event", "e2e_done"},
          {"checksums", checksums},
          {"kl_before", FiniteOrNull(r.kl_before())},
          {"kl_after", FiniteOrNull(r.kl_after())},
          {"best_epoch", r.best_epoch()},
          {"head_tuned", r.head_tuned()},
          {"seconds", r.seconds()}};
}

std::vector<v1::WrittenFile> FilesOf(const v1::BlockResult& r) {
  std::vector<v1::WrittenFile> files = {r.shard()};
  files.insert(files.end(), r.also_wrote().begin(), r.also_wrote().end());
  return files;
}

Status CheckBlockResult(const v1::BlockResult& r, const std::string& out_dir,
                        int64_t num_blocks) {
  if (r.layer() < 0 || r.layer() >= num_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("block result names layer ", r.layer(), " of ", num_blocks));
  }
  const std::string shard = ShardName(r.layer() + 1, num_blocks);
  if (r.shard().name() != shard) {
    return absl::InvalidArgumentError(absl::StrCat("block result for layer ", r.layer(),
                                                   " names shard '", r.shard().name(),
                                                   "', expected ", shard));
  }
  return CheckStagedFiles(out_dir, FilesOf(r));
}

// ---- Journal

namespace {

// The types of the keys journal readers use, checked once when the journal is read so that no
// reader can meet a key of another type (nlohmann's value() throws on one): "" when the entry
// is well-formed, else what is wrong with it. Unknown keys are allowed (newer versions).
std::string JournalEntryProblem(const nlohmann::json& e) {
  using json = nlohmann::json;
  if (!e.is_object()) return "not a JSON object";
  if (!e.contains("event") || !e["event"].is_string()) return "no string 'event'";
  for (const char* key :
       {"recipe", "recipe_hash", "model", "out", "shard", "checksum", "inputs_key"}) {
    if (e.contains(key) && !e[key].is_string()) return absl::StrCat("'", key, "' is not a string");
  }
  if (e.contains("layer") && !e["layer"].is_number_integer()) return "'layer' is not an integer";
  if (e.contains("bytes") && !e["bytes"].is_number_unsigned()) {
    return "'bytes' is not a non-negative integer";
  }
  if (e.contains("best_epoch") && !e["best_epoch"].is_number_integer()) {
    return "'best_epoch' is not an integer";
  }
  if (e.contains("head_tuned") && !e["head_tuned"].is_boolean()) return "'head_tuned' is not a boolean";
  if (e.contains("seconds") && !e["seconds"].is_number()) return "'seconds' is not a number";
  for (const char* key : {"mse_before_ft", "mse_after_ft", "kl_before", "kl_after"}) {
    if (e.contains(key) && !e[key].is_number() && !e[key].is_null()) {
      return absl::StrCat("'", key, "' is not a number or null");
    }
  }
  for (const char* key : {"also_wrote", "checksums", "inputs"}) {
    if (!e.contains(key)) continue;
    if (!e[key].is_object()) return absl::StrCat("'", key, "' is not an object");
    for (const auto& [name, sum] : e[key].items()) {
      if (!sum.is_string()) return absl::StrCat("'", key, "' value for a file is not a string");
    }
  }
  if (e.contains("metrics")) {
    if (!e["metrics"].is_array()) return "'metrics' is not an array";
    for (const json& m : e["metrics"]) {
      if (!m.is_object()) return "a 'metrics' item is not an object";
      if (m.contains("name") && !m["name"].is_string()) return "a metric's 'name' is not a string";
      for (const char* key : {"proxy_loss", "relative"}) {
        if (m.contains(key) && !m[key].is_number() && !m[key].is_null()) {
          return absl::StrCat("a metric's '", key, "' is not a number or null");
        }
      }
      for (const char* key : {"code_bits", "stored_bits", "seconds"}) {
        if (m.contains(key) && !m[key].is_number()) {
          return absl::StrCat("a metric's '", key, "' is not a number");
        }
      }
    }
  }
  return "";
}

}  // namespace

StatusOr<Journal> Journal::Open(const std::string& path) {
  Journal j;
  j.path_ = path;
  std::ifstream in(path);
  std::string line;
  int64_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty()) continue;
    auto e = nlohmann::json::parse(line, nullptr, false);
    if (e.is_discarded() || !e.is_object()) {
      // A torn last line (crash mid-append) is ignored; anything else is corruption.
      if (in.peek() == EOF) break;
      return absl::DataLossError(absl::StrCat(path, ": line ", lineno, " is not JSON"));
    }
    const std::string problem = JournalEntryProblem(e);
    if (!problem.empty()) {
      return absl::DataLossError(
          absl::StrCat(path, ": line ", lineno, " is not a journal entry: ", problem));
    }
    j.entries_.push_back(std::move(e));
  }
  return j;
}

Status Journal::Append(const nlohmann::json& entry) {
  const std::string line = entry.dump() + "\n";
  QCAL_ASSIGN_OR_RETURN(const int fd, OpenNoFollow(path_, O_WRONLY | O_CREAT | O_APPEND, 0644,
                                                   "cannot open for append"));
  struct stat st;
  const off_t before = ::fstat(fd, &st) == 0 ? st.st_size : -1;
  const ssize_t n = ::write(fd, line.data(), line.size());
  const int error = n < 0 ? errno : (n != static_cast<ssize_t>(line.size()) ? ENOSPC : 0);
  const bool ok = error == 0 && ::fsync(fd) == 0;
  const int sync_error = ok || error != 0 ? error : errno;
  // A short append (full disk) leaves a torn line that the next Append would bury mid-file:
  // cut it off again, so the journal stays a sequence of whole entries.
  if (!ok && before >= 0) (void)::ftruncate(fd, before);
  ::close(fd);
  if (!ok) return io::ErrnoError(sync_error, path_, "cannot append to the journal");
  entries_.push_back(entry);
  return absl::OkStatus();
}

// ---- Plan

bool JobPlan::all_blocks_finished() const {
  for (bool f : block_finished) {
    if (!f) return false;
  }
  return true;
}

std::vector<int64_t> JobPlan::pending_blocks() const {
  std::vector<int64_t> out;
  for (int64_t l = 0; l < static_cast<int64_t>(block_finished.size()); ++l) {
    if (!block_finished[l]) out.push_back(l);
  }
  return out;
}

bool JobPlan::needs_calibration(const Recipe& recipe) const {
  const MethodNeeds needs = recipe.needs();
  const bool blocks_left = !all_blocks_finished();
  return ((needs.float_hessians || needs.float_activations || !needs.global_phases.empty()) &&
          blocks_left) ||
         (e2e_enabled && !e2e_finished);
}

namespace {

std::string Size(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return buf;
}

// Bytes free to this process on the filesystem holding `dir`; -1 when unknown.
int64_t FreeBytes(const std::string& dir) {
  struct statvfs vfs;
  if (::statvfs(dir.c_str(), &vfs) != 0) return -1;
  return static_cast<int64_t>(vfs.f_bavail) * static_cast<int64_t>(vfs.f_frsize);
}

}  // namespace

DiskNeed EstimateDiskNeed(const Recipe& recipe, const LlamaConfig& c) {
  const MethodNeeds needs = recipe.needs();
  const int64_t blocks = c.num_hidden_layers, h = c.hidden_size, ff = c.intermediate_size;
  const int64_t tokens = recipe.calibration.num_sequences *
                         std::min(recipe.calibration.seq_len, c.max_position_embeddings);
  DiskNeed d;
  std::vector<std::string> parts;
  if (needs.float_hessians) {
    // Per input: the exact int128 sums, 16 bytes per entry of the triangle (hessian_format 3).
    int64_t per_block = 0;
    for (int64_t n : {h, c.q_dim(), h, ff}) per_block += 8 * n * (n + 1);
    d.job_bytes += per_block * blocks;
    parts.push_back(absl::StrCat("Hessians ", Size(static_cast<double>(per_block)), " a block"));
  }
  const int64_t boundary = 4 * tokens * h;
  if (needs.float_activations) {
    d.job_bytes += boundary * (blocks + 1);
    parts.push_back(absl::StrCat("activations ", Size(static_cast<double>(boundary)),
                                 " a block boundary"));
  }
  if (needs.sequential) {
    d.job_bytes += boundary * 2 * (needs.sequential_float ? 2 : 1);
    parts.push_back(absl::StrCat("sequential inputs ", Size(static_cast<double>(boundary)),
                                 " a block"));
  }
  d.job_detail = parts.empty() ? "no calibration products" : absl::StrJoin(parts, ", ");
  const int64_t linear = h * c.q_dim() + 2 * h * c.kv_dim() + c.q_dim() * h + 3 * h * ff;
  const int64_t table = c.torch_dtype == "float32" ? 4 : 2;
  // Codes at the recipe's bits plus about a quarter bit of scales and norms; tables as stored.
  d.out_bytes = linear * blocks * (std::max(recipe.bits(), 1) * 4 + 1) / 32 +
                c.vocab_size * h * table * (c.tie_word_embeddings ? 1 : 2);
  return d;
}

StatusOr<JobPlan> PlanJob(const Recipe& recipe, const std::string& model_dir,
                          const std::string& out_dir, const std::string& job_dir,
                          const std::string& data_root) {
  JobPlan plan;
  QCAL_ASSIGN_OR_RETURN(plan.config, LoadLlamaConfig(model_dir));
  const std::string model_real = RealPath(model_dir);
  QCAL_RETURN_IF_ERROR(MakeDirs(out_dir));
  const std::string out_real = RealPath(out_dir);
  if (out_real == model_real || out_real.rfind(model_real + "/", 0) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("output directory ", out_dir,
                                                   " is inside the input model directory ",
                                                   model_dir));
  }
  plan.job_dir = job_dir.empty() ? out_dir + ".job" : job_dir;
  QCAL_RETURN_IF_ERROR(MakeDirs(plan.job_dir));
  QCAL_RETURN_IF_ERROR(MakeDirs(StagingDir(out_dir)));
  plan.num_blocks = plan.config.num_hidden_layers;
  plan.recipe_hash = RecipeHash(recipe);
  QCAL_ASSIGN_OR_RETURN(plan.inputs, FingerprintInputs(recipe, model_dir, data_root,
                                                       plan.job_dir + "/inputs.json"));
  const std::string journal_path = plan.job_dir + "/journal.jsonl";
  QCAL_ASSIGN_OR_RETURN(Journal journal, Journal::Open(journal_path));
  QCAL_RETURN_IF_ERROR(EvaluateJournal(recipe, out_dir, journal.entries(), journal_path, &plan));
  // A 70B job's Hessians alone are over a terabyte: say so before the disk fills mid-job.
  plan.disk = EstimateDiskNeed(recipe, plan.config);
  QCAL_LOG_INFO("disk: about {} to {} ({}), {} to {} (the quantized checkpoint)",
                Size(static_cast<double>(plan.disk.job_bytes)), plan.job_dir,
                plan.disk.job_detail, Size(static_cast<double>(plan.disk.out_bytes)), out_dir);
  std::vector<std::tuple<std::string, int64_t, std::string>> checks = {
      {plan.job_dir, plan.disk.job_bytes, plan.disk.job_detail},
      {out_dir, plan.disk.out_bytes, "the quantized checkpoint"}};
  struct stat job_st, out_st;
  if (::stat(plan.job_dir.c_str(), &job_st) == 0 && ::stat(out_dir.c_str(), &out_st) == 0 &&
      job_st.st_dev == out_st.st_dev) {
    checks = {{plan.job_dir, plan.disk.job_bytes + plan.disk.out_bytes,
               plan.disk.job_detail + ", and the quantized checkpoint in " + out_dir}};
  }
  for (const auto& [dir, need, what] : checks) {
    const int64_t free = FreeBytes(dir);
    if (free < 0 || need <= free) continue;
    std::string note = absl::StrCat(
        dir, ": this job writes about ", Size(static_cast<double>(need)), " here (", what,
        ") but ", Size(static_cast<double>(free)), " are free on its filesystem; it will stop "
        "when the disk is full (finished work is kept, and a rerun after freeing space resumes)");
    QCAL_LOG_WARN("{}", note);
    plan.notes.push_back(std::move(note));
  }
  return plan;
}

nlohmann::json JobStartEntry(const Recipe& recipe, const JobPlan& plan,
                             const std::string& model_dir, const std::string& out_dir) {
  return {{"event", "job_start"},
          {"recipe", recipe.name},
          {"recipe_hash", plan.recipe_hash},
          {"model", RealPath(model_dir)},
          {"out", RealPath(out_dir)},
          {"inputs_key", plan.inputs.key},
          {"inputs", plan.inputs.FilesJson()}};
}

// ---- Checkpoint files

StatusOr<std::vector<std::string>> WriteNonBlockShard(const std::string& path,
                                                      CheckpointReader& ckpt,
                                                      const LlamaConfig& config) {
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  std::vector<std::string> names = {"model.embed_tokens.weight", "model.norm.weight"};
  if (ckpt.Has("lm_head.weight")) names.push_back("lm_head.weight");
  for (const std::string& name : names) {
    // As stored (a bf16 128k-vocabulary table stays bf16), streamed from the source file.
    QCAL_ASSIGN_OR_RETURN(auto found, ckpt.Find(name));
    QCAL_RETURN_IF_ERROR(AddCopiedTensor(&writer, name, *found.first, *found.second));
  }
  QCAL_RETURN_IF_ERROR(writer.Write(path));
  return names;
}

nlohmann::json MakeQuantizationConfig(const Recipe& recipe, double code_bits,
                                      double stored_bits) {
  nlohmann::json q = {{"quant_method", "qcal"},
                      {"format_version", 1},
                      {"method", recipe.method},
                      {"bits", recipe.bits()},
                      {"bits_per_weight", {{"codes", code_bits}, {"stored", stored_bits}}},
                      {"modules_not_quantized", {"model.embed_tokens", "model.norm", "lm_head"}},
                      {"recipe", recipe.ToJson()}};
  if (recipe.config) recipe.config->AddToQuantizationConfig(&q);
  return q;
}

BitsPerWeight AggregateBits(const LlamaConfig& config,
                            const std::map<int64_t, nlohmann::json>& block_done) {
  // The seven linears of a block in the worker's order (model::kAllLinears) with their sizes.
  const int64_t h = config.hidden_size, ff = config.intermediate_size;
  const struct {
    const char* name;
    int64_t in, out;
  } linears[] = {{"self_attn.q_proj", h, config.q_dim()},  {"self_attn.k_proj", h, config.kv_dim()},
                 {"self_attn.v_proj", h, config.kv_dim()}, {"self_attn.o_proj", config.q_dim(), h},
                 {"mlp.gate_proj", h, ff},                 {"mlp.up_proj", h, ff},
                 {"mlp.down_proj", ff, h}};
  constexpr size_t kLinears = sizeof(linears) / sizeof(linears[0]);
  double code_sum = 0, stored_sum = 0, weights = 0;
  for (const auto& [layer, entry] : block_done) {
    if (!entry.contains("metrics") || !entry["metrics"].is_array()) continue;
    const nlohmann::json& metrics = entry["metrics"];
    for (size_t i = 0; i < metrics.size(); ++i) {
      const nlohmann::json& m = metrics[i];
      // By name; a metric without a known name falls back to its position.
      size_t k = i < kLinears ? i : kLinears;
      const std::string name = m.is_object() ? m.value("name", "") : "";
      for (size_t j = 0; j < kLinears; ++j) {
        if (name == linears[j].name) k = j;
      }
      if (k >= kLinears) continue;
      const double n = static_cast<double>(linears[k].in * linears[k].out);
      code_sum += m.value("code_bits", 0.0) * n;
      stored_sum += m.value("stored_bits", 0.0) * n;
      weights += n;
    }
  }
  BitsPerWeight bits;
  if (weights > 0) {
    bits.code_bits = code_sum / weights;
    bits.stored_bits = stored_sum / weights;
  }
  return bits;
}

Status WriteShardIndex(const std::string& out_dir, int64_t num_blocks,
                       const std::map<std::string, std::string>& checksums) {
  std::map<std::string, std::string> weight_map;
  uint64_t total = 0;
  for (int64_t shard = 0; shard <= num_blocks; ++shard) {
    const std::string name = ShardName(shard, num_blocks);
    QCAL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(out_dir + "/" + name));
    for (const TensorInfo& t : file->tensors()) {
      weight_map[t.name] = name;
      total += t.nbytes();
    }
  }
  return WriteCheckpointIndex(out_dir, weight_map, total, checksums);
}

StatusOr<std::string> FileChecksum(const std::string& path) {
  return FileFnv1aHex(path);
}

Status CheckBlockDoneEntry(const nlohmann::json& entry, const std::string& out_dir,
                           int64_t num_blocks) {
  if (!entry.is_object() || entry.value("event", "") != "block_done") {
    return absl::InvalidArgumentError("block result is not a block_done journal entry");
  }
  if (!entry.contains("layer") || !entry["layer"].is_number_integer()) {
    return absl::InvalidArgumentError("block_done entry has no integer 'layer'");
  }
  const int64_t layer = entry["layer"].get<int64_t>();
  if (layer < 0 || layer >= num_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_done entry names layer ", layer, " of ", num_blocks));
  }
  const std::string shard = ShardName(layer + 1, num_blocks);
  if (entry.value("shard", "") != shard) {
    return absl::InvalidArgumentError(absl::StrCat("block_done entry for layer ", layer,
                                                   " names shard '", entry.value("shard", ""),
                                                   "', expected ", shard));
  }
  const std::string path = out_dir + "/" + shard;
  QCAL_ASSIGN_OR_RETURN(std::string sum, FileChecksum(path));
  if (sum != entry.value("checksum", "")) {
    return absl::DataLossError(absl::StrCat(path, ": checksum ", sum,
                                            " does not match the block_done entry's ",
                                            entry.value("checksum", "")));
  }
  // Other shards the block task wrote (QuaRot's block 0 writes the rotated shard 0).
  if (entry.contains("also_wrote")) {
    const nlohmann::json& also = entry["also_wrote"];
    if (!also.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat("block_done entry for layer ", layer, ": 'also_wrote' is not an object"));
    }
    for (const auto& [name, want] : also.items()) {
      if (name.empty() || name.find('/') != std::string::npos || !want.is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "block_done entry for layer ", layer, ": bad 'also_wrote' item '", name, "'"));
      }
      const std::string other = out_dir + "/" + name;
      QCAL_ASSIGN_OR_RETURN(std::string other_sum, FileChecksum(other));
      if (other_sum != want.get<std::string>()) {
        return absl::DataLossError(absl::StrCat(other, ": checksum ", other_sum,
                                                " does not match block ", layer,
                                                "'s block_done entry's ",
                                                want.get<std::string>()));
      }
    }
  }
  return absl::OkStatus();
}

std::vector<std::string> CopyableRoots(const std::string& model_dir) {
  StatusOr<std::string> real = CanonicalPath(model_dir);
  if (!real.ok()) return {};
  std::vector<std::string> roots = {*real};
  // A Hugging Face cache snapshot (REPO/snapshots/REV) links its files to REPO/blobs/.
  const std::filesystem::path p(*real);
  if (p.parent_path().filename() == "snapshots") {
    roots.push_back(p.parent_path().parent_path().string());
  }
  return roots;
}

namespace {

// The tokenizer files `model_dir` has (a dangling link counts: copying it is refused by name).
std::vector<std::string> PresentTokenizerFiles(const std::string& model_dir) {
  std::vector<std::string> present;
  for (const char* f : {"tokenizer.model", "tokenizer_config.json", "generation_config.json",
                        "tokenizer.json", "special_tokens_map.json"}) {
    struct stat st;
    if (::lstat((model_dir + "/" + f).c_str(), &st) == 0 || errno != ENOENT) present.push_back(f);
  }
  return present;
}

}  // namespace

Status CheckTokenizerFilesCopyable(const std::string& model_dir) {
  const std::vector<std::string> roots = CopyableRoots(model_dir);
  for (const std::string& f : PresentTokenizerFiles(model_dir)) {
    StatusOr<std::string> resolved = ResolveForCopy(model_dir + "/" + f, roots);
    if (!resolved.ok()) return absl::InvalidArgumentError(resolved.status().message());
  }
  return absl::OkStatus();
}

Status CopyTokenizerFiles(const std::string& model_dir, const std::string& out_dir) {
  const std::vector<std::string> roots = CopyableRoots(model_dir);
  for (const std::string& f : PresentTokenizerFiles(model_dir)) {
    QCAL_ASSIGN_OR_RETURN(std::string bytes, ReadFileForCopy(model_dir + "/" + f, roots));
    QCAL_RETURN_IF_ERROR(WriteFileAtomic(out_dir + "/" + f, bytes));
  }
  return absl::OkStatus();
}

Status FinalizeCheckpoint(const std::string& out_dir, const std::string& model_dir,
                          const LlamaConfig& config, const nlohmann::json& quantization_config,
                          std::map<std::string, std::string> checksums) {
  for (int64_t shard = 0; shard <= config.num_hidden_layers; ++shard) {
    const std::string name = ShardName(shard, config.num_hidden_layers);
    if (checksums.count(name)) continue;
    QCAL_ASSIGN_OR_RETURN(checksums[name], FileFnv1aHex(out_dir + "/" + name));
  }
  QCAL_RETURN_IF_ERROR(WriteShardIndex(out_dir, config.num_hidden_layers, checksums));
  QCAL_RETURN_IF_ERROR(CopyTokenizerFiles(model_dir, out_dir));
  LlamaConfig out = config;
  out.raw["quantization_config"] = quantization_config;
  return WriteFileAtomic(out_dir + "/config.json", LlamaConfigToJson(out).dump(2) + "\n");
}

StatusOr<nlohmann::json> FinalizeJob(const Recipe& recipe, const std::string& model_dir,
                                     const std::string& out_dir, Journal* journal) {
  JobPlan plan;
  QCAL_ASSIGN_OR_RETURN(plan.config, LoadLlamaConfig(model_dir));
  plan.num_blocks = plan.config.num_hidden_layers;
  plan.recipe_hash = RecipeHash(recipe);
  // The finishing driver journaled the last job_start: its blocks are the ones of these inputs.
  for (const nlohmann::json& e : journal->entries()) {
    if (e.value("event", "") == "job_start") plan.inputs.key = e.value("inputs_key", "");
  }
  QCAL_RETURN_IF_ERROR(
      EvaluateJournal(recipe, out_dir, journal->entries(), journal->path(), &plan,
                      /*report=*/false));
  const std::vector<int64_t> pending = plan.pending_blocks();
  if (!pending.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        journal->path(), ": cannot finalize: block ", pending.front(), " (", pending.size(),
        " in all) has no block_done entry with an intact shard in ", out_dir));
  }
  if (plan.e2e_enabled && !plan.e2e_finished) {
    return absl::FailedPreconditionError(absl::StrCat(
        journal->path(), ": cannot finalize: end-to-end fine-tuning has no valid e2e_done entry"));
  }
  const BitsPerWeight bits = AggregateBits(plan.config, plan.block_done);
  const nlohmann::json quant_config = MakeQuantizationConfig(recipe, bits.code_bits,
                                                             bits.stored_bits);
  // With end-to-end fine-tuning shard 0 already holds the tuned final norm (and head); a method
  // that transforms the non-block weights had block 0's task write them (checked with block 0's
  // entry), with an untied head.
  const bool transformed = recipe.needs().transforms_non_block;
  LlamaConfig out_config = plan.config;
  if (transformed) out_config.tie_word_embeddings = false;
  if (!plan.e2e_enabled && !transformed) {
    QCAL_ASSIGN_OR_RETURN(auto float_ckpt, CheckpointReader::Open(model_dir));
    QCAL_RETURN_IF_ERROR(
        WriteNonBlockShard(out_dir + "/" + ShardName(0, plan.num_blocks), *float_ckpt,
                           plan.config)
            .status());
  }
  // The checksums the journal accepted (verified against the files by EvaluateJournal above)
  // go into the index; shard 0, when finalize wrote it just now, is checksummed from its file.
  std::map<std::string, std::string> checksums;
  for (const auto& [layer, entry] : plan.block_done) {
    checksums[entry.value("shard", "")] = entry.value("checksum", "");
    if (entry.contains("also_wrote") && entry["also_wrote"].is_object()) {
      for (const auto& [name, sum] : entry["also_wrote"].items()) {
        if (sum.is_string()) checksums[name] = sum.get<std::string>();
      }
    }
  }
  if (plan.e2e_finished) {
    for (const auto& [name, sum] : plan.e2e_done["checksums"].items()) {
      if (sum.is_string()) checksums[name] = sum.get<std::string>();
    }
  }
  if (!plan.e2e_enabled && !transformed) checksums.erase(ShardName(0, plan.num_blocks));
  QCAL_RETURN_IF_ERROR(
      FinalizeCheckpoint(out_dir, model_dir, out_config, quant_config, std::move(checksums)));
  QCAL_RETURN_IF_ERROR(RemoveStaging(out_dir));
  QCAL_RETURN_IF_ERROR(journal->Append({{"event", "job_done"}}));
  nlohmann::json summary = {{"out_dir", out_dir},
                            {"blocks", plan.num_blocks},
                            {"code_bits", bits.code_bits},
                            {"stored_bits", bits.stored_bits},
                            {"e2e", plan.e2e_enabled}};
  if (plan.e2e_finished) {
    summary["e2e_kl_before"] = plan.e2e_done.value("kl_before", nlohmann::json());
    summary["e2e_kl_after"] = plan.e2e_done.value("kl_after", nlohmann::json());
  }
  return summary;
}

}  // namespace qcal
