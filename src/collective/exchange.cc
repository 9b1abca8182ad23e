#include "collective/exchange.h"

#include <algorithm>

#include "collective/reduce.h"

namespace deepnex::collective {
namespace {

absl::Status CheckHeader(const Header& h) {
  if (h.magic != kHeaderMagic || h.payload_bytes > kMaxPayloadBytes) {
    return absl::InternalError("garbled collective header from the left neighbour");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status PassRecord(Link& link, const std::vector<char>& out, Header* in,
                        const std::function<char*(const Header&)>& place, char** in_payload,
                        SteadyClock::time_point deadline) {
  size_t sent = 0, got = 0, in_len = sizeof(Header);
  while (sent < out.size() || got < in_len) {
    bool progress = false;
    if (sent < out.size()) {
      DEEPNEX_ASSIGN_OR_RETURN(size_t k, link.TrySend(out.data() + sent, out.size() - sent));
      sent += k;
      progress |= k > 0;
    }
    if (got < in_len) {
      char* dst = got < sizeof(Header) ? reinterpret_cast<char*>(in) + got
                                       : *in_payload + (got - sizeof(Header));
      size_t want = (got < sizeof(Header) ? sizeof(Header) : in_len) - got;
      DEEPNEX_ASSIGN_OR_RETURN(size_t k, link.TryRecv(dst, want));
      got += k;
      progress |= k > 0;
      if (k > 0 && got == sizeof(Header)) {
        DEEPNEX_RETURN_IF_ERROR(CheckHeader(*in));
        *in_payload = place(*in);
        in_len += in->payload_bytes;
      }
    }
    if (!progress) DEEPNEX_RETURN_IF_ERROR(link.Wait(sent < out.size(), got < in_len, deadline));
  }
  return absl::OkStatus();
}

absl::Status PairReduce(Link& link, const Header& mine, char* data, Header* peer,
                        const std::function<bool(const Header&)>& matches,
                        SteadyClock::time_point deadline) {
  const DType dtype = static_cast<DType>(mine.dtype);
  const ReduceOp op = static_cast<ReduceOp>(mine.op);
  const size_t esize = DTypeSize(dtype), total = sizeof(Header) + mine.payload_bytes;
  size_t sent = 0, got = 0, in_len = sizeof(Header);
  bool matched = false;
  std::vector<char> stray;
  while (sent < total || got < in_len) {
    bool progress = false;
    if (sent < total) {
      const char* src = sent < sizeof(Header) ? reinterpret_cast<const char*>(&mine) + sent
                                              : data + (sent - sizeof(Header));
      size_t len = (sent < sizeof(Header) ? sizeof(Header) : total) - sent;
      DEEPNEX_ASSIGN_OR_RETURN(size_t k, link.TrySend(src, len));
      sent += k;
      progress |= k > 0;
    }
    if (got < sizeof(Header)) {
      DEEPNEX_ASSIGN_OR_RETURN(
          size_t k, link.TryRecv(reinterpret_cast<char*>(peer) + got, sizeof(Header) - got));
      got += k;
      progress |= k > 0;
      if (got == sizeof(Header)) {
        DEEPNEX_RETURN_IF_ERROR(CheckHeader(*peer));
        in_len += peer->payload_bytes;
        matched = matches(*peer);
        if (!matched) stray.resize(peer->payload_bytes);
      }
    } else if (got < in_len && !matched) {
      DEEPNEX_ASSIGN_OR_RETURN(
          size_t k, link.TryRecv(stray.data() + (got - sizeof(Header)), in_len - got));
      got += k;
      progress |= k > 0;
    } else if (got < in_len) {
      // Our bytes past `limit` are still to be sent: not overwritten yet.
      const size_t done = got - sizeof(Header);
      const size_t limit = sent > sizeof(Header) ? sent - sizeof(Header) : 0;
      if (limit >= done + esize) {
        DEEPNEX_ASSIGN_OR_RETURN(auto span, link.Peek(esize));
        size_t k = std::min(span.second, limit - done) / esize;
        if (k > 0) {
          ReduceInto(dtype, op, data + done, span.first, k);
          link.Consume(k * esize);
          got += k * esize;
          progress = true;
        }
      }
    }
    if (!progress) DEEPNEX_RETURN_IF_ERROR(link.Wait(sent < total, got < in_len, deadline));
  }
  return absl::OkStatus();
}

}  // namespace deepnex::collective
