#include "kernels/blas_threads.h"

#include <dlfcn.h>

#include <string>

namespace qcal::kernels {

std::string PinBlasToOneThread() { return SetBlasThreads(1); }

std::string SetBlasThreads(int threads) {
  // Looked up at run time, so the kernels do not depend on which BLAS the alternatives system
  // (or a cluster's module) put behind libblas.so.3.
  using SetThreads = void (*)(int);
  if (auto* f = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    f(threads);
    return "openblas: " + std::to_string(threads) + (threads == 1 ? " thread" : " threads");
  }
  if (auto* f = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "bli_thread_set_num_threads"))) {
    f(threads);
    return "blis: " + std::to_string(threads) + (threads == 1 ? " thread" : " threads");
  }
  return "no known BLAS thread control";
}

}  // namespace qcal::kernels
