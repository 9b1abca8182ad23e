// How a partition reads the values a push carries: in place from the
// received bytes where it can, as the compute type (float for float32,
// float16 and bfloat16, double for float64), and how it finds NaN and Inf in
// them. Private to the parameter server: ps/partition.cc (built with -O3
// for these loops) and the client, which checks pushes with AnyNonFiniteAt.
#ifndef DEEPNEX_PS_VALUES_H_
#define DEEPNEX_PS_VALUES_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "core/grpc_util.h"
#include "deepnex/tensor.h"

namespace deepnex::ps {

// Gradients are read in chunks small enough to stay in cache.
constexpr size_t kChunkElems = 16384;

// Converts `n` elements stored as `dtype` into the compute type T.
template <typename T>
void ToCompute(DType dtype, const char* src, T* dst, size_t n) {
  switch (dtype) {
    case DType::kFloat16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = HalfToFloat(h);
      }
      return;
    case DType::kBFloat16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        dst[i] = BFloat16ToFloat(b);
      }
      return;
    default:  // float32 into float, float64 into double
      std::memcpy(dst, src, n * sizeof(T));
  }
}

template <typename T>
void FromCompute(DType dtype, const T* src, char* dst, size_t n) {
  switch (dtype) {
    case DType::kFloat16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h = FloatToHalf(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    case DType::kBFloat16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t b = FloatToBFloat16(src[i]);
        std::memcpy(dst + 2 * i, &b, 2);
      }
      return;
    default:
      std::memcpy(dst, src, n * sizeof(T));
  }
}

using Bits64 = uint64_t;

// NaN and Inf are the values whose exponent bits are all ones.
template <typename Bits>
bool NonFinite(const char* p, Bits exponent) {
  Bits b;
  std::memcpy(&b, p, sizeof(Bits));
  return (b & exponent) == exponent;
}

// Whether any of `n` elements at `p` is NaN or Inf. A value is when its
// bits less the sign reach the exponent mask, that is when adding the
// exponent's lowest bit carries into the sign bit. The sums are OR-ed in
// four 16-byte vectors (GCC's vector extension: SSE2 on x86-64, NEON on
// Arm), each named so that it stays in a register: kept in an array (of
// lanes or of vectors), GCC at -O2 left them in memory, and the check ran
// at 20 GB/s in cache where this one runs at 45.
template <typename Bits>
bool AnyNonFinite(const char* p, size_t n, Bits exponent) {
  typedef Bits Vec __attribute__((vector_size(16)));
  constexpr size_t kPerVec = sizeof(Vec) / sizeof(Bits);
  constexpr Bits kSign = static_cast<Bits>(Bits(1) << (8 * sizeof(Bits) - 1));
  const Bits magnitude = static_cast<Bits>(~kSign);
  const Bits low = static_cast<Bits>(exponent & (~exponent + 1));
  Vec a0 = {}, a1 = {}, a2 = {}, a3 = {};
  size_t i = 0;
  for (; i + 4 * kPerVec <= n; i += 4 * kPerVec) {
    Vec b[4];
    std::memcpy(b, p + i * sizeof(Bits), sizeof(b));
    a0 |= (b[0] & magnitude) + low;
    a1 |= (b[1] & magnitude) + low;
    a2 |= (b[2] & magnitude) + low;
    a3 |= (b[3] & magnitude) + low;
  }
  const Vec all = a0 | a1 | a2 | a3;
  Bits any = 0;
  for (size_t k = 0; k < kPerVec; ++k) any |= all[k];
  for (; i < n; ++i) {
    Bits b;
    std::memcpy(&b, p + i * sizeof(Bits), sizeof(Bits));
    any |= static_cast<Bits>((b & magnitude) + low);
  }
  return (any & kSign) != 0;
}

inline Bits64 ExponentMask(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return 0x7ff0000000000000ull;
    case DType::kFloat16: return 0x7c00;
    case DType::kBFloat16: return 0x7f80;
    default: return 0x7f800000u;
  }
}

inline bool NonFiniteAt(DType dtype, const char* p) {
  switch (DTypeSize(dtype)) {
    case 8: return NonFinite<uint64_t>(p, ExponentMask(dtype));
    case 2: return NonFinite<uint16_t>(p, static_cast<uint16_t>(ExponentMask(dtype)));
    default: return NonFinite<uint32_t>(p, static_cast<uint32_t>(ExponentMask(dtype)));
  }
}

inline bool AnyNonFiniteAt(DType dtype, const char* p, size_t n) {
  switch (DTypeSize(dtype)) {
    case 8: return AnyNonFinite<uint64_t>(p, n, ExponentMask(dtype));
    case 2: return AnyNonFinite<uint16_t>(p, n, static_cast<uint16_t>(ExponentMask(dtype)));
    default: return AnyNonFinite<uint32_t>(p, n, static_cast<uint32_t>(ExponentMask(dtype)));
  }
}

// Whether any of `n` compute-type values is NaN or Inf; -1 if none, else
// the first one's index.
template <typename T>
int64_t FirstNonFinite(const T* v, size_t n) {
  using Bits = std::conditional_t<sizeof(T) == 8, uint64_t, uint32_t>;
  const Bits exponent = sizeof(T) == 8 ? 0x7ff0000000000000ull : 0x7f800000u;
  const char* p = reinterpret_cast<const char*>(v);
  if (!AnyNonFinite<Bits>(p, n, exponent)) return -1;
  for (size_t i = 0; i < n; ++i) {
    if (NonFinite<Bits>(p + i * sizeof(T), exponent)) return static_cast<int64_t>(i);
  }
  return -1;
}

// Reads the next `count` elements of `payload` as T and calls
// fn(values, first_element, n) for runs of at most kChunkElems elements.
// Stored as the compute type (float32 as float, float64 as double), the runs
// point into the received bytes themselves: no staging copy, one pass.
// Other dtypes (and an element split across two spans, or a span not
// aligned for T) go through a staging chunk. With `check`, each run is
// scanned for NaN and Inf just before fn reads it, while it is in cache, so
// the check costs no pass of its own; at the first bad element fn is called
// no more, the rest of the bytes are consumed, and its index is returned
// (-1: all finite).
template <typename T, typename Fn>
int64_t ForEachChunk(DType dtype, uint64_t count, PayloadReader* payload, bool check, Fn fn) {
  thread_local std::vector<char> raw;
  thread_local std::vector<T> values;
  const size_t elem = DTypeSize(dtype);
  if (raw.size() < kChunkElems * elem) raw.resize(kChunkElems * elem);
  if (values.size() < kChunkElems) values.resize(kChunkElems);
  uint64_t at = 0;   // elements passed to fn so far
  int64_t bad = -1;
  auto run = [&](const T* v, size_t n) {
    if (check) {
      int64_t i = FirstNonFinite<T>(v, n);
      if (i >= 0) {
        bad = static_cast<int64_t>(at) + i;
        return;
      }
    }
    fn(v, at, n);
    at += n;
  };
  if (elem != sizeof(T)) {
    for (uint64_t done = 0; done < count;) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(kChunkElems, count - done));
      payload->Read(raw.data(), n * elem);
      done += n;
      if (bad >= 0) continue;
      ToCompute<T>(dtype, raw.data(), values.data(), n);
      run(values.data(), n);
    }
    return bad;
  }
  size_t carried = 0;  // bytes of an element split across two spans
  payload->Visit(count * elem, [&](const char* p, size_t n) {
    if (bad >= 0) return;
    if (carried > 0) {
      size_t take = std::min(elem - carried, n);
      std::memcpy(reinterpret_cast<char*>(values.data()) + carried, p, take);
      carried += take;
      p += take;
      n -= take;
      if (carried < elem) return;
      carried = 0;
      run(values.data(), 1);
      if (bad >= 0) return;
    }
    const size_t whole = n / elem;
    const bool aligned = reinterpret_cast<uintptr_t>(p) % alignof(T) == 0;
    for (size_t i = 0; i < whole && bad < 0;) {
      size_t k = std::min(kChunkElems, whole - i);
      if (aligned) {
        run(reinterpret_cast<const T*>(p) + i, k);
      } else {
        std::memcpy(values.data(), p + i * elem, k * elem);
        run(values.data(), k);
      }
      i += k;
    }
    if (bad >= 0) return;
    carried = n - whole * elem;
    std::memcpy(values.data(), p + whole * elem, carried);
  });
  return bad;
}

// Scans the next `count` elements of `payload` in place (the bytes are read
// once, not copied): a gradient is refused before any of it is applied, so
// this pass comes on top of the one that applies it.
inline absl::Status CheckFiniteBits(DType dtype, uint64_t offset, uint64_t count,
                             PayloadReader* payload) {
  const size_t elem = DTypeSize(dtype);
  char carry[8];
  size_t carried = 0;    // bytes of an element split across two spans
  uint64_t index = 0;    // elements checked so far
  int64_t bad = -1;
  payload->Visit(count * elem, [&](const char* p, size_t n) {
    if (bad >= 0) return;
    if (carried > 0) {
      size_t take = std::min(elem - carried, n);
      std::memcpy(carry + carried, p, take);
      carried += take;
      p += take;
      n -= take;
      if (carried < elem) return;
      if (NonFiniteAt(dtype, carry)) bad = index;
      ++index;
      carried = 0;
    }
    size_t whole = n / elem;
    if (AnyNonFiniteAt(dtype, p, whole) && bad < 0) {
      for (size_t i = 0; i < whole; ++i) {
        if (NonFiniteAt(dtype, p + i * elem)) {
          bad = index + i;
          break;
        }
      }
    }
    index += whole;
    carried = n - whole * elem;
    std::memcpy(carry, p + whole * elem, carried);
  });
  if (bad < 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat("element %d is NaN or Inf", offset + bad));
}

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_VALUES_H_
