#include "coordinator/job_store.h"

#include <algorithm>
#include <cstdio>

#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_cat.h"

namespace qcal::coordinator {

int64_t JobStore::IdNumber(const std::string& job_id) {
  static const std::string kPrefix = "job-";
  if (job_id.size() <= kPrefix.size() || job_id.compare(0, kPrefix.size(), kPrefix) != 0 ||
      job_id.size() > kPrefix.size() + 15) {
    return -1;
  }
  int64_t n = 0;
  for (size_t i = kPrefix.size(); i < job_id.size(); ++i) {
    if (job_id[i] < '0' || job_id[i] > '9') return -1;
    n = n * 10 + (job_id[i] - '0');
  }
  return n;
}

std::string JobStore::RecordPath(const std::string& job_id) const {
  return dir_ + "/" + job_id + ".json";
}

StatusOr<std::unique_ptr<JobStore>> JobStore::Open(StateFs* fs, const std::string& state_dir) {
  const std::string dir = state_dir + "/jobs";
  QCAL_RETURN_IF_ERROR(fs->MakeDirs(dir));
  std::unique_ptr<JobStore> store(new JobStore(fs, dir));
  QCAL_ASSIGN_OR_RETURN(std::vector<std::string> names, fs->ListFiles(dir));
  for (const std::string& name : names) {
    const std::string suffix = ".json";
    if (name.size() <= suffix.size() ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;  // temporary files of an interrupted write, or anything else
    }
    const std::string path = dir + "/" + name;
    const std::string id = name.substr(0, name.size() - suffix.size());
    const int64_t number = IdNumber(id);
    if (number < 0) {
      store->load_warnings_.push_back(path + ": not a job record name (expected job-<digits>.json)");
      continue;
    }
    // Never reuse the id of a record on disk, readable or not.
    store->last_id_ = std::max(store->last_id_, number);
    QCAL_ASSIGN_OR_RETURN(std::string text, fs->ReadFile(path));
    v1::Job job;
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = true;  // records written by a newer coordinator
    auto parsed = google::protobuf::util::JsonStringToMessage(text, &job, options);
    if (!parsed.ok()) {
      store->load_warnings_.push_back(
          absl::StrCat(path, ": unreadable job record (", parsed.ToString(), "); skipped"));
      continue;
    }
    if (job.id() != id) {
      store->load_warnings_.push_back(
          absl::StrCat(path, ": the record says id '", job.id(), "'; skipped"));
      continue;
    }
    store->jobs_[number] = std::move(job);
  }
  return store;
}

Status JobStore::Put(const v1::Job& job) {
  const int64_t number = IdNumber(job.id());
  if (number < 0) {
    return absl::InvalidArgumentError(absl::StrCat("job id '", job.id(), "' is malformed"));
  }
  std::string text;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  auto printed = google::protobuf::util::MessageToJsonString(job, &text, options);
  if (!printed.ok()) {
    return absl::InternalError(absl::StrCat("job ", job.id(), ": ", printed.ToString()));
  }
  text += "\n";
  QCAL_RETURN_IF_ERROR(fs_->WriteFileAtomic(RecordPath(job.id()), text));
  last_id_ = std::max(last_id_, number);
  jobs_[number] = job;
  return absl::OkStatus();
}

const v1::Job* JobStore::Find(const std::string& job_id) const {
  const int64_t number = IdNumber(job_id);
  auto it = jobs_.find(number);
  return it == jobs_.end() ? nullptr : &it->second;
}

std::vector<v1::Job> JobStore::List() const {
  std::vector<v1::Job> out;
  out.reserve(jobs_.size());
  for (const auto& [number, job] : jobs_) out.push_back(job);
  return out;
}

std::string JobStore::NewJobId() {
  ++last_id_;
  char buf[32];
  std::snprintf(buf, sizeof(buf), "job-%06lld", static_cast<long long>(last_id_));
  return buf;
}

}  // namespace qcal::coordinator
