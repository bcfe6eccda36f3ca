// Coordinator RPC throughput: GetJob calls per second while WatchJob streams are open.
//
//   build/bench/bench_rpc [--watchers 100] [--seconds 3] [--clients 1,4,16] [--events-per-s 50]
//
// An in-process qcal-coordinator server (JobManager + gRPC service, plaintext, bearer token) on
// 127.0.0.1 holds one RUNNING job with 32 blocks, 31 of them done (realistic per-block metrics,
// so a GetJob answer is ~30 KB). `--watchers` WatchJob streams are opened on it and kept open;
// then `clients` threads, each on its own channel, call GetJob back to back for `--seconds`.
// Each row is measured twice: with the job idle, and with a worker reporting progress at
// `--events-per-s` (every event is streamed to every watcher). No LibTorch, no workers.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "common/atomic_file.h"
#include "common/log.h"
#include "rpc/auth.h"
#include "coordinator/job_manager.h"
#include "coordinator/service.h"
#include "coordinator/state_fs.h"
#include "proto/qcal.grpc.pb.h"

namespace qcal::coordinator {
namespace {

constexpr char kToken[] = "bench-token-0123456789abcdef";
constexpr int kBlocks = 32;

// Workers that are never started: the bench plays the one worker itself.
class IdleLauncher : public Launcher {
 public:
  StatusOr<std::unique_ptr<WorkerGroup>> Launch(const LaunchSpec&) override {
    struct Group : WorkerGroup {
      std::optional<std::string> Poll() override { return exited ? std::optional<std::string>("exit code 0") : std::nullopt; }
      void Terminate() override { exited = true; }
      void Kill() override { exited = true; }
      std::string LogTail(int) override { return ""; }
      std::string Describe() const override { return "idle group"; }
      bool exited = false;
    };
    return std::unique_ptr<WorkerGroup>(new Group());
  }
};

// A job directory with kBlocks blocks, nothing on disk.
class BenchWorkspace : public JobWorkspace {
 public:
  StatusOr<JobPlan> Open(const Recipe&, const v1::JobSpec& spec) override {
    JobPlan plan;
    plan.num_blocks = kBlocks;
    plan.block_finished.assign(kBlocks, false);
    plan.job_dir = JobDirOf(spec);
    return plan;
  }
  Status CheckBlock(const v1::BlockResult&) override { return absl::OkStatus(); }
  Status CheckFiles(const std::vector<v1::WrittenFile>&) override { return absl::OkStatus(); }
  Status Commit(const std::vector<v1::WrittenFile>&) override { return absl::OkStatus(); }
  Status Append(const nlohmann::json&) override { return absl::OkStatus(); }
  StatusOr<nlohmann::json> Finalize(const Recipe&, const v1::JobSpec&) override {
    return nlohmann::json::object();
  }
};

// A block result shaped like a real one (a staged shard, 7 linears with their metrics).
v1::BlockResult BlockDone(int64_t layer) {
  v1::BlockResult r;
  r.set_layer(layer);
  r.mutable_shard()->set_name("model-x.safetensors");
  r.mutable_shard()->set_staged("model-x.safetensors.t0");
  r.mutable_shard()->set_bytes(24248);
  r.mutable_shard()->set_checksum("15e0116c2a968166");
  r.set_seconds(0.0377);
  for (const char* name : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                           "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}) {
    v1::LinearMetrics* m = r.add_metrics();
    m->set_name(name);
    m->set_proxy_loss(1.2345678);
    m->set_relative(0.0456789);
    m->set_code_bits(2.0);
    m->set_stored_bits(3.5625);
    m->set_seconds(0.01234);
  }
  return r;
}

std::shared_ptr<grpc::Channel> OwnChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
  args.SetMaxReceiveMessageSize(64 << 20);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

struct Row {
  int clients;
  bool events;
  double calls_per_s, p50_us, p99_us;
  int64_t events_streamed;
};

int Main(int argc, char** argv) {
  int watchers = 100;
  double seconds = 3;
  std::vector<int> clients = {1, 4, 16};
  int events_per_s = 50;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--watchers") {
      watchers = std::atoi(value.c_str());
    } else if (flag == "--seconds") {
      seconds = std::atof(value.c_str());
    } else if (flag == "--events-per-s") {
      events_per_s = std::atoi(value.c_str());
    } else if (flag == "--clients") {
      clients.clear();
      size_t pos = 0;
      while (pos <= value.size()) {
        const size_t comma = value.find(',', pos);
        clients.push_back(std::atoi(value.substr(pos, comma - pos).c_str()));
        if (comma == std::string::npos) break;
        pos = comma + 1;
      }
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  SetLogLevel(LogLevel::kWarn);

  // A model directory that passes validation, and an RTN recipe (no calibration data).
  char tmpl[] = "/tmp/bench_rpc.XXXXXX";
  const std::string root = ::mkdtemp(tmpl);
  if (!MakeDirs(root + "/model").ok() || !WriteFileAtomic(root + "/model/config.json",
                       R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                           "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 32,
                           "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512,
                           "max_position_embeddings": 512})")
           .ok()) {
    std::fprintf(stderr, "cannot write %s\n", root.c_str());
    return 1;
  }

  auto fs = MakeLocalStateFs();
  auto store = JobStore::Open(fs.get(), root + "/state");
  if (!store.ok()) return std::fprintf(stderr, "%s\n", store.status().ToString().c_str()), 1;
  IdleLauncher launcher;
  ManagerOptions mo;
  mo.heartbeat_timeout_s = 3600;
  JobManager manager(mo, SystemClock(), &launcher,
                     [] { return std::make_unique<BenchWorkspace>(); }, std::move(*store));
  if (!manager.Start().ok()) return 1;
  ServerOptions so;
  so.listen = "127.0.0.1:0";
  so.token = kToken;
  auto server = CoordinatorServer::Start(so, &manager);
  if (!server.ok()) return std::fprintf(stderr, "%s\n", server.status().ToString().c_str()), 1;
  const std::string address = "127.0.0.1:" + std::to_string((*server)->port());
  manager.SetWorkerAddress(address);

  // The job: RUNNING, 31 of 32 blocks done, the last one held by our worker.
  v1::JobSpec spec;
  spec.set_recipe_path("rtn-4bit.yaml");
  spec.set_recipe_yaml("name: rtn-4bit\nmethod: rtn\nbits: 4\n");
  spec.set_model_dir(root + "/model");
  spec.set_out_dir(root + "/out");
  spec.set_workers(1);
  auto id = manager.Submit(spec);
  if (!id.ok()) return std::fprintf(stderr, "%s\n", id.status().ToString().c_str()), 1;
  while (manager.Get(*id)->state() != v1::JOB_STATE_RUNNING) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  v1::RegisterWorkerRequest reg;
  reg.set_job_id(*id);
  reg.set_world_size(1);
  const std::string worker = manager.RegisterWorker(reg)->worker_id();
  for (int b = 0; b < kBlocks; ++b) {
    v1::Task t = *manager.NextTask(worker);
    if (b == kBlocks - 1) break;
    v1::CompleteTaskRequest c;
    c.set_worker_id(worker);
    c.set_task_id(t.task_id());
    *c.mutable_block() = BlockDone(t.block());
    if (!manager.CompleteTask(c).ok()) return 1;
  }

  // The watchers: each stream on one of 4 connections, read on its own thread.
  std::vector<std::shared_ptr<grpc::Channel>> watch_channels;
  for (int i = 0; i < 4; ++i) watch_channels.push_back(OwnChannel(address));
  std::atomic<int64_t> streamed{0};
  std::atomic<int> open{0};
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts(watchers);
  std::vector<std::thread> watch_threads;
  for (int w = 0; w < watchers; ++w) {
    contexts[w] = std::make_unique<grpc::ClientContext>();
    rpc::AddBearerToken(contexts[w].get(), kToken);
    watch_threads.emplace_back([&, w] {
      auto stub = v1::JobService::NewStub(watch_channels[w % watch_channels.size()]);
      v1::WatchJobRequest req;
      req.set_job_id(*id);
      auto reader = stub->WatchJob(contexts[w].get(), req);
      v1::JobEvent e;
      bool counted = false;
      while (reader->Read(&e)) {
        if (!counted) {
          ++open;
          counted = true;
        }
        ++streamed;
      }
      reader->Finish();
    });
  }
  const auto open_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (open.load() < watchers && std::chrono::steady_clock::now() < open_deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (open.load() < watchers) {
    std::fprintf(stderr, "only %d of %d WatchJob streams opened\n", open.load(), watchers);
    return 1;
  }
  // Let every stream drain the job's history before measuring.
  for (int64_t seen = -1; seen != streamed.load();) {
    seen = streamed.load();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }

  v1::Job probe = *manager.Get(*id);
  std::printf("coordinator RPC benchmark: GetJob with %d WatchJob streams open (%u hardware "
              "threads)\n", watchers, std::thread::hardware_concurrency());
  std::printf("job: %d/%d blocks, GetJob answer %zu bytes; %.1f s per row\n\n",
              static_cast<int>(probe.blocks_done()), kBlocks, probe.ByteSizeLong(), seconds);
  std::printf("%8s %14s %12s %10s %10s %16s\n", "clients", "progress ev/s", "GetJob/s", "p50 us",
              "p99 us", "events streamed");

  std::vector<Row> rows;
  for (int n : clients) {
    for (bool events : {false, true}) {
      std::atomic<bool> stop{false};
      std::thread reporter;
      const int64_t streamed_before = streamed.load();
      if (events) {
        reporter = std::thread([&] {
          int64_t k = 0;
          while (!stop) {
            v1::ReportProgressRequest p;
            p.set_worker_id(worker);
            p.set_phase("quantize");
            p.set_done(++k);
            p.set_total(1000000);
            (void)manager.ReportProgress(p);
            std::this_thread::sleep_for(std::chrono::microseconds(1000000 / events_per_s));
          }
        });
      }
      std::vector<std::vector<double>> latencies(n);
      std::vector<std::thread> threads;
      const auto end = std::chrono::steady_clock::now() +
                       std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                           std::chrono::duration<double>(seconds));
      std::atomic<int> errors{0};
      for (int c = 0; c < n; ++c) {
        threads.emplace_back([&, c] {
          auto stub = v1::JobService::NewStub(OwnChannel(address));
          v1::GetJobRequest req;
          req.set_job_id(*id);
          while (std::chrono::steady_clock::now() < end) {
            grpc::ClientContext ctx;
            rpc::AddBearerToken(&ctx, kToken);
            v1::Job job;
            const auto t0 = std::chrono::steady_clock::now();
            if (!stub->GetJob(&ctx, req, &job).ok()) ++errors;
            latencies[c].push_back(
                std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                    .count());
          }
        });
      }
      for (auto& t : threads) t.join();
      stop = true;
      if (reporter.joinable()) reporter.join();
      std::vector<double> all;
      for (auto& l : latencies) all.insert(all.end(), l.begin(), l.end());
      std::sort(all.begin(), all.end());
      if (errors.load() > 0 || all.empty()) {
        std::fprintf(stderr, "%d GetJob calls failed\n", errors.load());
        return 1;
      }
      Row r{n, events, all.size() / seconds, all[all.size() / 2], all[all.size() * 99 / 100],
            streamed.load() - streamed_before};
      rows.push_back(r);
      std::printf("%8d %14d %12.0f %10.0f %10.0f %16lld\n", r.clients, events ? events_per_s : 0,
                  r.calls_per_s, r.p50_us, r.p99_us, static_cast<long long>(r.events_streamed));
      std::fflush(stdout);
    }
  }
  if (open.load() != watchers) {
    std::fprintf(stderr, "a WatchJob stream ended early\n");
    return 1;
  }

  // Cancel the job: every stream ends; shut down.
  (void)manager.Cancel(*id);
  for (auto& t : watch_threads) t.join();
  manager.Shutdown();
  (*server)->Shutdown();
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
  return 0;
}

}  // namespace
}  // namespace qcal::coordinator

int main(int argc, char** argv) { return qcal::coordinator::Main(argc, argv); }
