#include "collective/ring.h"

#include <algorithm>

#include "collective/reduce.h"

namespace deepnex::collective {
namespace {

// The most one send copies into a shared-memory ring before publishing it:
// the neighbour starts on each piece while this rank copies the next, and
// reads it while it is still in this rank's cache. Copying all of a 1 MiB
// ring's free space at once made 64 MiB allreduces 1.3x slower. (A socket
// takes all it can: a send call costs more than a copy.)
constexpr size_t kShmPiece = 64 << 10;

size_t SendPiece(const Link& link, size_t n) {
  return link.send_is_shm() ? std::min(n, kShmPiece) : n;
}

}  // namespace

absl::Status RunRing(Link& link, const RingPlan& p, SteadyClock::time_point deadline) {
  auto chunk = [&](int t) -> const std::pair<char*, size_t>& {
    return p.chunks[((p.r - t + p.shift) % p.n + 2 * p.n) % p.n];
  };
  const bool mean = p.op == ReduceOp::kMean;
  int st = 0, rt = 0;          // send / receive step
  size_t soff = 0, roff = 0;   // bytes done within the step's chunk
  auto allowed = [&]() -> size_t {
    if (st == 0 || rt >= st) return chunk(st).second;
    return rt == st - 1 ? roff : 0;
  };
  while (st < p.steps || rt < p.steps) {
    bool progress = false;
    while (st < p.steps) {
      const auto& [ptr, len] = chunk(st);
      size_t limit = allowed();
      if (soff < limit) {
        DEEPNEX_ASSIGN_OR_RETURN(size_t n,
                                 link.TrySend(ptr + soff, SendPiece(link, limit - soff)));
        if (n == 0) break;
        soff += n;
        progress = true;
      }
      if (soff == len) {
        ++st;
        soff = 0;
        continue;
      }
      break;
    }
    while (rt < p.steps) {
      const auto& [ptr, len] = chunk(rt + 1);
      if (roff == len) {
        ++rt;
        roff = 0;
        progress = true;
        continue;
      }
      if (rt < p.rs_steps) {
        DEEPNEX_ASSIGN_OR_RETURN(auto span, link.Peek(p.esize));
        if (span.second == 0) break;
        size_t k = std::min(span.second / p.esize, (len - roff) / p.esize);
        ReduceInto(p.dtype, p.op, ptr + roff, span.first, k);
        if (mean && rt == p.rs_steps - 1) DivideInPlace(p.dtype, ptr + roff, k, p.n);
        link.Consume(k * p.esize);
        roff += k * p.esize;
      } else {
        DEEPNEX_ASSIGN_OR_RETURN(size_t n, link.TryRecv(ptr + roff, len - roff));
        if (n == 0) break;
        roff += n;
      }
      progress = true;
    }
    if (!progress) {
      bool want_send = st < p.steps && soff < allowed();
      DEEPNEX_RETURN_IF_ERROR(link.Wait(want_send, rt < p.steps, deadline));
    }
  }
  return absl::OkStatus();
}

absl::Status RunBroadcast(Link& link, int n, int r, int root, char* ptr, size_t len,
                          SteadyClock::time_point deadline) {
  const int pos = (r - root + n) % n;
  const bool recv = pos > 0, send = pos < n - 1;
  size_t got = recv ? 0 : len, sent = send ? 0 : len;
  while (got < len || sent < len) {
    bool progress = false;
    if (sent < got) {
      DEEPNEX_ASSIGN_OR_RETURN(size_t k, link.TrySend(ptr + sent, SendPiece(link, got - sent)));
      sent += k;
      progress |= k > 0;
    }
    if (got < len) {
      DEEPNEX_ASSIGN_OR_RETURN(size_t k, link.TryRecv(ptr + got, len - got));
      got += k;
      progress |= k > 0;
    }
    if (!progress) DEEPNEX_RETURN_IF_ERROR(link.Wait(sent < got, got < len, deadline));
  }
  return absl::OkStatus();
}

std::pair<size_t, size_t> Part(size_t count, int parts, int i) {
  size_t begin = count * i / parts, end = count * (i + 1) / parts;
  return {begin, end - begin};
}

}  // namespace deepnex::collective
