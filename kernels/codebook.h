// Vector codebooks: the rounding targets of BlockLDLQ and the RVQ stages.
//
// A codebook quantizes vectors of dim() weights (8 for the E8 family, 1 for scalar grids) at unit
// scale: callers normalise weights (e.g. to unit RMS) and multiply by the scale afterwards. Each
// vector is encoded as code_words() unsigned words (one per RVQ stage; a 16-bit E8P code, an
// 8-bit E8 index, a k-bit grid index), so codes for `count` vectors occupy count * code_words()
// entries. Encoders are exact nearest-point searches unless the codebook says otherwise.
//
// Thread-safety: codebooks are immutable after construction; Quantize/Decode may be called from
// many threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

namespace qcal::kernels {

class VectorCodebook {
 public:
  virtual ~VectorCodebook() = default;
  // Short name used in recipes and checkpoints: "e8p", "e8_1bit", "rvq3_e8p_e8", "rvq4_e8p_e8p",
  // "halfint2", "halfint3", "halfint4".
  virtual std::string name() const = 0;
  virtual int dim() const = 0;
  virtual int code_words() const = 0;
  // Bits per weight of the codes (not counting scales): 2 for E8P, 3 for E8P+E8, ...
  virtual double bits_per_weight() const = 0;
  // The multiplier the codebook expects on unit-RMS input (E8P: about 1.03, see
  // ../shared/reference/e8p-codebook.md); callers may sweep their own.
  virtual double default_scale() const = 0;
  // x: [count, dim()] row-major. out (may alias x): the nearest codebook points, [count, dim()].
  // codes: [count, code_words()] or nullptr.
  virtual void Quantize(const float* x, int64_t count, float* out, uint32_t* codes) const = 0;
  // codes: [count, code_words()] -> out [count, dim()].
  virtual void Decode(const uint32_t* codes, int64_t count, float* out) const = 0;
};

// Builds a codebook by name (see VectorCodebook::name); InvalidArgument for unknown names.
StatusOr<std::unique_ptr<VectorCodebook>> MakeCodebook(const std::string& name);

}  // namespace qcal::kernels
