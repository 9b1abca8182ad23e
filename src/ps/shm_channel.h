// Same-host shared memory between the parameter server and its clients.
// The server makes one sealed memfd per client incarnation and hands it,
// over a unix socket, to the process that shows the one-time ticket of its
// Register reply and runs under the server's uid; pushes and pulls then
// carry only a region of it in their headers. Nothing is ever named in a
// filesystem: a segment lives as long as the server's reference (dropped on
// leave, lease expiry or re-registration) and the client's mapping.
// Private to libdeepnex (ps/service.cc, ps/client.cc).
#ifndef DEEPNEX_PS_SHM_CHANNEL_H_
#define DEEPNEX_PS_SHM_CHANNEL_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "core/grpc_util.h"
#include "core/net.h"
#include "deepnex/ps.pb.h"
#include "deepnex/ps/client.h"
#include "deepnex/status.h"

namespace deepnex::ps {

// A memfd mapped read-write. Thread-safe: immutable once made.
class ShmSegment {
 public:
  // A new segment of `bytes`, mode 0600, sealed against shrinking and
  // growing, so that no client can make the server's accesses fault.
  static absl::StatusOr<std::shared_ptr<ShmSegment>> Create(uint64_t bytes);
  // Maps a segment received from a server; takes `fd`. Refuses one that is
  // not sealed against shrinking (accesses could fault later).
  static absl::StatusOr<std::shared_ptr<ShmSegment>> Map(int fd);
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  char* data() const { return data_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }
  // InvalidArgument naming the call unless [offset, offset + bytes) lies
  // inside the segment.
  absl::Status CheckRegion(const char* op, uint64_t offset, uint64_t bytes) const;
  // Reads [offset, offset + bytes) in place. REQUIRES: CheckRegion passed;
  // the segment outlives the reader.
  PayloadReader Reader(uint64_t offset, uint64_t bytes) const;

 private:
  ShmSegment(int fd, char* data, uint64_t size) : fd_(fd), data_(data), size_(size) {}
  const int fd_;
  char* const data_;
  const uint64_t size_;
};

// The server's segments, one per worker, and the unix socket that hands
// them out. Thread-safe.
class ShmBroker {
 public:
  // Listens on a fresh abstract unix socket; segments are at most
  // `max_bytes` each.
  static absl::StatusOr<std::unique_ptr<ShmBroker>> Start(uint64_t max_bytes);
  ~ShmBroker();

  struct Offer {
    std::string socket;  // abstract socket name, without the leading NUL
    std::string ticket;
    uint64_t bytes = 0;
  };
  // A new segment for `worker` as `incarnation` (replacing its earlier
  // one), of min(bytes, max_bytes).
  absl::StatusOr<Offer> Open(int worker, uint64_t incarnation, uint64_t bytes);
  // The segment of `worker` as `incarnation`, or null.
  std::shared_ptr<ShmSegment> Find(int worker, uint64_t incarnation) const;
  // The worker left (as `incarnation`) or its lease expired (0: whichever
  // incarnation): the server lets go of its segment (calls in flight keep
  // their reference until they end).
  void Drop(int worker, uint64_t incarnation);
  size_t Count() const;

 private:
  struct Entry {
    uint64_t incarnation = 0;
    std::string ticket;  // empty once used
    std::shared_ptr<ShmSegment> segment;
  };
  // A connection of this process's uid whose ticket is still coming.
  struct Pending {
    int fd = -1;
    std::chrono::steady_clock::time_point deadline;
    std::string ticket;  // the bytes read so far
  };
  ShmBroker(int listen_fd, int stop_fd, std::string name, uint64_t max_bytes);
  // Accepts connections, closing those of other uids unread, and reads the
  // tickets of all the others at once, so that a peer that sends nothing
  // holds up no one else's hand-out.
  void Serve();
  // Sends the segment whose ticket `conn` showed, if any.
  void Hand(int conn, const std::string& ticket);

  const int listen_fd_;
  const int stop_fd_;  // eventfd: wakes Serve() to stop
  const std::string name_;
  const uint64_t max_bytes_;
  mutable std::mutex mu_;
  std::map<int, Entry> entries_;  // by worker
  std::thread thread_;
};

// Fetches the segment `ticket` names from the server's `socket`.
absl::StatusOr<std::shared_ptr<ShmSegment>> FetchSegment(const std::string& socket,
                                                         const std::string& ticket,
                                                         std::chrono::milliseconds timeout);

// options.transport, or $DEEPNEX_PS_TRANSPORT when set. InvalidArgument
// when it is shm and `shm_bytes` leaves no room for a segment.
absl::StatusOr<Transport> ResolveTransport(Transport option, uint64_t shm_bytes);

class ShmRegions;

// The client's side of Register with `server`: the segment it offered, cut
// into regions, or null for TCP. With Transport::kShm a server that offers
// none, or one that cannot be fetched, is an error.
absl::StatusOr<std::shared_ptr<ShmRegions>> AttachShm(Transport transport,
                                                      const std::string& server,
                                                      const proto::RegisterReply& reply,
                                                      std::chrono::milliseconds timeout);

// A client's segment at one server, cut into regions for the requests in
// flight (first fit, 64-byte aligned). A request that finds no room goes
// over TCP. Thread-safe.
class ShmRegions {
 public:
  explicit ShmRegions(std::shared_ptr<ShmSegment> segment);
  // The offset of a free region of `bytes`, or none.
  std::optional<uint64_t> Take(uint64_t bytes);
  // Returns the region at `offset` (taken by Take).
  void Give(uint64_t offset);
  char* At(uint64_t offset) const { return segment_->data() + offset; }
  PayloadReader Reader(uint64_t offset, uint64_t bytes) const {
    return segment_->Reader(offset, bytes);
  }

 private:
  const std::shared_ptr<ShmSegment> segment_;
  std::mutex mu_;
  std::map<uint64_t, uint64_t> free_;  // offset -> bytes, coalesced
  std::map<uint64_t, uint64_t> used_;  // offset -> bytes
};

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_SHM_CHANNEL_H_
