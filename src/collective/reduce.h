// Element-wise reduction kernels of the cpu backend. Private to libdeepnex.
#ifndef DEEPNEX_COLLECTIVE_REDUCE_H_
#define DEEPNEX_COLLECTIVE_REDUCE_H_

#include <cstddef>

#include "deepnex/collective/communicator.h"
#include "deepnex/tensor.h"

namespace deepnex::collective {

// dst[i] = op(dst[i], src[i]) for `n` elements of `dtype`; float16 and
// bfloat16 are computed in float32 and rounded to nearest even. kMean sums
// (the division is DivideInPlace's). Neither pointer needs to be aligned.
// REQUIRES: dtype is one of float32, float64, float16, bfloat16, int32,
// int64, uint8.
void ReduceInto(DType dtype, ReduceOp op, char* dst, const char* src, size_t n);

// dst[i] /= divisor (integers truncate toward zero).
void DivideInPlace(DType dtype, char* dst, size_t n, int divisor);

}  // namespace deepnex::collective

#endif  // DEEPNEX_COLLECTIVE_REDUCE_H_
