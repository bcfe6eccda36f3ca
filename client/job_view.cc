#include "client/job_view.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "runner/job_dir.h"
#include "runner/journal.h"
#include "rpc/job_state.h"

namespace qcal::client {

namespace v1 = ::qcal::v1;
using nlohmann::json;

namespace {

json ParsedOrString(const std::string& text) {
  if (text.empty()) return json();
  json j = json::parse(text, nullptr, false);
  return j.is_discarded() ? json(text) : j;
}

json BlockToJson(const v1::BlockMetrics& b) {
  return {{"block", b.block()},
          {"seconds", b.seconds()},
          {"rank", b.rank()},
          {"resumed", b.resumed()},
          {"metrics", b.has_result() ? BlockDoneEntry(b.result()) : json()}};
}

json EvalToJson(const v1::EvalResult& e) {
  return {{"model", e.params().model()}, {"data", e.params().label()},
          {"path", e.params().path()},   {"ctx", e.params().ctx()},
          {"tokens", e.scored()},        {"perplexity", e.perplexity()},
          {"seconds", e.seconds()}};
}

std::string TimeOfDay(double unix_seconds) {
  const std::time_t t = static_cast<std::time_t>(unix_seconds);
  std::tm tm;
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%H:%M:%S", &tm);
  return buf;
}

std::string Seconds(double s) {
  if (s < 0 || !std::isfinite(s)) return "-";
  char buf[32];
  if (s < 60) {
    std::snprintf(buf, sizeof(buf), "%.1fs", s);
  } else {
    std::snprintf(buf, sizeof(buf), "%dm%02ds", static_cast<int>(s) / 60,
                  static_cast<int>(s) % 60);
  }
  return buf;
}

// Mean relative error over a block's linears, NaN when absent.
double MeanRelative(const v1::BlockMetrics& b) {
  double sum = 0;
  int n = 0;
  for (const auto& m : b.result().metrics()) {
    if (std::isfinite(m.relative())) {
      sum += m.relative();
      ++n;
    }
  }
  return n > 0 ? sum / n : std::nan("");
}

}  // namespace

std::string DateTime(double unix_seconds) {
  if (unix_seconds <= 0) return "-";
  const std::time_t t = static_cast<std::time_t>(unix_seconds);
  std::tm tm;
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

void PrintBlockTable(const v1::Job& job) {
  if (job.blocks_size() == 0) return;
  std::vector<v1::BlockMetrics> sorted(job.blocks().begin(), job.blocks().end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.block() < b.block(); });
  std::printf("\n%-6s %-8s %9s %16s\n", "block", "rank", "seconds", "mean rel. error");
  for (const auto& b : sorted) {
    const double rel = MeanRelative(b);
    std::printf("%-6lld %-8s %9.2f %16.4g\n", static_cast<long long>(b.block()),
                b.resumed() ? "resumed" : std::to_string(b.rank()).c_str(), b.seconds(), rel);
  }
}

void PrintResult(const v1::Job& job) {
  const json result = ParsedOrString(job.result_json());
  if (result.is_object() && result.contains("code_bits") && result.contains("stored_bits")) {
    std::printf("bits per weight: %.3f codes, %.3f stored (codes + signs + scales)\n",
                result["code_bits"].get<double>(), result["stored_bits"].get<double>());
  }
}

int ExitCodeFor(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED ? 0 : s == v1::JOB_STATE_CANCELLED ? 2 : 1;
}

json JobToJson(const v1::Job& job) {
  const v1::JobSpec& s = job.spec();
  json blocks = json::array();
  std::vector<v1::BlockMetrics> sorted(job.blocks().begin(), job.blocks().end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.block() < b.block(); });
  for (const auto& b : sorted) blocks.push_back(BlockToJson(b));
  return {{"id", job.id()},
          {"name", s.name()},
          {"owner", job.owner()},
          {"state", rpc::JobStateName(job.state())},
          {"phase", job.phase()},
          {"blocks_done", job.blocks_done()},
          {"blocks_total", job.blocks_total()},
          {"error", job.error()},
          {"created_unix", job.created_unix()},
          {"updated_unix", job.updated_unix()},
          {"eta_seconds", job.eta_seconds()},
          {"workers_alive", job.workers_alive()},
          {"spec",
           {{"recipe_path", s.recipe_path()},
            {"model_dir", s.model_dir()},
            {"out_dir", s.out_dir()},
            {"job_dir", s.job_dir()},
            {"data_root", s.data_root()},
            {"workers", s.workers()},
            {"threads_per_worker", s.threads_per_worker()},
            {"calib_batch", s.calib_batch()},
            {"experts_per_task", s.experts_per_task()}}},
          {"blocks", blocks},
          {"evals", [&] {
             json arr = json::array();
             for (const auto& e : job.evals()) arr.push_back(EvalToJson(e));
             return arr;
           }()},
          {"result", ParsedOrString(job.result_json())}};
}

json EventToJson(const v1::JobEvent& e) {
  std::string kind = v1::JobEventKind_Name(e.kind());
  const std::string prefix = "JOB_EVENT_KIND_";
  if (kind.rfind(prefix, 0) == 0) kind = kind.substr(prefix.size());
  json j = {{"job_id", e.job_id()}, {"seq", e.seq()},     {"time_unix", e.time_unix()},
            {"kind", kind},         {"state", rpc::JobStateName(e.state())},
            {"phase", e.phase()},   {"done", e.done()},   {"total", e.total()},
            {"eta_seconds", e.eta_seconds()},             {"message", e.message()}};
  if (e.has_block()) j["block"] = BlockToJson(e.block());
  return j;
}

std::string Shown(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (unsigned char c : text) {
    if (c < 0x20 || c == 0x7f) {
      out += absl::StrFormat("\\x%02x", c);
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  return out;
}

void PrintJob(const v1::Job& job) {
  const v1::JobSpec& s = job.spec();
  std::printf("%s  %s%s\n", Shown(job.id()).c_str(), rpc::JobStateName(job.state()),
              s.name().empty() ? "" : ("  (" + Shown(s.name()) + ")").c_str());
  if (!job.owner().empty()) std::printf("  owner     %s\n", Shown(job.owner()).c_str());
  std::printf("  recipe    %s\n", Shown(s.recipe_path()).c_str());
  std::printf("  model     %s\n", Shown(s.model_dir()).c_str());
  std::printf("  output    %s (job dir %s)\n", Shown(s.out_dir()).c_str(),
              Shown(JobDirFor(s.job_dir(), s.out_dir())).c_str());
  std::printf("  workers   %d rank(s), %d alive\n", s.workers(), job.workers_alive());
  std::printf("  phase     %s, blocks %lld/%lld, ETA %s\n", job.phase().c_str(),
              static_cast<long long>(job.blocks_done()),
              static_cast<long long>(job.blocks_total()), Seconds(job.eta_seconds()).c_str());
  std::printf("  created   %s, updated %s\n", DateTime(job.created_unix()).c_str(),
              DateTime(job.updated_unix()).c_str());
  if (!job.error().empty()) std::printf("  error     %s\n", Shown(job.error()).c_str());
  PrintBlockTable(job);
  if (job.state() == v1::JOB_STATE_SUCCEEDED) {
    std::printf("\n");
    PrintResult(job);
  }
}

void PrintEvalTable(const v1::Job& job) {
  struct Row {
    std::string label;
    int64_t tokens = 0;
    double float_ppl = std::nan(""), quant_ppl = std::nan("");
  };
  std::vector<Row> rows;
  int64_t ctx = 0, max_tokens = -1;
  for (const v1::EvalResult& e : job.evals()) {
    auto it = std::find_if(rows.begin(), rows.end(),
                           [&](const Row& r) { return r.label == e.params().label(); });
    if (it == rows.end()) it = rows.insert(rows.end(), Row{e.params().label()});
    if (e.params().model() == "float") {
      it->float_ppl = e.perplexity();
      it->tokens = e.scored();
    } else {
      it->quant_ppl = e.perplexity();
    }
    ctx = e.params().ctx();
    max_tokens = e.params().max_tokens();
  }
  if (rows.empty()) return;
  std::printf("\nperplexity (ctx %lld, non-overlapping windows%s)\n", static_cast<long long>(ctx),
              max_tokens > 0 ? absl::StrCat(", first ", max_tokens, " tokens").c_str() : "");
  std::printf("%-14s %10s %12s %12s\n", "data", "tokens", "float", "quantized");
  for (const Row& r : rows) {
    std::printf("%-14s %10lld %12.4f %12.4f\n", r.label.c_str(), static_cast<long long>(r.tokens),
                r.float_ppl, r.quant_ppl);
  }
}

// ---------------------------------------------------------------------------------------------
// JobWatcher

JobWatcher::JobWatcher(rpc::JobClient& client, bool json)
    : client_(client), json_(json), tty_(isatty(STDERR_FILENO) == 1) {}

StatusOr<v1::Job> JobWatcher::Follow(const std::string& id) {
  int64_t last_seq = 0;
  for (int attempt = 0;; ++attempt) {
    const Status s = client_.Watch(id, last_seq, [&](const v1::JobEvent& e) {
      last_seq = e.seq();
      Show(e);
      attempt = 0;
      return true;
    });
    if (bar_) bar_->Finish();
    bar_.reset();
    if (s.ok() || absl::IsCancelled(s)) {
      QCAL_ASSIGN_OR_RETURN(v1::Job job, client_.Get(id));
      if (rpc::IsFinalState(job.state())) return job;
    }
    if (!s.ok() && !absl::IsUnavailable(s) && !absl::IsCancelled(s)) return s;
    if (attempt >= 10) {
      return absl::UnavailableError(
          absl::StrCat("lost the event stream of ", id, ": ", s.message()));
    }
    std::this_thread::sleep_for(reconnect_delay_);
  }
}

void JobWatcher::Line(const v1::JobEvent& e, const std::string& text, FILE* out) {
  if (bar_ && tty_) std::fprintf(stderr, "\r\033[K");
  std::fprintf(out, "[%s] %s %s\n", TimeOfDay(e.time_unix()).c_str(),
               Shown(e.job_id()).c_str(), Shown(text).c_str());
  std::fflush(out);
}

void JobWatcher::Show(const v1::JobEvent& e) {
  if (json_) {
    std::printf("%s\n", EventToJson(e).dump().c_str());
    std::fflush(stdout);
    return;
  }
  switch (e.kind()) {
    case v1::JOB_EVENT_KIND_STATE:
      if (bar_) bar_->Finish();
      bar_.reset();
      Line(e, e.message().empty() ? rpc::JobStateName(e.state()) : e.message());
      break;
    case v1::JOB_EVENT_KIND_PHASE:
      if (bar_) bar_->Finish();
      bar_.reset();
      Line(e, absl::StrCat("phase ", e.phase()));
      if (e.phase() == "quantize") {
        // Block-done events print their own lines (with the ETA) off a terminal.
        bar_ = std::make_unique<ProgressBar>(e.job_id() + " quantize", e.total(),
                                             /*lines=*/false);
        bar_->Update(e.done(), e.total());
      }
      break;
    case v1::JOB_EVENT_KIND_PROGRESS:
      if (e.phase() == "block") {
        // Inside a running block (its quantizer's steps): a note on the quantize bar.
        if (bar_) bar_->Note(absl::StrCat(e.message(), " (", e.done(), "/", e.total(), ")"));
        break;
      }
      if (e.total() > 0) {
        if (!bar_ || bar_phase_ != e.phase()) {
          if (bar_) bar_->Finish();
          bar_ = std::make_unique<ProgressBar>(e.job_id() + " " + e.phase(), e.total(),
                                               /*lines=*/e.phase() != "quantize");
          bar_phase_ = e.phase();
        }
        bar_->Update(e.done(), e.total());
      }
      break;
    case v1::JOB_EVENT_KIND_BLOCK_DONE:
      Line(e, absl::StrCat(e.message(), " (", e.done(), "/", e.total(), ", ETA ",
                           Seconds(e.eta_seconds()), ")"));
      if (bar_) bar_->Update(e.done(), e.total());
      break;
    case v1::JOB_EVENT_KIND_WARNING:
      Line(e, "warning: " + e.message(), stderr);
      break;
    default:
      Line(e, e.message());
      break;
  }
}

}  // namespace qcal::client
