// The header exchange every cpu collective starts with, on one Link: each
// rank's Header, perhaps followed by a small collective's data, passed to
// the right neighbour while the left one's arrives. Private to libdeepnex;
// called by the communicator's running thread.
#ifndef DEEPNEX_COLLECTIVE_EXCHANGE_H_
#define DEEPNEX_COLLECTIVE_EXCHANGE_H_

#include <functional>
#include <vector>

#include "collective/cpu_wire.h"
#include "collective/transport.h"

namespace deepnex::collective {

// Sends `out` (a Header and its payload) while receiving one record from
// the left: a Header into `in`, then its payload_bytes at place(*in), which
// is also returned in `in_payload`. Both at once, so that neither side needs
// buffer room for a whole record. A header that is garbled or announces more
// than kMaxPayloadBytes is Internal.
absl::Status PassRecord(Link& link, const std::vector<char>& out, Header* in,
                        const std::function<char*(const Header&)>& place, char** in_payload,
                        SteadyClock::time_point deadline);

// Two ranks: sends `mine` and its payload_bytes of `data` while receiving
// the peer's Header into `peer`. When matches(*peer), the peer's payload is
// reduced (mine.op, mine.dtype) straight from the link into `data`, only
// where `data` has already been sent; otherwise it is read and dropped.
absl::Status PairReduce(Link& link, const Header& mine, char* data, Header* peer,
                        const std::function<bool(const Header&)>& matches,
                        SteadyClock::time_point deadline);

}  // namespace deepnex::collective

#endif  // DEEPNEX_COLLECTIVE_EXCHANGE_H_
