// Bulk TCP connections between the parameter server and its clients:
// pushes and pulls over a plain socket beside gRPC. A client on another host
// (or with shm off) moves its values through it; one that shares the
// server's memory, only the requests' headers.
//
// Over gRPC a 64 MiB round cost about twice the CPU of the same bytes over
// a plain socket (HTTP/2 framing, flow-control windows, completion-queue
// hand-offs), and with 2 workers the round is CPU-bound; a 4 KiB round
// spent most of its time in gRPC's per-call work. A bulk connection
// carries the same request and reply bodies as the gRPC calls, each behind
// a 32-byte frame; the client reads pulled values straight into the
// caller's tensors. Control calls (register, heartbeat, init) stay on gRPC,
// and so does everything when TLS is on (the bulk socket is plaintext).
//
// Admission: a Register reply carries a one-time ticket for (worker,
// incarnation); the connection's first 32 bytes must be it, within a few
// seconds, or the server closes it. The ticket proves the caller passed
// Register's authentication. Private to libdeepnex (ps/service_bulk.cc,
// ps/client.cc).
#ifndef DEEPNEX_PS_BULK_CHANNEL_H_
#define DEEPNEX_PS_BULK_CHANNEL_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <sys/types.h>

#include "deepnex/status.h"

namespace deepnex::ps {

// What leads every frame, both ways, in host byte order (the magic tells a
// peer of the other order, which is refused).
struct BulkFrame {
  uint32_t magic = 0;
  uint32_t kind = 0;    // request: a BulkMethod; reply: a grpc::StatusCode
  uint64_t id = 0;      // chosen by the client, echoed by the reply
  uint32_t text = 0;    // reply: bytes of error message after the frame
  uint32_t prefix = 0;  // reply: bytes of the body before the pulled values
  uint64_t body = 0;    // bytes after the message: a request or reply body
};
static_assert(sizeof(BulkFrame) == 32, "frame layout");

inline constexpr uint32_t kBulkMagic = 0x42584e44;  // "DNXB"
enum BulkMethod : uint32_t { kBulkPush = 1, kBulkPull = 2, kBulkCancel = 3 };

// One end of a bulk connection: a reader thread that hands each frame to
// its owner, and a writer thread that sends what a sender could not write
// at once. Each
// thread holds the stream until it ends, so the stream outlives them: it
// goes with the last of them or of its owners' references. Thread-safe.
//
// The server's end reads whatever comes. The client's end (Start with
// `on_demand`) reads only the replies it expects (Expect), and a caller
// about to wait for its reply may read them itself (Lead) instead of the
// reader thread. A blocking caller then wakes once per reply, not twice
// (the reader thread, then the caller); on a 2-CPU host the second wake
// often queued behind the other processes of the round while a CPU idled.
class BulkStream : public std::enable_shared_from_this<BulkStream> {
 public:
  BulkStream(int fd, std::string peer);
  ~BulkStream();
  BulkStream(const BulkStream&) = delete;
  BulkStream& operator=(const BulkStream&) = delete;

  // `on_frame` runs for each frame, on the reader thread or a leader, one
  // frame at a time, and reads all of the frame's text and body with Read
  // or Skip; an error from it ends the connection. `on_close` runs once, on
  // the reader thread, after the last frame (the peer went, an error, or
  // Close). The stream must be held by a shared_ptr.
  void Start(std::function<absl::Status(const BulkFrame&)> on_frame,
             std::function<void(const absl::Status&)> on_close, bool on_demand = false);
  // Only from on_frame.
  absl::Status Read(void* dst, uint64_t n);
  absl::Status Skip(uint64_t n);

  // On demand: one more frame will come (a request's reply). Without
  // `claim` the reader thread reads it unless a leader does; with it, the
  // caller promises to call Lead (or Unclaim) next, and until then the
  // reader thread leaves the socket to it.
  void Expect(bool claim);
  // Takes up the caller's claim: reads and hands on the frames that come
  // until `done()` (checked between frames, and every `poll` while none
  // comes), then leaves what is still expected to the reader thread. False
  // at once, the claim dropped, when the reader thread or another leader is
  // reading: the caller then waits for them.
  bool Lead(const std::function<bool()>& done, std::chrono::milliseconds poll);
  // Drops a claim without leading.
  void Unclaim();
  // A leader is in the middle of a frame (not waiting for the next one).
  bool LeaderInFrame() const;
  // Sends `frame` (its text and body sizes are filled in), `text` and
  // `body`, in order after the frames sent before: what the socket takes
  // at once on this thread, the rest from the writer thread. `sent(true)`
  // runs once they are written, `sent(false)` if the connection ends first;
  // either may run on this thread before Send returns, so the caller must
  // hold no lock that `sent` takes.
  void Send(BulkFrame frame, std::string text, grpc::ByteBuffer body,
            std::function<void(bool)> sent = nullptr);
  // Ends the connection; both threads stop soon after. Idempotent.
  void Close();
  // Waits for both threads to end (after Close, or the peer going); on one
  // of them, for the other only.
  void Join();
  const std::string& peer() const { return peer_; }

 private:
  struct Outgoing {
    BulkFrame frame;
    std::string text;
    grpc::ByteBuffer body;
    std::function<void(bool)> sent;
    uint64_t written = 0;  // bytes of the frame, text and body already sent
  };
  void Write();
  // Sends what is left of `out` (with MSG_DONTWAIT in `flags`, as much as
  // the socket takes now); true once all of it is sent.
  absl::StatusOr<bool> WriteOne(Outgoing& out, int flags);
  // Reads one frame and hands it to on_frame_.
  absl::Status ReadFrame();
  // The reader thread's turn to read (on demand). REQUIRES: mu_ held.
  bool ReaderTurn() const {
    return closed_ || (expected_ > 0 && !leading_ && claims_ == 0);
  }
  // Ends the connection for `s`, which on_close will be given.
  void Fail(const absl::Status& s);

  const int fd_;
  const std::string peer_;
  // A forked child holds the parent's socket but none of its threads: it
  // must neither shut the socket down nor join.
  const pid_t pid_;
  std::thread reader_;
  std::thread writer_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Outgoing> queue_;  // guarded by mu_
  bool writing_ = false;        // a thread is writing to the socket; guarded by mu_
  bool closed_ = false;         // guarded by mu_
  std::function<absl::Status(const BulkFrame&)> on_frame_;
  bool on_demand_ = false;
  // On demand, all guarded by mu_: frames still to come, callers that
  // promised to lead, whether one leads, whether the reader thread reads.
  std::condition_variable read_cv_;
  uint64_t expected_ = 0;
  int claims_ = 0;
  bool leading_ = false;
  bool leader_in_frame_ = false;
  bool reading_ = false;
  absl::Status failure_;  // why a leader ended the connection
};

// The send buffer (SO_SNDBUF) every bulk stream asks for; 0 where streams
// leave it to the kernel's autotuning.
int BulkSendBufferBytes();

// The server's listening socket for bulk connections, and the tickets that
// admit them: one per worker, for its latest incarnation. Thread-safe.
class BulkListener {
 public:
  // Runs on the thread that read the ticket, with the connection not yet
  // started.
  using OnConnection =
      std::function<void(std::shared_ptr<BulkStream>, int worker, uint64_t incarnation)>;
  // Listens on `host` (the gRPC listen host), port chosen by the OS.
  static absl::StatusOr<std::unique_ptr<BulkListener>> Start(const std::string& host,
                                                             OnConnection on_connection);
  ~BulkListener();

  int port() const { return port_; }
  // A fresh ticket for `worker` as `incarnation`, replacing its earlier
  // ticket and closing its earlier connection.
  std::string Offer(int worker, uint64_t incarnation);
  // The worker left (as `incarnation`; 0: whichever) or its lease expired:
  // its ticket is void and its connection closed.
  void Drop(int worker, uint64_t incarnation);

 private:
  struct Entry {
    uint64_t incarnation = 0;
    std::string ticket;  // empty once used
    std::weak_ptr<BulkStream> stream;
  };
  BulkListener(int listen_fd, int port, OnConnection on_connection);
  void Accept();
  // Reads the ticket of connection `fd` and admits it, or closes it.
  void Admit(int fd, std::string peer);

  const int listen_fd_;
  const int port_;
  const OnConnection on_connection_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int, Entry> entries_;  // by worker; guarded by mu_
  int admitting_ = 0;             // Admit threads running; guarded by mu_
  std::deque<int> waiting_;       // their connections until read, oldest first; guarded by mu_
  bool stopping_ = false;         // guarded by mu_
};

// The client's end: connects to the server of gRPC address `server` on
// `port` and shows `ticket`; Unavailable when the server does not admit it.
absl::StatusOr<std::shared_ptr<BulkStream>> DialBulk(const std::string& server, int port,
                                                     const std::string& ticket,
                                                     std::chrono::milliseconds timeout);

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_BULK_CHANNEL_H_
