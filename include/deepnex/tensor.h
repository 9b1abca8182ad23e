// Dtypes and non-owning tensor views, the currency between deepnex's parts.
#ifndef DEEPNEX_TENSOR_H_
#define DEEPNEX_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
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

// Bytes per element of `dtype` (0 for a value outside the enum).
size_t DTypeSize(DType dtype);
// "float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8";
// "invalid" for a value outside the enum.
const char* DTypeName(DType dtype);
// Inverse of DTypeName: exactly the names above. Numpy's short names ("f4",
// "<f4") and buffer formats are not accepted; bindings map those themselves.
// InvalidArgument naming the text for anything else.
absl::StatusOr<DType> ParseDType(const std::string& name);
bool IsValidDType(int value);
bool IsFloatingPoint(DType dtype);

// IEEE half and bfloat16 conversions. Narrowing rounds to nearest even,
// overflows to infinity, and keeps infinities and NaNs (a NaN stays a NaN).
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

  // Product of the shape (1 for a scalar); meaningful only for a shape that
  // passes CheckShape.
  int64_t NumElements() const;
  size_t NumBytes() const { return NumElements() * DTypeSize(dtype); }
  // InvalidArgument "<what>: negative dimension D in [..] dtype", or a shape
  // whose bytes pass 2^63; every call that takes a tensor checks it first.
  absl::Status CheckShape(const std::string& what) const;
};

// "[4, 3] float32"; a scalar is "[] float32".
std::string DescribeShape(const std::vector<int64_t>& shape, DType dtype);

}  // namespace deepnex

#endif  // DEEPNEX_TENSOR_H_
