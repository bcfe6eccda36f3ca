// The CPUs this process may run on.
#pragma once

namespace qcal {

// Number of CPUs in this process's affinity mask (what mpirun's or Slurm's binding leaves it),
// at least 1; std::thread::hardware_concurrency() counts every online CPU instead, so a rank
// bound to one core would start as many threads as the machine has. Used only to size thread
// pools: no numeric result depends on it (docs/architecture.md, "Determinism").
int AvailableCpus();

}  // namespace qcal
