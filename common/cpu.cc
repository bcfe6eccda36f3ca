#include "common/cpu.h"

#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include <algorithm>
#include <thread>

namespace qcal {

int AvailableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

void SelectBlasKernelsOrReexec(char** argv) {
#if defined(__x86_64__)
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return;
  if (setenv("OPENBLAS_CORETYPE", "Haswell", 1) != 0) return;
  execv("/proc/self/exe", argv);
  // Still here: exec failed (no /proc, say). The kernels stay what OpenBLAS chose.
  std::fprintf(stderr, "qcal: could not re-execute with OPENBLAS_CORETYPE=Haswell; BLAS runs "
                       "the kernels OpenBLAS chose for this CPU\n");
  unsetenv("OPENBLAS_CORETYPE");
#else
  (void)argv;
#endif
}

std::string BlasKernelsDescription() {
  using Query = char* (*)();
  auto core = reinterpret_cast<Query>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  auto config = reinterpret_cast<Query>(dlsym(RTLD_DEFAULT, "openblas_get_config"));
  if (core == nullptr) return "BLAS without a known kernel query";
  std::string version = "openblas";
  if (config != nullptr) {  // "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH ..."
    const std::string c = config();
    const size_t sp = c.find(' ');
    if (sp != std::string::npos) version += " " + c.substr(sp + 1, c.find(' ', sp + 1) - sp - 1);
  }
  return version + ", " + core() + " kernels";
}

}  // namespace qcal
