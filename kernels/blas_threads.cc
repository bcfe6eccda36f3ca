#include "kernels/blas_threads.h"

#include <dlfcn.h>

namespace qcal::kernels {

std::string PinBlasToOneThread() {
  // Looked up at run time, so the kernels do not depend on which BLAS the alternatives system
  // (or a cluster's module) put behind libblas.so.3.
  using SetThreads = void (*)(int);
  if (auto* f = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    f(1);
    return "openblas: 1 thread";
  }
  if (auto* f = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "bli_thread_set_num_threads"))) {
    f(1);
    return "blis: 1 thread";
  }
  return "no known BLAS thread control";
}

}  // namespace qcal::kernels
