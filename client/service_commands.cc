#include "client/service_commands.h"

#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <memory>
#include <thread>

#include <CLI/CLI.hpp>
#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "client/progress.h"
#include "common/atomic_file.h"
#include "common/text.h"
#include "common/tokenizer.h"
#include "coordinator/auth.h"
#include "proto/qcal.grpc.pb.h"
#include "worker/eval/perplexity.h"
#include "worker/model/llama.h"
#include "worker/quant/quantized_checkpoint.h"

extern char** environ;

namespace qcal::client {
namespace {

namespace fs = std::filesystem;
namespace v1 = ::qcal::v1;
using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Output helpers

int Fail(const std::string& message) {
  std::fprintf(stderr, "qcal: error: %s\n", message.c_str());
  return 1;
}
int Fail(const absl::Status& status) { return Fail(std::string(status.message())); }
int Fail(const grpc::Status& status) {
  return Fail(absl::StrCat(
      absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())), ": ",
      status.error_message()));
}

std::string StateName(v1::JobState state) {
  std::string name = v1::JobState_Name(state);
  const std::string prefix = "JOB_STATE_";
  return name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
}

bool IsFinal(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED ||
         s == v1::JOB_STATE_CANCELLED;
}

// 0 SUCCEEDED, 2 CANCELLED, 1 otherwise.
int ExitCodeFor(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED ? 0 : s == v1::JOB_STATE_CANCELLED ? 2 : 1;
}

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
          {"metrics", ParsedOrString(b.metrics_json())}};
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
          {"state", StateName(job.state())},
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
            {"calib_batch", s.calib_batch()}}},
          {"blocks", blocks},
          {"result", ParsedOrString(job.result_json())}};
}

json EventToJson(const v1::JobEvent& e) {
  std::string kind = v1::JobEventKind_Name(e.kind());
  const std::string prefix = "JOB_EVENT_KIND_";
  if (kind.rfind(prefix, 0) == 0) kind = kind.substr(prefix.size());
  json j = {{"job_id", e.job_id()}, {"seq", e.seq()},     {"time_unix", e.time_unix()},
            {"kind", kind},         {"state", StateName(e.state())},
            {"phase", e.phase()},   {"done", e.done()},   {"total", e.total()},
            {"eta_seconds", e.eta_seconds()},             {"message", e.message()}};
  if (e.has_block()) j["block"] = BlockToJson(e.block());
  return j;
}

std::string TimeOfDay(double unix_seconds) {
  const std::time_t t = static_cast<std::time_t>(unix_seconds);
  std::tm tm;
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%H:%M:%S", &tm);
  return buf;
}

std::string DateTime(double unix_seconds) {
  if (unix_seconds <= 0) return "-";
  const std::time_t t = static_cast<std::time_t>(unix_seconds);
  std::tm tm;
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &tm);
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

// Mean relative error over a block's linears (from its block_done entry), NaN when absent.
double MeanRelative(const json& metrics) {
  if (!metrics.is_object() || !metrics.contains("metrics")) return std::nan("");
  double sum = 0;
  int n = 0;
  for (const auto& m : metrics["metrics"]) {
    if (m.contains("relative") && m["relative"].is_number()) {
      sum += m["relative"].get<double>();
      ++n;
    }
  }
  return n > 0 ? sum / n : std::nan("");
}

void PrintBlockTable(const v1::Job& job) {
  if (job.blocks_size() == 0) return;
  std::vector<v1::BlockMetrics> sorted(job.blocks().begin(), job.blocks().end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.block() < b.block(); });
  std::printf("\n%-6s %-8s %9s %16s\n", "block", "rank", "seconds", "mean rel. error");
  for (const auto& b : sorted) {
    const double rel = MeanRelative(ParsedOrString(b.metrics_json()));
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

void PrintJob(const v1::Job& job) {
  const v1::JobSpec& s = job.spec();
  std::printf("%s  %s%s\n", job.id().c_str(), StateName(job.state()).c_str(),
              s.name().empty() ? "" : ("  (" + s.name() + ")").c_str());
  std::printf("  recipe    %s\n", s.recipe_path().c_str());
  std::printf("  model     %s\n", s.model_dir().c_str());
  std::printf("  output    %s (job dir %s)\n", s.out_dir().c_str(),
              s.job_dir().empty() ? (s.out_dir() + ".job").c_str() : s.job_dir().c_str());
  std::printf("  workers   %d rank(s), %d alive\n", s.workers(), job.workers_alive());
  std::printf("  phase     %s, blocks %lld/%lld, ETA %s\n", job.phase().c_str(),
              static_cast<long long>(job.blocks_done()),
              static_cast<long long>(job.blocks_total()), Seconds(job.eta_seconds()).c_str());
  std::printf("  created   %s, updated %s\n", DateTime(job.created_unix()).c_str(),
              DateTime(job.updated_unix()).c_str());
  if (!job.error().empty()) std::printf("  error     %s\n", job.error().c_str());
  PrintBlockTable(job);
  if (job.state() == v1::JOB_STATE_SUCCEEDED) {
    std::printf("\n");
    PrintResult(job);
  }
}

// ---------------------------------------------------------------------------------------------
// Connection

struct ConnectionOptions {
  std::string address;
  std::string token_file;
  coordinator::ClientTls tls;
};

void AddConnectionOptions(CLI::App* cmd, ConnectionOptions* o) {
  const char* env_address = std::getenv("QCAL_COORDINATOR");
  o->address = env_address ? env_address : "127.0.0.1:50051";
  const char* env_token = std::getenv("QCAL_AUTH_TOKEN_FILE");
  o->token_file = env_token ? env_token : "";
  cmd->add_option("--coordinator", o->address, "coordinator host:port (env QCAL_COORDINATOR)")
      ->capture_default_str();
  cmd->add_option("--auth-token-file", o->token_file,
                  "file with the bearer token (env QCAL_AUTH_TOKEN_FILE)");
  cmd->add_option("--tls-ca", o->tls.ca_file, "use TLS, trusting this CA")
      ->check(CLI::ExistingFile);
  cmd->add_option("--tls-cert", o->tls.cert_file, "client certificate (mutual TLS)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--tls-key", o->tls.key_file, "key of --tls-cert")->check(CLI::ExistingFile);
}

class Client {
 public:
  static StatusOr<std::unique_ptr<Client>> Connect(const ConnectionOptions& o) {
    if (o.token_file.empty()) {
      return absl::InvalidArgumentError(
          "no auth token: pass --auth-token-file or set QCAL_AUTH_TOKEN_FILE");
    }
    QCAL_ASSIGN_OR_RETURN(std::string token, coordinator::ReadTokenFile(o.token_file));
    QCAL_ASSIGN_OR_RETURN(auto channel, coordinator::MakeChannel(o.address, o.tls));
    auto c = std::unique_ptr<Client>(new Client());
    c->address_ = o.address;
    c->token_ = token;
    c->channel_ = channel;
    c->stub_ = v1::JobService::NewStub(channel);
    return c;
  }

  // A context with the token and, for unary calls, a deadline.
  void Prepare(grpc::ClientContext* ctx, bool unary = true) const {
    coordinator::AddBearerToken(ctx, token_);
    if (unary) ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  }
  // Unavailable names the address.
  grpc::Status Explain(grpc::Status s) const {
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
      return grpc::Status(s.error_code(), absl::StrCat("cannot reach the coordinator at ",
                                                       address_, ": ", s.error_message()));
    }
    return s;
  }

  grpc::Status Get(const std::string& id, v1::Job* job) const {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::GetJobRequest req;
    req.set_job_id(id);
    return Explain(stub_->GetJob(&ctx, req, job));
  }
  grpc::Status Cancel(const std::string& id, v1::Job* job) const {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::CancelJobRequest req;
    req.set_job_id(id);
    v1::CancelJobResponse resp;
    grpc::Status s = stub_->CancelJob(&ctx, req, &resp);
    *job = resp.job();
    return Explain(s);
  }
  grpc::Status Submit(const v1::JobSpec& spec, std::string* id) const {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    v1::SubmitJobResponse resp;
    grpc::Status s = stub_->SubmitJob(&ctx, req, &resp);
    *id = resp.job_id();
    return Explain(s);
  }
  grpc::Status List(std::vector<v1::Job>* jobs) const {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::ListJobsResponse resp;
    grpc::Status s = stub_->ListJobs(&ctx, v1::ListJobsRequest(), &resp);
    jobs->assign(resp.jobs().begin(), resp.jobs().end());
    return Explain(s);
  }
  v1::JobService::Stub& stub() const { return *stub_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  Client() = default;
  std::string address_, token_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> stub_;
};

// ---------------------------------------------------------------------------------------------
// Watching a job: one line per event for people (a progress bar per phase on a terminal), or one
// JSON object per event. Reconnects (from the last event seen) if the stream breaks.

class JobWatcher {
 public:
  JobWatcher(const Client& client, bool json) : client_(client), json_(json) {}

  // Follows `id` until it ends; returns the final job.
  StatusOr<v1::Job> Follow(const std::string& id) {
    int64_t last_seq = 0;
    for (int attempt = 0;; ++attempt) {
      grpc::ClientContext ctx;
      client_.Prepare(&ctx, /*unary=*/false);
      v1::WatchJobRequest req;
      req.set_job_id(id);
      req.set_after_seq(last_seq);
      auto reader = client_.stub().WatchJob(&ctx, req);
      v1::JobEvent e;
      while (reader->Read(&e)) {
        last_seq = e.seq();
        Show(e);
        attempt = 0;
      }
      grpc::Status s = reader->Finish();
      if (bar_) bar_->Finish();
      bar_.reset();
      v1::Job job;
      if (s.ok() || s.error_code() == grpc::StatusCode::CANCELLED) {
        grpc::Status g = client_.Get(id, &job);
        if (!g.ok()) return absl::Status(static_cast<absl::StatusCode>(g.error_code()),
                                         g.error_message());
        if (IsFinal(job.state())) return job;
      }
      if (s.error_code() != grpc::StatusCode::UNAVAILABLE &&
          s.error_code() != grpc::StatusCode::CANCELLED && !s.ok()) {
        s = client_.Explain(s);
        return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
      }
      if (attempt >= 10) {
        return absl::UnavailableError(absl::StrCat("lost the event stream of ", id, ": ",
                                                   client_.Explain(s).error_message()));
      }
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
  }

 private:
  void Line(const v1::JobEvent& e, const std::string& text, FILE* out = stdout) {
    if (bar_ && tty_) std::fprintf(stderr, "\r\033[K");
    std::fprintf(out, "[%s] %s %s\n", TimeOfDay(e.time_unix()).c_str(), e.job_id().c_str(),
                 text.c_str());
    std::fflush(out);
  }

  void Show(const v1::JobEvent& e) {
    if (json_) {
      std::printf("%s\n", EventToJson(e).dump().c_str());
      std::fflush(stdout);
      return;
    }
    switch (e.kind()) {
      case v1::JOB_EVENT_KIND_STATE:
        if (bar_) bar_->Finish();
        bar_.reset();
        Line(e, e.message().empty() ? StateName(e.state()) : e.message());
        break;
      case v1::JOB_EVENT_KIND_PHASE:
        if (bar_) bar_->Finish();
        bar_.reset();
        Line(e, absl::StrCat("phase ", e.phase()));
        if (e.phase() == "quantize") {
          bar_ = std::make_unique<ProgressBar>(e.job_id() + " quantize", e.total());
          bar_->Update(e.done(), e.total());
        }
        break;
      case v1::JOB_EVENT_KIND_PROGRESS:
        if (e.total() > 0) {
          if (!bar_ || bar_phase_ != e.phase()) {
            if (bar_) bar_->Finish();
            bar_ = std::make_unique<ProgressBar>(e.job_id() + " " + e.phase(), e.total());
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

  const Client& client_;
  bool json_;
  bool tty_ = isatty(STDERR_FILENO) == 1;
  std::unique_ptr<ProgressBar> bar_;
  std::string bar_phase_;
};

// ---------------------------------------------------------------------------------------------
// submit / status / watch / cancel / list

struct SpecOptions {
  std::string recipe_path;
  std::string model_dir, out_dir, job_dir;
  std::string data_root = "../shared";
  int workers = 1;
  int threads = 0;
  int calib_batch = 0;
  std::string name;
};

void AddSpecOptions(CLI::App* cmd, SpecOptions* o) {
  cmd->add_option("recipe", o->recipe_path, "recipe YAML (jobs/*.yaml)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--model", o->model_dir, "float model directory (HF layout)")->required();
  cmd->add_option("--out", o->out_dir, "output checkpoint directory")->required();
  cmd->add_option("--job-dir", o->job_dir, "journal and calibration products (default OUT.job)");
  cmd->add_option("--data-root", o->data_root, "where the recipe's calibration files resolve")
      ->capture_default_str();
  cmd->add_option("--workers", o->workers, "MPI ranks")->capture_default_str();
  cmd->add_option("--threads", o->threads, "compute threads per rank (0 = automatic)");
  cmd->add_option("--calib-batch", o->calib_batch, "sequences per calibration forward (0 = 8)");
  cmd->add_option("--name", o->name, "a label shown by `qcal list`");
}

std::string Absolute(const std::string& path) {
  if (path.empty()) return path;
  std::error_code ec;
  fs::path p = fs::absolute(path, ec);
  return (ec ? fs::path(path) : p).lexically_normal().string();
}

StatusOr<v1::JobSpec> MakeSpec(const SpecOptions& o) {
  v1::JobSpec spec;
  spec.set_recipe_path(Absolute(o.recipe_path));
  QCAL_ASSIGN_OR_RETURN(std::string yaml, ReadFile(o.recipe_path));
  spec.set_recipe_yaml(yaml);
  spec.set_model_dir(Absolute(o.model_dir));
  spec.set_out_dir(Absolute(o.out_dir));
  spec.set_job_dir(Absolute(o.job_dir));
  spec.set_data_root(Absolute(o.data_root));
  spec.set_workers(o.workers);
  spec.set_threads_per_worker(o.threads);
  spec.set_calib_batch(o.calib_batch);
  spec.set_name(o.name);
  return spec;
}

int RunSubmit(const ConnectionOptions& c, const SpecOptions& s, bool watch, bool json_out) {
  auto client = Client::Connect(c);
  if (!client.ok()) return Fail(client.status());
  auto spec = MakeSpec(s);
  if (!spec.ok()) return Fail(spec.status());
  std::string id;
  grpc::Status st = (*client)->Submit(*spec, &id);
  if (!st.ok()) return Fail(st);
  if (json_out) {
    std::printf("%s\n", json{{"job_id", id}}.dump().c_str());
  } else {
    std::printf("%s\n", id.c_str());
  }
  std::fflush(stdout);
  if (!watch) return 0;
  auto job = JobWatcher(**client, json_out).Follow(id);
  if (!job.ok()) return Fail(job.status());
  return ExitCodeFor(job->state());
}

int RunStatus(const ConnectionOptions& c, const std::string& id, bool json_out) {
  auto client = Client::Connect(c);
  if (!client.ok()) return Fail(client.status());
  v1::Job job;
  grpc::Status st = (*client)->Get(id, &job);
  if (!st.ok()) return Fail(st);
  if (json_out) {
    std::printf("%s\n", JobToJson(job).dump().c_str());
  } else {
    PrintJob(job);
  }
  return 0;
}

int RunWatch(const ConnectionOptions& c, const std::string& id, bool json_out) {
  auto client = Client::Connect(c);
  if (!client.ok()) return Fail(client.status());
  auto job = JobWatcher(**client, json_out).Follow(id);
  if (!job.ok()) return Fail(job.status());
  if (!json_out) {
    std::printf("%s %s%s%s\n", job->id().c_str(), StateName(job->state()).c_str(),
                job->error().empty() ? "" : ": ", job->error().c_str());
  }
  return ExitCodeFor(job->state());
}

int RunCancel(const ConnectionOptions& c, const std::string& id, bool json_out) {
  auto client = Client::Connect(c);
  if (!client.ok()) return Fail(client.status());
  v1::Job job;
  grpc::Status st = (*client)->Cancel(id, &job);
  if (!st.ok()) return Fail(st);
  if (json_out) {
    std::printf("%s\n", JobToJson(job).dump().c_str());
  } else {
    std::printf("%s %s\n", job.id().c_str(), StateName(job.state()).c_str());
  }
  return 0;
}

int RunList(const ConnectionOptions& c, bool json_out) {
  auto client = Client::Connect(c);
  if (!client.ok()) return Fail(client.status());
  std::vector<v1::Job> jobs;
  grpc::Status st = (*client)->List(&jobs);
  if (!st.ok()) return Fail(st);
  if (json_out) {
    json arr = json::array();
    for (const auto& j : jobs) arr.push_back(JobToJson(j));
    std::printf("%s\n", arr.dump().c_str());
    return 0;
  }
  std::printf("%-11s %-16s %-10s %-9s %-7s %-8s %-19s %s\n", "ID", "NAME", "STATE", "PHASE",
              "BLOCKS", "WORKERS", "UPDATED", "OUT");
  for (const auto& j : jobs) {
    std::printf("%-11s %-16s %-10s %-9s %-7s %-8s %-19s %s\n", j.id().c_str(),
                j.spec().name().empty() ? "-" : j.spec().name().substr(0, 16).c_str(),
                StateName(j.state()).c_str(), j.phase().c_str(),
                absl::StrCat(j.blocks_done(), "/", j.blocks_total()).c_str(),
                absl::StrCat(j.workers_alive(), "/", j.spec().workers()).c_str(),
                DateTime(j.updated_unix()).c_str(), j.spec().out_dir().c_str());
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// qcal run: a private coordinator, its workers, the job, then perplexity.

struct RunOptions {
  SpecOptions spec;
  std::string state_dir;
  std::string coordinator_binary, worker_binary, mpirun;
  std::vector<std::string> eval_data;
  int64_t eval_ctx = 512;
  int64_t eval_max_tokens = -1;
  bool no_eval = false;
  bool json = false;
};

std::string SelfDir() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, n);
  return path.substr(0, path.rfind('/'));
}

// qcal-coordinator beside this program, in the build tree's coordinator/ folder, or on PATH.
std::string FindCoordinatorBinary() {
  const std::string dir = SelfDir();
  for (const std::string& c :
       {dir + "/qcal-coordinator", dir + "/../coordinator/qcal-coordinator"}) {
    if (::access(c.c_str(), X_OK) == 0) return c;
  }
  return "qcal-coordinator";
}

// The coordinator child: started in its own process group (a Ctrl-C reaches only qcal, which
// cancels the job first), stopped with SIGTERM.
class LocalCoordinator {
 public:
  ~LocalCoordinator() { Stop(); }

  Status Start(const RunOptions& o, const std::string& state, const std::string& token_file) {
    state_ = state;
    const std::string address_file = state + "/address";
    ::unlink(address_file.c_str());
    std::vector<std::string> args = {
        o.coordinator_binary.empty() ? FindCoordinatorBinary() : o.coordinator_binary,
        "--listen", "127.0.0.1:0", "--state", state, "--auth-token-file", token_file,
        "--address-file", address_file};
    if (!o.worker_binary.empty()) args.insert(args.end(), {"--worker-binary", o.worker_binary});
    if (!o.mpirun.empty()) args.insert(args.end(), {"--mpirun", o.mpirun});
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    output_ = state + "/coordinator.out";
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, output_.c_str(), O_WRONLY | O_CREAT | O_APPEND,
                                     0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setpgroup(&attr, 0);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    const int rc = ::posix_spawnp(&pid_, argv[0], &fa, &attr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    if (rc != 0) {
      pid_ = 0;
      return absl::FailedPreconditionError(
          absl::StrCat("cannot run '", args[0], "': ", std::strerror(rc),
                       " (build the qcal-coordinator target or pass --coordinator-binary)"));
    }
    for (int i = 0; i < 600; ++i) {
      auto text = ReadFile(address_file);
      if (text.ok() && !text->empty()) {
        address_ = text->substr(0, text->find('\n'));
        return absl::OkStatus();
      }
      int status;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = 0;
        return absl::UnavailableError(absl::StrCat(
            "the local coordinator exited at start; its output (", output_, "):\n",
            ReadFile(output_).value_or("")));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return absl::DeadlineExceededError(
        absl::StrCat("the local coordinator did not start within 30 s; see ", output_));
  }

  void Stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    int status;
    for (int i = 0; i < 400; ++i) {
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = 0;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &status, 0);
    pid_ = 0;
  }

  const std::string& address() const { return address_; }

 private:
  pid_t pid_ = 0;
  std::string state_, address_, output_;
};

std::atomic<int> g_interrupts{0};
void OnInterrupt(int) { g_interrupts.fetch_add(1); }

struct EvalRow {
  std::string label, path;
  int64_t tokens = 0;
  double float_ppl = std::nan(""), quant_ppl = std::nan("");
};

// Perplexity of the model in `model_dir` on `text_path` (non-overlapping windows of `ctx`).
StatusOr<eval::PerplexityResult> Perplexity(const std::string& model_dir,
                                            const std::string& text_path, int64_t ctx,
                                            int64_t max_tokens, const std::string& label) {
  QCAL_ASSIGN_OR_RETURN(auto model, quant::LoadAnyModel(model_dir));
  model::SetComputeThreads(model::AutoComputeThreads(model->config()));
  QCAL_ASSIGN_OR_RETURN(auto tokenizer, LoadTokenizerFromModelDir(model_dir));
  QCAL_ASSIGN_OR_RETURN(std::string text, ReadTextFile(text_path));
  eval::PerplexityOptions opt;
  opt.ctx = ctx;
  opt.max_tokens = max_tokens;
  opt.bos_id = tokenizer->bos_id();
  ProgressBar bar(label, 0);
  auto result = eval::EvaluatePerplexity(*model, tokenizer->Encode(text), opt,
                                         [&bar](int64_t d, int64_t t) { bar.Update(d, t); });
  bar.Finish();
  return result;
}

int RunRun(const RunOptions& o) {
  auto spec = MakeSpec(o.spec);
  if (!spec.ok()) return Fail(spec.status());

  // State directory and a fresh token only this user can read.
  std::string state = o.state_dir;
  const bool temporary_state = state.empty();
  if (temporary_state) {
    std::string tmpl = (fs::temp_directory_path() / "qcal-run.XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) return Fail("cannot create a temporary state dir");
    state = tmpl;
  } else if (auto s = MakeDirs(state); !s.ok()) {
    return Fail(s);
  }
  state = Absolute(state);
  const std::string token_file = state + "/auth-token";
  {
    auto token = coordinator::NewRandomToken();
    if (!token.ok()) return Fail(token.status());
    ::unlink(token_file.c_str());
    const int fd = ::open(token_file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 || ::write(fd, token->data(), token->size()) != static_cast<ssize_t>(token->size())) {
      if (fd >= 0) ::close(fd);
      return Fail(absl::StrCat(token_file, ": cannot write the auth token"));
    }
    ::close(fd);
  }

  LocalCoordinator coordinator;
  if (auto s = coordinator.Start(o, state, token_file); !s.ok()) return Fail(s);
  ConnectionOptions conn;
  conn.address = coordinator.address();
  conn.token_file = token_file;
  auto client = Client::Connect(conn);
  if (!client.ok()) return Fail(client.status());
  if (auto s = coordinator::WaitForHealthy((*client)->channel(), std::chrono::seconds(30));
      !s.ok()) {
    return Fail(s);
  }
  std::string id;
  grpc::Status st = (*client)->Submit(*spec, &id);
  if (!st.ok()) {
    // Refused before it existed: nothing in the state directory is worth keeping.
    coordinator.Stop();
    if (temporary_state) {
      std::error_code ec;
      fs::remove_all(state, ec);
    }
    return Fail(st);
  }
  if (!o.json) {
    std::printf("%s: %s -> %s with %d worker rank(s); local coordinator at %s (state %s)\n",
                id.c_str(), spec->model_dir().c_str(), spec->out_dir().c_str(), spec->workers(),
                coordinator.address().c_str(), state.c_str());
    std::fflush(stdout);
  }

  // First Ctrl-C (or SIGTERM, e.g. from `timeout` or a batch system) cancels the job, so its
  // workers are stopped rather than orphaned; the second gives up at once.
  g_interrupts = 0;
  struct sigaction sa = {}, old_int = {}, old_term = {};
  sa.sa_handler = OnInterrupt;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  std::atomic<bool> watching{true};
  std::thread canceller([&] {
    bool cancelled = false;
    while (watching) {
      const int n = g_interrupts.load();
      if (n >= 1 && !cancelled) {
        std::fprintf(stderr, "\nqcal: cancelling %s (Ctrl-C again to quit now)\n", id.c_str());
        v1::Job ignored;
        (*client)->Cancel(id, &ignored);
        cancelled = true;
      }
      if (n >= 2) {
        coordinator.Stop();
        std::_Exit(130);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  auto job = JobWatcher(**client, o.json).Follow(id);
  watching = false;
  canceller.join();
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  coordinator.Stop();
  if (!job.ok()) return Fail(job.status());

  json eval_rows = json::array();
  if (!o.json) {
    std::printf("\n%s %s%s%s\n", id.c_str(), StateName(job->state()).c_str(),
                job->error().empty() ? "" : ": ", job->error().c_str());
    PrintBlockTable(*job);
    if (job->state() == v1::JOB_STATE_SUCCEEDED) PrintResult(*job);
  }
  if (job->state() != v1::JOB_STATE_SUCCEEDED) {
    std::fprintf(stderr, "qcal: coordinator log and worker output: %s, %s\n",
                 (state + "/coordinator.log").c_str(),
                 (fs::path(spec->job_dir().empty() ? spec->out_dir() + ".job" : spec->job_dir()) /
                  "workers.log")
                     .c_str());
  }

  if (job->state() == v1::JOB_STATE_SUCCEEDED && !o.no_eval) {
    std::vector<EvalRow> rows;
    if (!o.eval_data.empty()) {
      for (const std::string& p : o.eval_data) {
        rows.push_back({fs::path(p).stem().string(), Absolute(p)});
      }
    } else {
      const std::string root = spec->data_root();
      const std::pair<const char*, std::string> defaults[] = {
          {"wikitext2", root + "/data/wikitext2/wiki.test.joined.txt"},
          {"tinystories", root + "/data/tinystories/TinyStories-valid.sample30k.txt"}};
      for (const auto& [label, path] : defaults) {
        if (::access(path.c_str(), R_OK) == 0) rows.push_back({label, path});
      }
    }
    for (EvalRow& row : rows) {
      auto f = Perplexity(spec->model_dir(), row.path, o.eval_ctx, o.eval_max_tokens,
                          row.label + " float");
      if (!f.ok()) return Fail(f.status());
      auto q = Perplexity(spec->out_dir(), row.path, o.eval_ctx, o.eval_max_tokens,
                          row.label + " quantized");
      if (!q.ok()) return Fail(q.status());
      row.tokens = f->tokens_scored;
      row.float_ppl = f->perplexity;
      row.quant_ppl = q->perplexity;
      eval_rows.push_back({{"data", row.label}, {"path", row.path}, {"tokens", row.tokens},
                           {"float", row.float_ppl}, {"quantized", row.quant_ppl}});
    }
    if (!o.json && !rows.empty()) {
      std::printf("\nperplexity (ctx %lld, non-overlapping windows%s)\n",
                  static_cast<long long>(o.eval_ctx),
                  o.eval_max_tokens > 0
                      ? absl::StrCat(", first ", o.eval_max_tokens, " tokens").c_str()
                      : "");
      std::printf("%-14s %10s %12s %12s\n", "data", "tokens", "float", "quantized");
      for (const EvalRow& r : rows) {
        std::printf("%-14s %10lld %12.4f %12.4f\n", r.label.c_str(),
                    static_cast<long long>(r.tokens), r.float_ppl, r.quant_ppl);
      }
    }
  }
  if (o.json) {
    std::printf("%s\n", json{{"job", JobToJson(*job)}, {"perplexity", eval_rows}}.dump().c_str());
  }
  if (temporary_state && job->state() == v1::JOB_STATE_SUCCEEDED) {
    std::error_code ec;
    fs::remove_all(state, ec);
  }
  return ExitCodeFor(job->state());
}

}  // namespace

void AddServiceCommands(CLI::App& app, int* exit_code) {
  // submit
  {
    auto* cmd = app.add_subcommand("submit", "Submit a quantization job to a coordinator");
    auto c = std::make_shared<ConnectionOptions>();
    auto s = std::make_shared<SpecOptions>();
    auto flags = std::make_shared<std::pair<bool, bool>>(false, false);  // watch, json
    AddSpecOptions(cmd, s.get());
    AddConnectionOptions(cmd, c.get());
    cmd->add_flag("--watch", flags->first, "follow the job and exit with its status");
    cmd->add_flag("--json", flags->second, "print JSON");
    cmd->callback([=] { *exit_code = RunSubmit(*c, *s, flags->first, flags->second); });
  }
  // status / watch / cancel
  struct JobCommand {
    const char* name;
    const char* help;
    int (*run)(const ConnectionOptions&, const std::string&, bool);
  };
  for (const JobCommand& jc : {JobCommand{"status", "Show a job", RunStatus},
                               JobCommand{"watch",
                                          "Follow a job's events until it ends (exit 0 "
                                          "succeeded, 1 failed, 2 cancelled)",
                                          RunWatch},
                               JobCommand{"cancel", "Cancel a job (its workers are stopped)",
                                          RunCancel}}) {
    auto* cmd = app.add_subcommand(jc.name, jc.help);
    auto c = std::make_shared<ConnectionOptions>();
    auto id = std::make_shared<std::string>();
    auto json_out = std::make_shared<bool>(false);
    cmd->add_option("job", *id, "job id (job-000001)")->required();
    AddConnectionOptions(cmd, c.get());
    cmd->add_flag("--json", *json_out, "print JSON");
    auto run = jc.run;
    cmd->callback([=] { *exit_code = run(*c, *id, *json_out); });
  }
  // list
  {
    auto* cmd = app.add_subcommand("list", "List the coordinator's jobs");
    auto c = std::make_shared<ConnectionOptions>();
    auto json_out = std::make_shared<bool>(false);
    AddConnectionOptions(cmd, c.get());
    cmd->add_flag("--json", *json_out, "print JSON");
    cmd->callback([=] { *exit_code = RunList(*c, *json_out); });
  }
  // run
  {
    auto* cmd = app.add_subcommand(
        "run",
        "Quantize with a private local coordinator and N MPI workers, then print float and "
        "quantized perplexity");
    auto o = std::make_shared<RunOptions>();
    AddSpecOptions(cmd, &o->spec);
    cmd->add_option("--state", o->state_dir,
                    "coordinator state directory (default: a temporary one, removed on success)");
    cmd->add_option("--coordinator-binary", o->coordinator_binary,
                    "qcal-coordinator (default: beside qcal or in the build tree)");
    cmd->add_option("--worker-binary", o->worker_binary,
                    "qcal-worker (default: the coordinator's choice)");
    cmd->add_option("--mpirun", o->mpirun, "mpirun to launch the workers with");
    cmd->add_option("--eval-data", o->eval_data,
                    "text files to evaluate on (default: WikiText-2 test and the TinyStories "
                    "sample under the data root)");
    cmd->add_option("--eval-ctx", o->eval_ctx, "perplexity window")->capture_default_str();
    cmd->add_option("--eval-max-tokens", o->eval_max_tokens,
                    "evaluate on at most this many tokens per file");
    cmd->add_flag("--no-eval", o->no_eval, "skip the perplexity evaluation");
    cmd->add_flag("--json", o->json, "print JSON events and one JSON summary at the end");
    cmd->callback([o, exit_code] { *exit_code = RunRun(*o); });
  }
}

}  // namespace qcal::client
