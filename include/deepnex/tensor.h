// Dtypes and non-owning tensor views, the currency between deepnex's parts.
#ifndef DEEPNEX_TENSOR_H_
#define DEEPNEX_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "deepnex/status.h"

namespace deepnex {

// Values are part of the wire format (proto enums use the same numbers).
enum class DType : int {
  kFloat32 = 1,
  kFloat64 = 2,
  kFloat16 = 3,
  kBFloat16 = 4,
  kInt32 = 5,
  kInt64 = 6,
  kUInt8 = 7,
};

// Bytes per element of `dtype`.
size_t DTypeSize(DType dtype);
// "float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8".
const char* DTypeName(DType dtype);
// Inverse of DTypeName; also accepts numpy's short names ("f4", "<f4", ...)
// is not its job: bindings map buffer formats themselves.
absl::StatusOr<DType> ParseDType(const std::string& name);
bool IsValidDType(int value);
bool IsFloatingPoint(DType dtype);

// IEEE half and bfloat16 conversions (round to nearest even).
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

// A non-owning view of contiguous, row-major tensor data.
// The caller keeps `data` alive and unchanged while deepnex uses the view.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;

  TensorView() = default;
  TensorView(void* data, DType dtype, std::vector<int64_t> shape)
      : data(data), dtype(dtype), shape(std::move(shape)) {}

  // Product of the shape (1 for a scalar).
  int64_t NumElements() const;
  size_t NumBytes() const { return NumElements() * DTypeSize(dtype); }
};

// "[4, 3] float32"
std::string DescribeShape(const std::vector<int64_t>& shape, DType dtype);

}  // namespace deepnex

#endif  // DEEPNEX_TENSOR_H_
