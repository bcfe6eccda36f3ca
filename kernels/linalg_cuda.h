// fp64 Cholesky on a CUDA device through cuSOLVER (the GPU counterpart of CholeskyInPlace in
// kernels/linalg.h, same layout and contract): the factor every rounding method starts from
// (GPTQ's inverse factor, LDLQ's and BlockLDLQ's (block) LDL are derived from it).
#pragma once

#include <cstdint>

#include "common/status.h"

namespace qcal::kernels {

// In place on a device matrix a [n, n] row-major, symmetric positive definite (its lower
// triangle is read): on success a holds C (lower triangle, H = C Cᵀ), strict upper triangle
// zeroed. FailedPrecondition naming the pivot when the matrix is not positive definite (suggests
// damping, as the CPU version does). Synchronizes `stream` (to read cuSOLVER's status).
Status CholeskyCuda(double* a, int64_t n, void* stream);

// In place: a (device, [n, n] row-major, SPD) becomes GPTQ's inverse factor R (upper, H⁻¹ = RᵀR),
// computed as InverseCholeskyUpper (kernels/linalg.h) does: R = P C'⁻¹ P with C' = chol(P H P)
// (cuSOLVER potrf and trtri). Strict lower triangle zero. FailedPrecondition as CholeskyCuda.
Status InverseCholeskyUpperCuda(double* a, int64_t n, void* stream);

}  // namespace qcal::kernels
