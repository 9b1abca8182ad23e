// gRPC plumbing shared by deepnex's services: status conversion, bearer
// tokens in metadata, TLS credentials, and the framing of messages that carry
// raw tensor bytes. Private to libdeepnex; public headers never include gRPC.
#ifndef DEEPNEX_CORE_GRPC_UTIL_H_
#define DEEPNEX_CORE_GRPC_UTIL_H_

#include <google/protobuf/message.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "deepnex/auth.h"
#include "deepnex/status.h"

namespace google::protobuf {
class MessageLite;
}

namespace deepnex {

class GrpcListener;

// absl and gRPC share their status codes, so these only move the values.
absl::Status ToAbslStatus(const grpc::Status& status);
grpc::Status ToGrpcStatus(const absl::Status& status);

// The metadata key and value form of a bearer token.
inline constexpr char kAuthorizationKey[] = "authorization";
std::string BearerValue(const std::string& token);

// Checks the call's bearer token against `tokens` (an empty table allows
// everything). See TokenTable::Authenticate.
absl::StatusOr<Identity> AuthenticateCall(const TokenTable& tokens,
                                          const grpc::ServerContextBase& ctx,
                                          const std::string& job = "",
                                          bool require_admin = false,
                                          bool allow_node = false);

// Server credentials: TLS from PEM files when both are given, else insecure.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const std::string& cert_file, const std::string& key_file);
// ---- Serving: the one scaffold of deepnex's gRPC servers (ps, store, central).

// How a server listens. Plain fields with their defaults, as in ServerOptions.
struct ServerHostOptions {
  // Names the server in errors, e.g. "ps server".
  std::string what;
  // "HOST:PORT"; port 0 picks a free one.
  std::string address;
  // The host peers dial (AdvertisedAddress in core/net.h); empty: the listen
  // host, or this host's primary address when that is a wildcard.
  std::string advertise;
  // TLS from these PEM files when both are given, else insecure.
  std::string tls_cert_file;
  std::string tls_key_file;
  // The largest request accepted (capped at 2^31-1); 0: gRPC's 4 MiB.
  uint64_t max_receive_bytes = 0;
};

// Finishes a unary callback call with `status` at once, and returns its
// reactor: what a handler returns when it has its answer in hand.
grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const absl::Status& status);

// A started gRPC server serving some services: building it on its address,
// the port it bound, stopping it and waiting for that. The services are the
// caller's and must outlive the host. Thread-safe; Stop() is idempotent.
class ServerHost {
 public:
  // Refuses a process forked after gRPC started (CheckForkSafe), then serves
  // `services` on options.address. gRPC's SO_REUSEPORT is off: by default a
  // second server on a port another one serves would start too, and clients
  // would alternate between the two. A HOST:PORT is served through
  // GrpcListener (out of descriptors, it sheds connections and goes on).
  // Unavailable naming `what` and the address when it cannot be bound:
  //   ps server: cannot listen on "127.0.0.1:7070": Address already in use
  static absl::StatusOr<std::unique_ptr<ServerHost>> Start(
      const ServerHostOptions& options, const std::vector<grpc::Service*>& services);
  ~ServerHost();

  // The address peers dial, with the bound port, e.g. "127.0.0.1:41234";
  // never a wildcard. A unix: server's is its own address, and its port 0.
  const std::string& address() const { return address_; }
  int port() const { return port_; }

  // Stops taking calls, cancels those still open after 200 ms, and returns
  // once every call has finished. Callers first end whatever their open
  // calls wait for, so that these finish rather than being cancelled.
  void Stop();
  // Returns once Stop() has.
  void Wait();

 private:
  ServerHost(std::unique_ptr<grpc::Server> server, std::unique_ptr<GrpcListener> listener,
             std::string address, int port);

  const std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<GrpcListener> listener_;  // null: gRPC's own (unix:)
  const std::string address_;
  const int port_;
  std::once_flag stop_once_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopped_ = false;  // guarded by mu_
};

// Channel credentials: TLS verified against `ca_file` when given.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>>
MakeChannelCredentials(const std::string& ca_file);

// The shortest keepalive interval deepnex's servers accept from a client
// (gRPC's default allows one ping per 5 minutes without data, and answers
// more with GOAWAY "too_many_pings").
inline constexpr std::chrono::milliseconds kMinKeepalive{1000};

// The keepalive of every client's channel (Dial): a server that goes silent
// (its host cut off, its process stopped) fails the client's open calls
// within about twice this. Without it a blocking call, a queued Allocate
// with no timeout or a session's stream, waited for ever (probe: SIGSTOP of
// deepnex-central).
inline constexpr std::chrono::milliseconds kClientKeepalive{5000};

// A channel with its own TCP connection (channels with equal arguments
// otherwise share one), no receive-size limit, and reconnection attempts
// from 100 ms apart up to 2 s apart (gRPC's default backoff grows to 120 s,
// which would keep a client from a restarted server for minutes).
// With a `keepalive` (at least kMinKeepalive), the channel pings the server
// after that long without a ping answered, calls or not, and drops the
// connection when a ping goes unanswered for as long: its open calls then
// fail Unavailable ("keepalive watchdog timeout"). Without it, a peer that
// vanishes behind a partition (no reset, no FIN) leaves a stream that only
// reads waiting for good.
std::shared_ptr<grpc::Channel> MakeChannel(
    const std::string& address,
    const std::shared_ptr<grpc::ChannelCredentials>& credentials,
    std::chrono::milliseconds keepalive = std::chrono::milliseconds(0));

// ---- Dialing: what every client does with its address first.

// The address forms a client accepts: "HOST:PORT" (a name, an IPv4 address
// or a bracketed IPv6 address, and a port 1-65535) or "unix:PATH".
// InvalidArgument otherwise, naming `what` (e.g. "central address"), the
// address and the expected form:
//   central address "http://127.0.0.1:7070": expected HOST:PORT (e.g. 127.0.0.1:7070)
absl::Status ValidateAddress(const std::string& what, const std::string& address);

// How long a client's first contact with its server may take. Long enough
// for a server started next to its clients; a never-reachable address fails
// in this time instead of each call's full deadline.
inline constexpr std::chrono::milliseconds kConnectTimeout{5000};

// A connected channel (see MakeChannel; keepalive kClientKeepalive) to the
// server `what` (e.g. "central", named so in errors) at `address`. Checks
// the address (ValidateAddress) and fork safety (CheckForkSafe), then
// connects within `connect_timeout`, retrying with the channel's backoff
// while nothing answers; then Unavailable with gRPC's reason, e.g. "...
// Connection refused". Calls on the channel keep their own deadlines and
// retries for a server that goes away later.
absl::StatusOr<std::shared_ptr<grpc::Channel>> Dial(
    const std::string& what, const std::string& address,
    const std::shared_ptr<grpc::ChannelCredentials>& credentials,
    std::chrono::milliseconds connect_timeout = kConnectTimeout);

// ---- fork()
//
// gRPC 1.51 does not survive fork() once it runs: its fork handlers give up
// while a callback server or client polls, as deepnex's do, so a child
// that touched it would hang, and its sockets would land in the epoll set it
// shares with its parent, which then crashes on the child's events. So a
// process forked after its parent started gRPC refuses deepnex's gRPC work
// with FailedPrecondition (and never touches gRPC), and the parent goes on.

// FailedPrecondition naming `what` (e.g. "store client") in a process forked
// from one that had started gRPC; otherwise OK, and fork() from now on
// yields such processes. Call before creating a channel or server, and
// before each call on an object a child may have inherited.
absl::Status CheckForkSafe(const std::string& what);

// Whether this is such a forked process. There, an object inherited from
// the parent must not join its threads (they were not forked) nor wait on
// gRPC: its destructor leaves them, leaking what they hold, so that a child
// that exits normally (or drops the object) neither crashes nor hangs.
bool InForkedChild();

// InvalidArgument naming the first string field of `request` that is not
// UTF-8 ('spec.command[1]: "caf\xe9" is not UTF-8 text'), which a proto3
// string must be: the server cannot parse such a request and answers
// UNIMPLEMENTED with no message. OK otherwise.
absl::Status CheckUtf8Fields(const google::protobuf::Message& request);

// ---- Framed messages: `message M { Header header = 1; bytes payload = 2; }`
//
// The header is a small protobuf; the payload is sent as slices that point
// at tensor memory (no copy) and read back slice by slice.

// Encodes header and payload. `payload` slices are referenced, not copied.
// A non-empty payload starts a multiple of kFramedPayloadAlignment bytes
// into the message (its length varints are padded: a varint longer than it
// need be reads as the same value), so a receiver that keeps the message in
// one aligned buffer, as a bulk connection does, reads float32 and float64
// values where they lie instead of through a staging copy.
inline constexpr size_t kFramedPayloadAlignment = 8;
grpc::ByteBuffer EncodeFramed(const google::protobuf::MessageLite& header,
                              std::vector<grpc::Slice> payload);

// Sequential reader over the payload's bytes, which may span many slices.
class PayloadReader {
 public:
  PayloadReader() = default;
  uint64_t remaining() const { return remaining_; }
  // Copies the next `n` bytes into `dst`; false if fewer remain.
  bool Read(void* dst, uint64_t n);
  bool Skip(uint64_t n);
  // When the next `n` bytes lie in one slice: that slice, whose copy keeps
  // them as they are for as long as it lives, and their address in it (the
  // bytes are not consumed). False when they span slices, or when the
  // reader's bytes are lent (set_lent).
  bool Whole(uint64_t n, grpc::Slice* slice, const char** data) const;
  // The bytes are someone else's, who may rewrite them once the call that
  // brought them is answered (a shared-memory region): Whole refuses them.
  void set_lent() { lent_ = true; }
  // Passes the next `n` bytes to fn(data, size) span by span, in place,
  // without copying; false if fewer remain.
  template <typename Fn>
  bool Visit(uint64_t n, Fn fn) {
    if (n > remaining_) return false;
    remaining_ -= n;
    while (n > 0) {
      const grpc::Slice& s = slices_[slice_];
      size_t take = n < s.size() - offset_ ? n : s.size() - offset_;
      fn(reinterpret_cast<const char*>(s.begin()) + offset_, take);
      n -= take;
      offset_ += take;
      if (offset_ == s.size()) {
        ++slice_;
        offset_ = 0;
      }
    }
    return true;
  }

 private:
  friend absl::Status DecodeFramed(const grpc::ByteBuffer&,
                                   google::protobuf::MessageLite*,
                                   PayloadReader*);
  std::vector<grpc::Slice> slices_;
  size_t slice_ = 0;
  size_t offset_ = 0;  // within slices_[slice_]
  uint64_t remaining_ = 0;
  bool lent_ = false;
};

// Parses a framed message; InvalidArgument for a garbled one.
absl::Status DecodeFramed(const grpc::ByteBuffer& buffer,
                          google::protobuf::MessageLite* header,
                          PayloadReader* payload);

// A heap buffer handed to gRPC as a slice; freed when gRPC lets go of it.
grpc::Slice OwnedSlice(std::unique_ptr<char[]> data, size_t size);

// Makes glibc reuse multi-MiB tensor buffers instead of mapping and
// unmapping them each round (thousands of page faults per round otherwise):
// higher mmap and trim thresholds, and one arena. Process-wide; called once
// by servers and clients.
void TuneMallocForLargeBuffers();

}  // namespace deepnex

#endif  // DEEPNEX_CORE_GRPC_UTIL_H_
