// Batched exact E8P nearest-point encoding on a CUDA device (QuIP#'s 2-bit lattice codebook).
//
// The same codes as the CPU encoder E8pCodebook::EncodeOne (kernels/e8p.h) for the same input,
// bit for bit, ties included. One thread per 8-vector runs the CPU's algorithm: the nearest point
// of each shifted coset D̂8 ± 1/4 (Conway & Sloane's D8 decoder) decides when it is a codebook
// point, unique, and nearer than the other shift by a clear margin; otherwise the exact scan of
// 2 shifts × 256 source rows (EncodeOneByScan) decides, with the same double-precision operations
// in the same order (explicitly rounded: no fused multiply-adds), the same minimum, the same
// smallest-code tie rule and parity repair. Decoded points are the CPU's floats. Non-finite
// input gives code 0, as on the CPU.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace qcal::kernels {

// x: device pointer to count·8 floats (unit-scale coordinates, as E8pCodebook::Quantize takes).
// codes: device, count uint32 (16-bit codes in the low bits, as Quantize writes them).
// out: device, count·8 floats of decoded points, or nullptr. Enqueued on `stream` (cudaStream_t).
Status E8pEncodeCuda(const float* x, int64_t count, uint32_t* codes, float* out, void* stream);

}  // namespace qcal::kernels
