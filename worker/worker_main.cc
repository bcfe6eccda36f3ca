// qcal-worker: one MPI rank of a service job. Launched by the coordinator (mpirun -np N):
//
//   qcal-worker --coordinator HOST:PORT --job JOB_ID --auth-token-file F [--tls-ca F] [--threads N]
//
// Every rank initialises MPI, registers with the coordinator (which answers with the JobSpec),
// sends heartbeats, and runs tasks (worker/task_loop.h) with an MpiComm over
// MPI_COMM_WORLD until SHUTDOWN (exit 0). A cancelled job or a lost coordinator ends the process
// at once with exit code 3 / 4 (mpirun then stops the other ranks); a loop error ends every
// rank through MPI_Abort with exit code 1.
#include <mpi.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "common/cli.h"
#include "common/cpu.h"
#include "common/log.h"
#include "kernels/device_select.h"
#include "rpc/auth.h"
#include "worker/coordinator_client.h"
#include "engine/comm/mpi_comm.h"
#include "worker/task_loop.h"
#if defined(QCAL_WORKER_NCCL)
#include "engine/comm/nccl_comm.h"
#endif

int main(int argc, char** argv) {
  qcal::SelectBlasKernelsOrReexec(argv);  // first: before BLAS, threads or MPI start
  CLI::App app{"qcal-worker: one MPI rank of a qcal quantization service job"};
  std::string coordinator_address, job_id, token_file, tls_ca, tls_cert, tls_key;
  std::string log_level = "info", log_file;
  int threads = 0;
  app.add_option("--coordinator", coordinator_address, "coordinator address HOST:PORT")->required();
  app.add_option("--job", job_id, "the job this worker serves")->required();
  app.add_option("--auth-token-file", token_file, "file holding the bearer token")->required();
  app.add_option("--tls-ca", tls_ca, "CA certificate for a TLS coordinator (default plaintext)");
  app.add_option("--tls-cert", tls_cert, "client certificate, for a coordinator that requires one");
  app.add_option("--tls-key", tls_key, "private key of --tls-cert");
  app.add_option("--threads", threads, "compute threads (default: the job's setting)")
      ->check(CLI::Range(0, qcal::kMaxThreads));
  std::string device = "auto";
  app.add_option("--device", device,
                 "compute device: auto (a local GPU by the rank's local index, else the CPU), "
                 "cpu, cuda, cuda:N");
  app.add_option("--log-level", log_level, "debug, info, warn, error");
  app.add_option("--log-file", log_file, "also log to this file");
  CLI11_PARSE(app, argc, argv);
  qcal::SetLogLevel(qcal::ParseLogLevel(log_level));
  if (!log_file.empty()) qcal::SetLogFile(log_file);

  // Only the main thread makes MPI calls (the heartbeat thread talks gRPC only).
  int provided = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
    std::fprintf(stderr, "qcal-worker: MPI_Init_thread failed\n");
    return 1;
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  auto fail = [&](const qcal::Status& status) {
    QCAL_LOG_ERROR("qcal-worker rank {}: {}", rank, status.ToString());
    std::fflush(nullptr);
    MPI_Abort(MPI_COMM_WORLD, 1);  // the other ranks may be inside a collective
    return 1;
  };

  auto token = qcal::rpc::ReadTokenFile(token_file);
  if (!token.ok()) return fail(token.status());
  qcal::rpc::ClientTls tls;
  tls.ca_file = tls_ca;
  tls.cert_file = tls_cert;
  tls.key_file = tls_key;
  if (tls_cert.empty() != tls_key.empty() || (!tls_cert.empty() && tls_ca.empty())) {
    return fail(absl::InvalidArgumentError(
        "--tls-cert and --tls-key go together, and need --tls-ca (a TLS coordinator)"));
  }
  auto channel = qcal::rpc::MakeChannel(coordinator_address, tls);
  if (!channel.ok()) return fail(channel.status());
  auto client = qcal::worker::MakeGrpcCoordinatorClient(*channel, *token);
  auto comm = qcal::comm::MakeMpiComm(MPI_COMM_WORLD);
  if (!comm.ok()) return fail(comm.status());

  auto selected = qcal::kernels::SelectComputeDevice(device);
  if (!selected.ok()) return fail(selected.status());
  QCAL_LOG_INFO("qcal-worker rank {}: device {}; BLAS {}", rank, *selected,
                qcal::BlasKernelsDescription());

  qcal::worker::TaskLoopOptions options;
  options.job_id = job_id;
  options.device = *selected;
  // GPU ranks reduce device-resident data (the Hessian sums) with NCCL; control and host data
  // stay on MPI. Every rank must join ncclCommInitRank or none, so the ranks agree first; a
  // world with CPU ranks among GPU ones reduces everything on the hosts.
  std::unique_ptr<qcal::comm::Comm> device_comm;
  {
    int64_t gpus = qcal::kernels::SelectedCudaDevice() >= 0 ? 1 : 0;
    if (auto s = (*comm)->AllReduceSum(&gpus, 1); !s.ok()) return fail(s);
    const int world = (*comm)->size();
#if defined(QCAL_WORKER_NCCL)
    if (world > 1 && gpus == world) {
      auto nccl = qcal::comm::MakeNcclComm(MPI_COMM_WORLD, qcal::kernels::SelectedCudaDevice());
      if (!nccl.ok()) return fail(nccl.status());
      device_comm = std::move(*nccl);
      options.device_sum = [c = device_comm.get()](int64_t* data, size_t count) {
        return c->AllReduceSum(data, count);
      };
      QCAL_LOG_INFO("qcal-worker rank {}: NCCL for device data, MPI for control", rank);
    }
#endif
    if (world > 1 && gpus > 0 && !options.device_sum) {
      QCAL_LOG_WARN("qcal-worker rank {}: {} of {} ranks have a GPU{}; device sums are reduced "
                    "on the hosts over MPI", rank, gpus, world,
#if defined(QCAL_WORKER_NCCL)
                    ""
#else
                    " and this build has no NCCL"
#endif
      );
    }
  }
  options.threads = threads;
  // Called from the heartbeat thread: leave at once, without MPI (mpirun stops the others).
  options.on_cancelled = [rank] {
    QCAL_LOG_WARN("qcal-worker rank {}: job cancelled, exiting", rank);
    qcal::Logger().flush();
    std::_Exit(3);
  };
  options.on_lost = [rank] {
    QCAL_LOG_ERROR("qcal-worker rank {}: coordinator unreachable, exiting", rank);
    qcal::Logger().flush();
    std::_Exit(4);
  };
  auto result = qcal::worker::RunTaskLoop(*client, **comm, options);
  if (!result.ok()) {
    if (absl::IsCancelled(result.status())) {
      qcal::Logger().flush();
      std::_Exit(3);
    }
    return fail(result.status());
  }
  QCAL_LOG_INFO("qcal-worker rank {}: {} tasks done ({} blocks), {} failed; {}", rank,
                result->tasks_completed, result->blocks_quantized, result->tasks_failed,
                result->shutdown_reason);
  device_comm.reset();  // NCCL before MPI
  comm->reset();
  MPI_Finalize();
  return 0;
}
