// The main of every GoogleTest binary (but the MPI ones, which have their own): the BLAS kernels
// are chosen as qcal's programs choose them (common/cpu.h SelectBlasKernelsOrReexec: Haswell on
// every x86-64 CPU with AVX2 and FMA unless OPENBLAS_CORETYPE is set), so a test computes the
// bits the product computes on the same machine. Without it, a CPU newer than Debian's OpenBLAS
// (Sapphire Rapids) runs the Prescott fallback in tests only, and the tests' measured numbers
// (thresholds set on Haswell kernels) drift.
#include <gtest/gtest.h>

#include "common/cpu.h"

int main(int argc, char** argv) {
  qcal::SelectBlasKernelsOrReexec(argv);  // first: before BLAS or threads start
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
