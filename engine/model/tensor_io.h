// Moving tensors between LibTorch and safetensors checkpoints: the one place where at::Tensor
// meets SafetensorsWriter / CheckpointReader, for every module that writes or reads shards,
// Hessian and activation caches.
//
// Readers check dtype and shape and return errors naming the tensor (callers add the file);
// writers copy the tensor's bytes (detached, on the CPU, contiguous) in the requested dtype.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/dtype.h"
#include "common/safetensors.h"
#include "common/status.h"

namespace qcal::model {

// "[4, 8]"
std::string ShapeStr(const std::vector<int64_t>& shape);

// Adds `t` as float32 / float64 (converted, detached, copied from the CPU).
Status AddF32Tensor(SafetensorsWriter* writer, const std::string& name, const at::Tensor& t);
Status AddF64Tensor(SafetensorsWriter* writer, const std::string& name, const at::Tensor& t);

// The tensor `name` with its dtype among `allowed` and shape `shape`. NotFound (from the reader,
// naming the tensor and the directory) or InvalidArgument naming the tensor.
StatusOr<std::pair<const SafetensorsFile*, const TensorInfo*>> FindChecked(
    CheckpointReader& ckpt, const std::string& name, std::initializer_list<DType> allowed,
    const std::vector<int64_t>& shape);
// An integer tensor (any signed/unsigned width) converted to int64.
StatusOr<std::vector<int64_t>> ReadInts(CheckpointReader& ckpt, const std::string& name,
                                        std::initializer_list<DType> allowed,
                                        const std::vector<int64_t>& shape);
StatusOr<std::vector<double>> ReadF64(CheckpointReader& ckpt, const std::string& name,
                                      const std::vector<int64_t>& shape);
// A float32 tensor of exactly that shape.
StatusOr<std::vector<float>> ReadF32Checked(CheckpointReader& ckpt, const std::string& name,
                                            const std::vector<int64_t>& shape);

// A 1-D float32 tensor holding a copy of v.
at::Tensor FloatTensor(const std::vector<float>& v);
// A float32 tensor's values (detached, on the CPU).
std::vector<float> ToVector(const at::Tensor& t);
// w in x's dtype and device (a no-op for float32 CPU inputs).
at::Tensor WeightLike(const at::Tensor& w, const at::Tensor& x);

}  // namespace qcal::model
