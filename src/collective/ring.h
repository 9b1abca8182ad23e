// Ring algorithms of the cpu backend over one Link (one stripe). Private to
// libdeepnex.
//
// A ring collective is one pipelined stream per stripe: each step's chunk is
// sent as soon as the bytes it depends on have been received and reduced, so
// reduction overlaps the transfer. Allreduce is a reduce-scatter followed by
// an allgather in one stream; reduce-scatter and allgather are its halves.
// Each function is called from one thread per Link.
#ifndef DEEPNEX_COLLECTIVE_RING_H_
#define DEEPNEX_COLLECTIVE_RING_H_

#include <cstddef>
#include <utility>
#include <vector>

#include "collective/transport.h"
#include "deepnex/collective/communicator.h"

namespace deepnex::collective {

// One stripe's part of a ring collective: chunk c is (pointer, bytes).
struct RingPlan {
  int n = 1, r = 0;
  int steps = 0;     // steps of the stream
  int rs_steps = 0;  // the first rs_steps reduce; the rest copy
  int shift = 0;     // step t sends chunk (r - t + shift) mod n
  std::vector<std::pair<char*, size_t>> chunks;
  DType dtype = DType::kFloat32;
  size_t esize = 4;
  ReduceOp op = ReduceOp::kSum;
};

absl::Status RunRing(Link& link, const RingPlan& p, SteadyClock::time_point deadline);

// Pipelined chain from the root: each rank forwards what it has received.
absl::Status RunBroadcast(Link& link, int n, int r, int root, char* ptr, size_t len,
                          SteadyClock::time_point deadline);

// Splits [0, count) into `parts` near-equal ranges; returns range i as
// (begin, length).
std::pair<size_t, size_t> Part(size_t count, int parts, int i);

}  // namespace deepnex::collective

#endif  // DEEPNEX_COLLECTIVE_RING_H_
