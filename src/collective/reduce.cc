// Built with -O3 (see src/CMakeLists.txt) so that GCC vectorises these loops;
// loads and stores go through memcpy, which the vectoriser turns into
// unaligned vector moves, because shared-memory and socket buffers give no
// alignment guarantee.
#include "collective/reduce.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace deepnex::collective {
namespace {

struct Sum {
  template <typename T>
  static T Apply(T a, T b) { return a + b; }
};
struct Prod {
  template <typename T>
  static T Apply(T a, T b) { return a * b; }
};
// A NaN on either side wins, as torch.maximum and numpy.maximum have it
// (b != b only for a NaN): otherwise the result depended on which rank
// held the NaN.
struct Max {
  template <typename T>
  static T Apply(T a, T b) { return a < b || b != b ? b : a; }
};
struct Min {
  template <typename T>
  static T Apply(T a, T b) { return b < a || b != b ? b : a; }
};

template <typename T, typename Op>
void Loop(char* __restrict dst, const char* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    T a, b;
    std::memcpy(&a, dst + i * sizeof(T), sizeof(T));
    std::memcpy(&b, src + i * sizeof(T), sizeof(T));
    a = Op::Apply(a, b);
    std::memcpy(dst + i * sizeof(T), &a, sizeof(T));
  }
}

inline float Bf16ToFloat(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;  // quiet the NaN, keep the sign
  bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(is_nan ? nan : rounded);
}

template <typename Op>
void LoopBf16(char* __restrict dst, const char* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint16_t a, b;
    std::memcpy(&a, dst + 2 * i, 2);
    std::memcpy(&b, src + 2 * i, 2);
    uint16_t r = FloatToBf16(Op::Apply(Bf16ToFloat(a), Bf16ToFloat(b)));
    std::memcpy(dst + 2 * i, &r, 2);
  }
}

template <typename Op>
void LoopHalfScalar(char* dst, const char* src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint16_t a, b;
    std::memcpy(&a, dst + 2 * i, 2);
    std::memcpy(&b, src + 2 * i, 2);
    uint16_t r = FloatToHalf(Op::Apply(HalfToFloat(a), HalfToFloat(b)));
    std::memcpy(dst + 2 * i, &r, 2);
  }
}

#if defined(__x86_64__)
template <typename Op>
__attribute__((target("avx,f16c"))) void LoopHalfF16c(char* dst, const char* src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dst + 2 * i)));
    __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i)));
    __m256 r;
    if constexpr (std::is_same_v<Op, Sum>) r = _mm256_add_ps(a, b);
    else if constexpr (std::is_same_v<Op, Prod>) r = _mm256_mul_ps(a, b);
    else if constexpr (std::is_same_v<Op, Max>) r = _mm256_max_ps(b, a);
    else r = _mm256_min_ps(b, a);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i),
                     _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT));
  }
  LoopHalfScalar<Op>(dst + 2 * i, src + 2 * i, n - i);
}
bool HasF16c() {
  static const bool has = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return has;
}
#endif

template <typename Op>
void LoopHalf(char* dst, const char* src, size_t n) {
#if defined(__x86_64__)
  if (HasF16c()) return LoopHalfF16c<Op>(dst, src, n);
#endif
  LoopHalfScalar<Op>(dst, src, n);
}

template <typename Op>
void Dispatch(DType dtype, char* dst, const char* src, size_t n) {
  switch (dtype) {
    case DType::kFloat32: return Loop<float, Op>(dst, src, n);
    case DType::kFloat64: return Loop<double, Op>(dst, src, n);
    case DType::kInt32: return Loop<int32_t, Op>(dst, src, n);
    case DType::kInt64: return Loop<int64_t, Op>(dst, src, n);
    case DType::kUInt8: return Loop<uint8_t, Op>(dst, src, n);
    case DType::kBFloat16: return LoopBf16<Op>(dst, src, n);
    case DType::kFloat16: return LoopHalf<Op>(dst, src, n);
  }
}

template <typename T>
void DivideLoop(char* dst, size_t n, T divisor) {
  for (size_t i = 0; i < n; ++i) {
    T a;
    std::memcpy(&a, dst + i * sizeof(T), sizeof(T));
    a = a / divisor;
    std::memcpy(dst + i * sizeof(T), &a, sizeof(T));
  }
}

}  // namespace

void ReduceInto(DType dtype, ReduceOp op, char* dst, const char* src, size_t n) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean: return Dispatch<Sum>(dtype, dst, src, n);
    case ReduceOp::kProd: return Dispatch<Prod>(dtype, dst, src, n);
    case ReduceOp::kMax: return Dispatch<Max>(dtype, dst, src, n);
    case ReduceOp::kMin: return Dispatch<Min>(dtype, dst, src, n);
  }
}

void DivideInPlace(DType dtype, char* dst, size_t n, int divisor) {
  switch (dtype) {
    case DType::kFloat32: return DivideLoop<float>(dst, n, static_cast<float>(divisor));
    case DType::kFloat64: return DivideLoop<double>(dst, n, static_cast<double>(divisor));
    case DType::kInt32: return DivideLoop<int32_t>(dst, n, divisor);
    case DType::kInt64: return DivideLoop<int64_t>(dst, n, divisor);
    case DType::kUInt8: return DivideLoop<uint8_t>(dst, n, static_cast<uint8_t>(divisor));
    case DType::kBFloat16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t a;
        std::memcpy(&a, dst + 2 * i, 2);
        a = FloatToBf16(Bf16ToFloat(a) / static_cast<float>(divisor));
        std::memcpy(dst + 2 * i, &a, 2);
      }
      return;
    case DType::kFloat16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t a;
        std::memcpy(&a, dst + 2 * i, 2);
        a = FloatToHalf(HalfToFloat(a) / static_cast<float>(divisor));
        std::memcpy(dst + 2 * i, &a, 2);
      }
      return;
  }
}

}  // namespace deepnex::collective
