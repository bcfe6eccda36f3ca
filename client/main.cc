// qcal: the command-line tool.
#include <CLI/CLI.hpp>

#include "client/model_commands.h"
#include "client/quantize_command.h"
#include "client/service_commands.h"
#include "client/slurm_command.h"
#include "client/tool_commands.h"
#include "common/cpu.h"
#include "common/log.h"

int main(int argc, char** argv) {
  qcal::SelectBlasKernelsOrReexec(argv);  // first: before BLAS, threads or MPI start
  CLI::App app{"qcal: quantize Llama-family models (QuIP#, QuaRot, GPTQ, RTN)"};
  app.require_subcommand(1);
  std::string log_level = "warn";
  app.add_option("--log-level", log_level, "debug, info, warn, error, off")
      ->capture_default_str();
  int exit_code = 0;
  app.parse_complete_callback([&] {
    qcal::SetLogLevel(qcal::ParseLogLevel(log_level));
    QCAL_LOG_INFO("BLAS: {}", qcal::BlasKernelsDescription());
  });
  qcal::client::AddModelCommands(app, &exit_code);
  qcal::client::AddQuantizeCommand(app, &exit_code);
  qcal::client::AddServiceCommands(app, &exit_code);
  qcal::client::AddSlurmCommand(app, &exit_code);
  qcal::client::AddToolCommands(app, &exit_code);
  CLI11_PARSE(app, argc, argv);
  return exit_code;
}
