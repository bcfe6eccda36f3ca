// `qcal slurm-script`: an sbatch script for one quantization job, from the templates in slurm/
// (qcal-gpu.sbatch.in, qcal-cpu.sbatch.in; embedded at build time). The script runs `qcal run
// --launcher srun --state STATE` in the allocation: the coordinator on the batch host, one job
// step of workers, requeue on USR1 before the time limit, resume from the journal on restart.
// docs/slurm.md explains the templates and every option.
#pragma once

#include <map>
#include <string>

#include "common/status.h"

namespace CLI {
class App;
}

namespace qcal::client {

struct SlurmScriptOptions {
  std::string recipe, model_dir, out_dir;
  std::string state_dir;       // default: OUT.service (a shared filesystem: it must be
                               // readable from the batch host of every restart)
  std::string data_root;
  bool cpu = false;            // the CPU template (no --gpus-per-task)
  int nodes = 1;
  int tasks_per_node = 8;      // ranks per node (one per GPU)
  int cpus_per_task = 8;       // worker threads per rank
  std::string time = "24:00:00";
  std::string partition, account, qos, job_name;
  int signal_lead_s = 600;     // USR1 this long before the time limit
  std::string qcal_binary;     // default: this executable
  int calib_batch = 0;
  int experts_per_task = 0;  // run's --experts-per-task (0: its default)
  bool eval = false;           // add the evaluation phase (run by the workers)
};

// The filled script, or InvalidArgument naming the bad option. `templ` holds @NAME@ fields.
StatusOr<std::string> FillSlurmTemplate(const std::string& templ,
                                        const std::map<std::string, std::string>& fields);
StatusOr<std::string> MakeSlurmScript(const SlurmScriptOptions& options);

void AddSlurmCommand(CLI::App& app, int* exit_code);

}  // namespace qcal::client
