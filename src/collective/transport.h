// Byte channels between ring neighbours for the cpu backend: TCP sockets and
// shared-memory rings. Private to libdeepnex.
//
// A Link is one stripe of a rank's ring position: it sends to the right
// neighbour and receives from the left one, each half over TCP or shared
// memory. Every operation is non-blocking; Wait blocks until one may make
// progress. A Link is used by one thread at a time; Abort may come from any.
#ifndef DEEPNEX_COLLECTIVE_TRANSPORT_H_
#define DEEPNEX_COLLECTIVE_TRANSPORT_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "core/socket.h"
#include "deepnex/status.h"

namespace deepnex::collective {

// ---- sockets (the TCP ones are core/socket.h's)

// The local address used to reach `host` (a UDP "connect", nothing sent).
std::string LocalAddressFor(const std::string& host);
// Identifies this machine (hostname and boot id): ranks with equal ids may
// share memory.
std::string HostId();

// ---- shared memory

// Each rank creates one segment holding its inbound rings (written by the
// left neighbour) and its doorbells (rung by both neighbours).
class ShmSegment {
 public:
  // The names' prefix, under /dev/shm.
  static constexpr char kPrefix[] = "deepnex-coll-";

  // Creates /dev/shm/<name> with `stripes` rings of `ring_bytes`. The name
  // lives only while a communicator forms (its neighbours map the segment,
  // then it is unlinked), and a lock on it lasts as long as its creator:
  // Create first removes this user's segments whose creator died in that
  // window (a job cancelled at rendezvous) and that are older than
  // `stale_after`.
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Create(
      int stripes, uint64_t ring_bytes, std::chrono::seconds stale_after = std::chrono::seconds(10));
  // Maps a neighbour's segment.
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Open(const std::string& name);
  ~ShmSegment();

  const std::string& name() const { return name_; }
  // Removes the name (mappings stay valid). Idempotent.
  void Unlink();
  int stripes() const;
  struct Ring;
  struct Bell;
  Ring* ring(int stripe);
  Bell* bell(int stripe);

 private:
  ShmSegment() = default;
  // Removes /dev/shm/<kPrefix>* of this user that no process holds locked
  // and that are older than `stale_after`.
  static void RemoveStale(std::chrono::seconds stale_after);

  std::string name_;
  bool owner_ = false;
  bool unlinked_ = false;
  int lock_fd_ = -1;  // the creator's, locked until Unlink
  char* base_ = nullptr;
  size_t size_ = 0;
};

// ---- links

// An error a Link returns because of a neighbour (it closed its
// connection, or sending to it failed) names that neighbour's rank here,
// as the status' payload: PeerOf reads it.
std::optional<int> PeerOf(const absl::Status& s);

struct LinkConfig {
  std::string left_name;   // "rank 3", for messages
  std::string right_name;
  int left_rank = -1;
  int right_rank = -1;
  // TCP halves: the connections (owned by the Link afterwards), or -1.
  int send_fd = -1;
  int recv_fd = -1;
  // Shared-memory halves: rings and doorbells, or null. `ctl` sockets are
  // the idle TCP connections whose closing says the neighbour is gone.
  ShmSegment::Ring* send_ring = nullptr;
  ShmSegment::Ring* recv_ring = nullptr;
  ShmSegment::Bell* my_bell = nullptr;     // in this rank's segment
  ShmSegment::Bell* right_bell = nullptr;  // rung after writing to send_ring
  ShmSegment::Bell* left_bell = nullptr;   // rung after reading recv_ring
  int send_ctl_fd = -1;  // not owned
  int recv_ctl_fd = -1;  // not owned
};

class Link {
 public:
  Link(const LinkConfig& config, const std::atomic<bool>* aborted);
  ~Link();
  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;

  // Copies up to `n` bytes into the outgoing stream; returns bytes taken.
  absl::StatusOr<size_t> TrySend(const char* data, size_t n);
  // Copies up to `n` received bytes into `dst`; returns bytes copied.
  absl::StatusOr<size_t> TryRecv(char* dst, size_t n);
  // Received bytes readable in place: at least `min_bytes` (<= 8) of them,
  // or an empty span if fewer have arrived.
  absl::StatusOr<std::pair<const char*, size_t>> Peek(size_t min_bytes);
  // Marks `n` peeked bytes as read.
  void Consume(size_t n);
  // Blocks until sending (want_send) or receiving (want_recv) may progress.
  // DeadlineExceeded past `deadline`, Unavailable when a neighbour is gone,
  // Aborted when the communicator is aborted.
  absl::Status Wait(bool want_send, bool want_recv, SteadyClock::time_point deadline);
  // Wakes Wait (the abort flag is the caller's to set).
  void Interrupt();
  bool send_is_shm() const { return c_.send_ring != nullptr; }
  bool recv_is_shm() const { return c_.recv_ring != nullptr; }

 private:
  bool ShmSendReady() const;
  bool ShmRecvReady() const;
  // Only the halves being waited on: a neighbour may leave once it has
  // everything it needs from us.
  absl::Status CheckCtl(bool check_send, bool check_recv) const;
  absl::Status CheckCtlAfterRings(bool shm_send, bool shm_recv) const;
  void RingBell(ShmSegment::Bell* bell);

  LinkConfig c_;
  const std::atomic<bool>* aborted_;
  // TCP receive buffer for Peek.
  std::unique_ptr<char[]> buf_;
  size_t buf_cap_ = 0, buf_begin_ = 0, buf_end_ = 0;
  char bounce_[8];
  size_t bounced_ = 0;  // Peek handed out the bounce buffer of this many bytes
};

}  // namespace deepnex::collective

#endif  // DEEPNEX_COLLECTIVE_TRANSPORT_H_
