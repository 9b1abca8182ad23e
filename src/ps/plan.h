// How a tensor is cut into partitions and which server holds each one.
// Every client computes the same plan from (key, element count, number of
// parts, number of servers), so no directory service is needed.
#ifndef DEEPNEX_PS_PLAN_H_
#define DEEPNEX_PS_PLAN_H_

#include <cstdint>
#include <string>

#include "deepnex/ps.pb.h"
#include "deepnex/status.h"

namespace deepnex::ps {

// The worker id of a client that only reads (ClientOptions::worker_id -1),
// on both ends of the wire.
inline constexpr int kObserver = -1;

struct PartRange {
  uint64_t offset = 0;  // first element
  uint64_t count = 0;   // elements
};

// The most parts a tensor is cut into: a probe's partition_bytes=8 cut
// 16 MiB into 2^21 parts, and its init took 21 s and 4 GB, its push timed out.
inline constexpr uint32_t kMaxParts = 1 << 14;

// Parts of at most `partition_bytes` (at least one part, even when empty),
// in 64 bits: more than kMaxParts is for the caller to refuse.
inline uint64_t NumParts(uint64_t num_elements, uint64_t elem_size,
                         uint64_t partition_bytes) {
  uint64_t bytes = num_elements * elem_size;
  uint64_t per_part = partition_bytes < elem_size ? elem_size : partition_bytes;
  return bytes == 0 ? 1 : (bytes - 1) / per_part + 1;
}

// Part `part` of `num_parts` nearly equal parts (the first ones one larger).
inline PartRange PartOf(uint64_t num_elements, uint32_t num_parts,
                        uint32_t part) {
  uint64_t base = num_elements / num_parts, extra = num_elements % num_parts;
  PartRange r;
  r.offset = part * base + (part < extra ? part : extra);
  r.count = base + (part < extra ? 1 : 0);
  return r;
}

// FNV-1a: stable across processes and builds, unlike std::hash.
inline uint64_t KeyHash(const std::string& key) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : key) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// Consecutive parts of a tensor go to consecutive servers, so a large
// tensor is spread over all of them.
inline int ServerOf(const std::string& key, uint32_t part, int num_servers) {
  return static_cast<int>((KeyHash(key) + part) % num_servers);
}

// The elements of `meta`'s shape; InvalidArgument (after `what`: "init of
// \"w\"") for an empty key, a dtype that is not a floating-point one, a
// negative dimension, more than 2^64 bytes, or num_parts outside
// 1..min(max(1, elements), kMaxParts). What a client gives in Init, a checkpoint holds and a
// server describes all pass it before they are used.
absl::StatusOr<uint64_t> CheckTensorMeta(const std::string& what, const proto::TensorMeta& meta);

// Part `part` of `meta` as a writer (a WriteParts slice) or a checkpoint
// record gives it: of meta's key and dtype, and the elements meta's
// partitioning makes that part. Returns its size in bytes; InvalidArgument
// after `what` ("init of \"w\" part 0") otherwise.
absl::StatusOr<uint64_t> CheckPart(const std::string& what, const std::string& key, uint32_t part,
                                   uint64_t offset, uint64_t count, int dtype,
                                   const proto::TensorMeta& meta);

// "[2, 3] float32"
std::string ShapeString(const proto::TensorMeta& meta);

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_PLAN_H_
