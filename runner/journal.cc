#include "runner/journal.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <fstream>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/checkpoint_layout.h"
#include "common/io_util.h"
#include "common/safe_fs.h"
#include "runner/job_dir.h"

namespace qcal {

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

nlohmann::json BlockPartDoneEntry(const v1::BlockResult& r) {
  nlohmann::json e = BlockDoneEntry(r);
  e["event"] = "block_part_done";
  e["part"] = {{"index", r.part().index()},
               {"count", r.part().count()},
               {"expert_begin", r.part().expert_begin()},
               {"expert_end", r.part().expert_end()}};
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
  if (e.contains("part") && e["part"].is_object()) {
    const nlohmann::json& p = e["part"];
    auto integer = [&p](const char* key) -> int64_t {
      return p.contains(key) && p[key].is_number_integer() ? p[key].get<int64_t>() : -1;
    };
    r.mutable_part()->set_index(static_cast<int32_t>(integer("index")));
    r.mutable_part()->set_count(static_cast<int32_t>(integer("count")));
    r.mutable_part()->set_expert_begin(integer("expert_begin"));
    r.mutable_part()->set_expert_end(integer("expert_end"));
  }
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

nlohmann::json PhaseDoneEntry(const v1::PhaseCurve& c) {
  nlohmann::json losses = nlohmann::json::array(), validation = nlohmann::json::array();
  for (double v : c.losses()) losses.push_back(FiniteOrNull(v));
  const int n = std::min(c.validation_steps_size(), c.validation_losses_size());
  for (int i = 0; i < n; ++i) {
    validation.push_back({c.validation_steps(i), FiniteOrNull(c.validation_losses(i))});
  }
  return {{"event", "phase_done"},
          {"phase", c.phase()},
          {"losses", losses},
          {"validation", validation}};
}

nlohmann::json ExpertLoadEntry(const v1::CalibrateResult& result) {
  nlohmann::json layers = nlohmann::json::array();
  for (const v1::ExpertLoad& l : result.expert_loads()) {
    layers.push_back({{"layer", l.layer()},
                      {"routed_tokens", std::vector<int64_t>(l.routed_tokens().begin(),
                                                             l.routed_tokens().end())},
                      {"every_token", std::vector<int64_t>(l.every_token().begin(),
                                                           l.every_token().end())}});
  }
  return {{"event", "expert_load"}, {"layers", layers}};
}

StatusOr<v1::PhaseCurve> PhaseCurveFromEntry(const nlohmann::json& e) {
  auto bad = [](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("phase_done entry: ", what));
  };
  if (!e.is_object() || e.value("event", "") != "phase_done") return bad("not a phase_done");
  if (!e.contains("phase") || !e["phase"].is_string()) return bad("no phase name");
  v1::PhaseCurve c;
  c.set_phase(e["phase"].get<std::string>());
  auto number = [](const nlohmann::json& v) {
    return v.is_number() ? v.get<double>() : std::numeric_limits<double>::quiet_NaN();
  };
  const nlohmann::json losses = e.value("losses", nlohmann::json::array());
  const nlohmann::json validation = e.value("validation", nlohmann::json::array());
  if (!losses.is_array() || !validation.is_array()) return bad("losses or validation not a list");
  for (const auto& v : losses) c.add_losses(number(v));
  for (const auto& p : validation) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number_integer()) {
      return bad("a validation score is not [step, loss]");
    }
    c.add_validation_steps(p[0].get<int64_t>());
    c.add_validation_losses(number(p[1]));
  }
  return c;
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
  const bool group = r.has_part() && r.part().index() > 0;
  if (group && (r.part().expert_begin() < 0 || r.part().expert_end() <= r.part().expert_begin())) {
    return absl::InvalidArgumentError(absl::StrCat("block result for layer ", r.layer(),
                                                   " names experts [", r.part().expert_begin(),
                                                   ", ", r.part().expert_end(), ")"));
  }
  const std::string shard =
      group ? PartFileName(r.layer(), r.part().expert_begin(), r.part().expert_end())
            : ShardName(r.layer() + 1, num_blocks);
  if (r.shard().name() != shard) {
    return absl::InvalidArgumentError(absl::StrCat("block result for layer ", r.layer(),
                                                   " names shard '", r.shard().name(),
                                                   "', expected ", shard));
  }
  for (const v1::WrittenFile& f : r.merged_parts()) {
    if (!IsPartFileName(f.name())) {
      return absl::InvalidArgumentError(absl::StrCat("block result for layer ", r.layer(),
                                                     " merged '", f.name(),
                                                     "', which is no part file"));
    }
  }
  return CheckStagedFiles(out_dir, FilesOf(r));
}

Status CheckBlockPartDoneEntry(const nlohmann::json& entry, const std::string& out_dir,
                               int64_t num_blocks) {
  if (!entry.is_object() || entry.value("event", "") != "block_part_done") {
    return absl::InvalidArgumentError("not a block_part_done journal entry");
  }
  const v1::BlockResult r = BlockResultFromEntry(entry);
  if (r.layer() < 0 || r.layer() >= num_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_part_done entry names layer ", r.layer(), " of ", num_blocks));
  }
  if (!r.has_part() || r.part().expert_begin() < 0 ||
      r.part().expert_end() <= r.part().expert_begin()) {
    return absl::InvalidArgumentError(absl::StrCat("block_part_done entry for layer ", r.layer(),
                                                   " names no expert range"));
  }
  const std::string name =
      PartFileName(r.layer(), r.part().expert_begin(), r.part().expert_end());
  if (r.shard().name() != name) {
    return absl::InvalidArgumentError(absl::StrCat("block_part_done entry for layer ", r.layer(),
                                                   " names '", r.shard().name(), "', expected ",
                                                   name));
  }
  const std::string path = out_dir + "/" + name;
  QCAL_ASSIGN_OR_RETURN(std::string sum, FileChecksum(path));
  if (sum != r.shard().checksum()) {
    return absl::DataLossError(absl::StrCat(path, ": checksum ", sum,
                                            " does not match the block_part_done entry's ",
                                            r.shard().checksum()));
  }
  return absl::OkStatus();
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
       {"recipe", "recipe_hash", "model", "out", "shard", "checksum", "inputs_key", "phase"}) {
    if (e.contains(key) && !e[key].is_string()) return absl::StrCat("'", key, "' is not a string");
  }
  if (e.contains("layer") && !e["layer"].is_number_integer()) return "'layer' is not an integer";
  if (e.contains("part") && !e["part"].is_object()) return "'part' is not an object";
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
  for (const char* key : {"losses", "validation"}) {
    if (e.contains(key) && !e[key].is_array()) return absl::StrCat("'", key, "' is not a list");
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


}  // namespace qcal
