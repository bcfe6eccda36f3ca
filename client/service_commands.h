// Service commands of the qcal CLI: they talk to a coordinator (qcal-coordinator) over gRPC.
//
//   qcal submit RECIPE --model DIR --out DIR [--workers N] [--eval] [--watch]   → job id
//   qcal status JOB | watch JOB | cancel JOB | list                    (--json everywhere)
//   qcal run RECIPE --model DIR --out DIR [--workers N]
//       starts a private coordinator (free port, fresh random token, temporary state directory
//       unless --state) and N MPI workers, submits with the evaluation phase, watches with a
//       progress bar, prints the per-block table and the float and quantized perplexities the
//       workers computed, and exits with the job's status.
//
// None of these load a model: the workers do every computation, so they work against a remote
// cluster the same way (this code links no LibTorch: target qcal_client_service).
//
// Connection flags: --coordinator HOST:PORT (env QCAL_COORDINATOR, default 127.0.0.1:50051),
// --auth-token-file F (env QCAL_AUTH_TOKEN_FILE), --tls-ca F [--tls-cert F --tls-key F].
// Exit codes of watch / run / submit --watch: 0 SUCCEEDED, 1 FAILED (or any error),
// 2 CANCELLED; qcal run also 3: stopped by SIGTERM with --state, the job resumes when qcal run
// is started again on that state directory.
#pragma once

namespace CLI {
class App;
}

namespace qcal::client {

// Registers submit, status, watch, cancel, list and run on `app`; the callbacks store their exit
// code in *exit_code.
void AddServiceCommands(CLI::App& app, int* exit_code);

}  // namespace qcal::client
