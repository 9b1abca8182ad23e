#include "deepnex/tensor.h"

#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace deepnex {
namespace {

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

constexpr DType kAllDTypes[] = {
    DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
    DType::kInt32,   DType::kInt64,   DType::kUInt8};

}  // namespace

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kUInt8:
      return 1;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kUInt8:
      return "uint8";
  }
  return "invalid";
}

absl::StatusOr<DType> ParseDType(const std::string& name) {
  for (DType d : kAllDTypes) {
    if (name == DTypeName(d)) return d;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "dtype \"", absl::CEscape(name),
      "\" is unknown (use float32, float64, float16, bfloat16, int32, int64 "
      "or uint8)"));
}

bool IsValidDType(int value) {
  return value >= static_cast<int>(DType::kFloat32) &&
         value <= static_cast<int>(DType::kUInt8);
}

bool IsFloatingPoint(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat64 ||
         dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

float HalfToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F;
  uint32_t mantissa = h & 0x3FF;
  if (exponent == 0x1F) {  // Inf, or NaN with its payload kept
    return BitsFloat(sign | 0x7F800000u | (mantissa << 13));
  }
  if (exponent == 0) {
    if (mantissa == 0) return BitsFloat(sign);  // +-0
    // Subnormal: normalise; every half subnormal is a float normal.
    int e = -14;
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      --e;
    }
    mantissa &= 0x3FF;
    return BitsFloat(sign | static_cast<uint32_t>(e + 127) << 23 |
                     (mantissa << 13));
  }
  return BitsFloat(sign | (exponent + 112) << 23 | (mantissa << 13));
}

uint16_t FloatToHalf(float f) {
  uint32_t x = FloatBits(f);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  uint32_t abs = x & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) {
    // NaN: keep the top payload bits and make it quiet, so it stays a NaN.
    return sign | 0x7E00 | static_cast<uint16_t>((abs >> 13) & 0x3FF);
  }
  // 65520 is halfway between the largest half (65504) and 2^16; ties go to
  // the even neighbour, which is infinity.
  if (abs >= 0x477FF000u) return sign | 0x7C00;
  if (abs >= 0x38800000u) {  // a half normal (>= 2^-14)
    uint32_t odd = (abs >> 13) & 1;
    // Rebias the exponent (127 -> 15) and round to nearest even; a carry out
    // of the mantissa correctly bumps the exponent.
    abs += 0xC8000FFFu + odd;
    return sign | static_cast<uint16_t>(abs >> 13);
  }
  // Subnormal or zero: adding 0.5f aligns the value so that the FPU's
  // round-to-nearest-even leaves the half mantissa in the low bits.
  float aligned = BitsFloat(abs) + 0.5f;
  return sign | static_cast<uint16_t>(FloatBits(aligned) - 0x3F000000u);
}

float BFloat16ToFloat(uint16_t b) {
  return BitsFloat(static_cast<uint32_t>(b) << 16);
}

uint16_t FloatToBFloat16(float f) {
  uint32_t x = FloatBits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<uint16_t>((x >> 16) | 0x0040);  // quiet NaN
  }
  uint32_t rounding = 0x7FFF + ((x >> 16) & 1);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

int64_t TensorView::NumElements() const {
  uint64_t n = 1;  // unsigned: a bad shape wraps instead of being undefined
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return static_cast<int64_t>(n);
}

absl::Status TensorView::CheckShape(const std::string& what) const {
  int64_t bytes = static_cast<int64_t>(DTypeSize(dtype));
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": negative dimension ", d, " in ", DescribeShape(shape, dtype)));
    }
    if (__builtin_mul_overflow(bytes, d, &bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": ", DescribeShape(shape, dtype), " is more than 2^63 bytes"));
    }
  }
  return absl::OkStatus();
}

std::string DescribeShape(const std::vector<int64_t>& shape, DType dtype) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "] ", DTypeName(dtype));
}

}  // namespace deepnex
