#include "runner/input_fingerprint.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/hash.h"
#include "common/io_util.h"
#include "runner/job_inputs.h"
#include "common/log.h"

namespace qcal {
namespace {

using json = nlohmann::json;

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// What identifies a file's contents without reading them: an edit in place changes the change
// time (which no user can set back), a replacement the inode.
struct FileStamp {
  int64_t size = 0, mtime_ns = 0, ctime_ns = 0;
  uint64_t ino = 0, dev = 0;
  json ToJson() const {
    return {{"size", size}, {"mtime_ns", mtime_ns}, {"ctime_ns", ctime_ns}, {"ino", ino},
            {"dev", dev}};
  }
  bool Matches(const json& j) const {
    return j.is_object() && j.value("size", int64_t{-1}) == size &&
           j.value("mtime_ns", int64_t{-1}) == mtime_ns &&
           j.value("ctime_ns", int64_t{-1}) == ctime_ns && j.value("ino", uint64_t{0}) == ino &&
           j.value("dev", uint64_t{0}) == dev;
  }
};

StatusOr<FileStamp> Stamp(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return io::ErrnoError(errno, path, "cannot stat");
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  FileStamp s;
  s.size = st.st_size;
  s.mtime_ns = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  s.ctime_ns = int64_t{st.st_ctim.tv_sec} * 1000000000 + st.st_ctim.tv_nsec;
  s.ino = st.st_ino;
  s.dev = st.st_dev;
  return s;
}

json ReadCache(const std::string& path) {
  if (path.empty() || !Exists(path)) return json::object();
  auto text = ReadFile(path);
  if (!text.ok()) return json::object();
  json j = json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || j.value("format", 0) != 1 || !j.contains("files") ||
      !j["files"].is_object()) {
    QCAL_LOG_WARN("{}: not a file-hash cache; hashing the job's inputs again", path);
    return json::object();
  }
  return j["files"];
}

}  // namespace

json InputsFingerprint::FilesJson() const {
  json j = json::object();
  for (const auto& [label, hash] : files) j[label] = hash;
  return j;
}

std::string RecipeHash(const Recipe& recipe) {
  json j = recipe.ToJson();
  // calibration.precision fp32 is what every recipe meant before the key existed: left out of
  // the hash, so a job started by an earlier qcal resumes (its journal and caches keep their keys).
  if (j["calibration"].value("precision", "fp32") == "fp32") j["calibration"].erase("precision");
  return Fnv1aHex(j.dump());
}

StatusOr<std::string> FileContentHash(const std::string& path) {
  io::ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return io::ErrnoError(errno, path, "cannot open for reading");
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  std::vector<char> buffer(size_t{8} << 20);
  ContentHash hash;
  uint64_t total = 0;
  while (true) {
    const ssize_t n = ::read(fd.get(), buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::DataLossError(
          absl::StrCat(path, ": read failed after ", total, " bytes: ", io::ErrnoText(errno)));
    }
    if (n == 0) break;
    hash.Update(buffer.data(), static_cast<size_t>(n));
    // What was hashed need not stay in the page cache (a 70B model is larger than the RAM).
    ::posix_fadvise(fd.get(), static_cast<off_t>(total), n, POSIX_FADV_DONTNEED);
    total += static_cast<uint64_t>(n);
  }
  return Hex64(hash.Finish());
}

StatusOr<std::map<std::string, std::string>> ModelFiles(const std::string& model_dir) {
  std::map<std::string, std::string> files;  // label -> path
  auto add = [&](const std::string& name) {
    files["model/" + name] = model_dir + "/" + name;
  };
  add("config.json");
  const std::string index = model_dir + "/model.safetensors.index.json";
  if (Exists(index)) {
    add("model.safetensors.index.json");
    QCAL_ASSIGN_OR_RETURN(std::string text, ReadFile(index));
    json j = json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") ||
        !j["weight_map"].is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index, ": not a safetensors index (no weight_map object)"));
    }
    std::set<std::string> shards;
    for (const auto& [tensor, shard] : j["weight_map"].items()) {
      if (!shard.is_string() || shard.get<std::string>().empty() ||
          shard.get<std::string>().find('/') != std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat(
            index, ": weight_map entry for '", io::Printable(tensor), "' is not a file name"));
      }
      shards.insert(shard.get<std::string>());
    }
    for (const std::string& s : shards) add(s);
  } else {
    add("model.safetensors");
  }
  for (const char* name : {"tokenizer.model", "tokenizer.json", "tokenizer_config.json"}) {
    if (Exists(model_dir + "/" + name)) add(name);
  }
  return files;
}

StatusOr<InputsFingerprint> FingerprintInputs(const Recipe& recipe, const std::string& model_dir,
                                              const std::string& data_root,
                                              const std::string& cache_path) {
  QCAL_ASSIGN_OR_RETURN(auto paths, ModelFiles(model_dir));
  if (recipe.needs().reads_calibration_text()) {
    for (const std::string& f : recipe.calibration.files) {
      paths["data/" + f] = !f.empty() && f[0] == '/' ? f : data_root + "/" + f;
    }
  }
  const json cache = ReadCache(cache_path);
  struct Item {
    std::string label, path, real, hash;
    FileStamp stamp;
    bool hashed = false;
  };
  std::vector<Item> items;
  for (const auto& [label, path] : paths) {
    Item it;
    it.label = label;
    it.path = path;
    QCAL_ASSIGN_OR_RETURN(it.stamp, Stamp(path));
    char buf[PATH_MAX];
    it.real = ::realpath(path.c_str(), buf) ? std::string(buf) : path;
    if (cache.contains(it.real) && it.stamp.Matches(cache[it.real]) &&
        cache[it.real].value("hash", std::string()).size() == 16) {
      it.hash = cache[it.real]["hash"].get<std::string>();
    }
    items.push_back(std::move(it));
  }
  // Hash what the cache does not vouch for, a few files at a time (shards are read in parallel:
  // the disk, not one core, is the limit).
  std::vector<size_t> todo;
  uint64_t todo_bytes = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].hash.empty()) {
      todo.push_back(i);
      todo_bytes += static_cast<uint64_t>(items[i].stamp.size);
    }
  }
  if (todo_bytes > (uint64_t{1} << 30)) {
    QCAL_LOG_INFO("hashing the job's inputs: {} files, {:.1f} GiB (once; kept in {})", todo.size(),
                  static_cast<double>(todo_bytes) / (1 << 30), cache_path);
  }
  std::atomic<size_t> next{0};
  std::mutex mu;
  Status failed;
  auto work = [&] {
    for (size_t k = next++; k < todo.size(); k = next++) {
      Item& it = items[todo[k]];
      StatusOr<std::string> h = FileContentHash(it.path);
      std::lock_guard<std::mutex> lock(mu);
      if (!h.ok()) {
        if (failed.ok()) failed = h.status();
        continue;
      }
      it.hash = *h;
      it.hashed = true;
    }
  };
  const size_t threads =
      std::min<size_t>({todo.size(), 8, std::max(1u, std::thread::hardware_concurrency())});
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  if (!todo.empty()) work();
  for (auto& t : pool) t.join();
  QCAL_RETURN_IF_ERROR(failed);
  // A file changed while it was hashed gives a hash of neither version: check the stamps again.
  for (size_t i : todo) {
    QCAL_ASSIGN_OR_RETURN(FileStamp again, Stamp(items[i].path));
    if (!again.Matches(items[i].stamp.ToJson())) {
      return absl::FailedPreconditionError(absl::StrCat(
          items[i].path, ": changed while qcal was reading it; run again once it is written"));
    }
  }

  InputsFingerprint fp;
  fp.recipe_hash = RecipeHash(recipe);
  std::string canon = absl::StrCat("qcal-job-inputs|format=", kJobFormatVersion,
                                   "|recipe=", fp.recipe_hash);
  for (const Item& it : items) {
    fp.files[it.label] = it.hash;
    absl::StrAppend(&canon, "|", it.label, "=", it.hash);
  }
  fp.key = Fnv1aHex(canon);

  if (!todo.empty() && !cache_path.empty()) {
    json files = cache.is_object() ? cache : json::object();
    for (size_t i : todo) {
      json entry = items[i].stamp.ToJson();
      entry["hash"] = items[i].hash;
      files[items[i].real] = entry;
    }
    const Status saved = WriteFileAtomic(cache_path, json{{"format", 1}, {"files", files}}.dump(1));
    // Only a cache: a failure costs a rehash next time, never a wrong result.
    if (!saved.ok()) QCAL_LOG_WARN("{}", std::string(saved.message()));
  }
  return fp;
}

std::string DescribeInputsChange(const json& before, const InputsFingerprint& now) {
  std::vector<std::string> changes;
  if (before.is_object()) {
    for (const auto& [label, hash] : now.files) {
      if (!before.contains(label)) {
        changes.push_back(label + " added");
      } else if (!before[label].is_string() || before[label].get<std::string>() != hash) {
        changes.push_back(label + " changed");
      }
    }
    for (const auto& [label, hash] : before.items()) {
      if (!now.files.count(label)) changes.push_back(label + " removed");
    }
  } else {
    changes.push_back("the earlier run recorded no input hashes (an older qcal)");
  }
  if (changes.empty()) return "the recipe or qcal's job format changed";
  if (changes.size() > 4) {
    const size_t more = changes.size() - 3;
    changes.resize(3);
    changes.push_back(absl::StrCat("and ", more, " more"));
  }
  return absl::StrJoin(changes, ", ");
}

}  // namespace qcal
