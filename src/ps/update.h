// The optimizers' update rules, applied chunk by chunk to a partition.
#ifndef DEEPNEX_PS_UPDATE_H_
#define DEEPNEX_PS_UPDATE_H_

#include <cstddef>
#include <cstdint>

#include "deepnex/ps/optimizer.h"

namespace deepnex::ps {

// Whether the rule keeps a first (momentum) or second moment buffer.
bool UsesFirstMoment(const OptimizerConfig& config);
bool UsesSecondMoment(const OptimizerConfig& config);

// One update of `n` elements: the values `in` updated into `out` (the same
// buffer, or one that does not overlap it), `g` the gradient, which is
// multiplied by `scale` first (1/workers for a mean), `m` and `v` the
// moment buffers (nullptr when unused), `step` the 1-based update count of
// the partition (Adam's bias correction). T is float or double.
template <typename T>
void ApplyUpdate(const OptimizerConfig& config, uint64_t step, T scale, const T* in, T* out,
                 const T* g, T* m, T* v, size_t n);

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_UPDATE_H_
