// The allocator's invariant checker (Allocator::CheckInvariants): recomputes
// every counter and index from the allocations alone and compares. Private
// to libdeepnex.
#ifndef DEEPNEX_GPU_INVARIANTS_H_
#define DEEPNEX_GPU_INVARIANTS_H_

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>

#include "deepnex/gpu/types.h"
#include "deepnex/status.h"
#include "gpu/allocator_records.h"
#include "gpu/placement.h"

namespace deepnex::gpu {

// OK when `placement`'s per-node counters and indexes and `usage_of` (per
// user) are exactly what `allocs` add up to; otherwise Internal naming the
// first inconsistency (a double-booked exclusive GPU, overcommitted memory,
// a stale index entry, ...).
absl::Status CheckInvariants(const Placement& placement,
                             const std::map<uint64_t, AllocRec>& allocs,
                             const std::unordered_map<std::string, Usage>& usage_of);

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_INVARIANTS_H_
