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
  // "halfint2", "halfint3", "halfint4", and the trellis codebooks "qtip_<code>_l<L>_k<k>"
  // (kernels/trellis.h).
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
  // How many consecutive vectors Quantize and Decode treat as one unit (1: every vector on its
  // own). A trellis codebook (kernels/trellis.h) codes joint_vectors() vectors of dim() weights
  // as one sequence: its Quantize and Decode need `count` to be a multiple of it, and the codes
  // of a vector mean something only beside the others of its unit. In a weight matrix the unit
  // is the same g-column block of joint_vectors() consecutive rows (a tile; see DecodeMatrix).
  virtual int joint_vectors() const { return 1; }
  // OK if a weight matrix of `rows` rows can be coded (a joint codebook's last, partial unit may
  // have a lower limit); InvalidArgument naming the limit otherwise.
  virtual Status CheckRows(int64_t rows) const { return absl::OkStatus(); }
};

// The points of a coded weight matrix [rows, cols] (cols a multiple of dim(); CheckRows(rows)
// OK), from codes [rows, cols / dim(), code_words()] as BlockLDLQ stores them. Codebooks whose
// vectors stand alone decode each row's vectors in place; joint codebooks decode each g-column
// block of joint_vectors() consecutive rows (fewer in the last) as one unit.
void DecodeMatrix(const VectorCodebook& cb, const uint32_t* codes, int64_t rows, int64_t cols,
                  float* out);

// Builds a codebook by name (see VectorCodebook::name); InvalidArgument for unknown names.
StatusOr<std::unique_ptr<VectorCodebook>> MakeCodebook(const std::string& name);

}  // namespace qcal::kernels
