// gRPC plumbing shared by deepnex's services: status conversion, bearer
// tokens in metadata, TLS credentials, and the framing of messages that carry
// raw tensor bytes. Private to libdeepnex; public headers never include gRPC.
#ifndef DEEPNEX_CORE_GRPC_UTIL_H_
#define DEEPNEX_CORE_GRPC_UTIL_H_

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "deepnex/auth.h"
#include "deepnex/status.h"

namespace google::protobuf {
class MessageLite;
}

namespace deepnex {

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
                                          bool require_admin = false);

// Server credentials: TLS from PEM files when both are given, else insecure.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const std::string& cert_file, const std::string& key_file);
// Starts the server `builder` describes (its services registered), listening
// on `address` ("HOST:PORT"; port 0 picks one, put in *port). gRPC's
// SO_REUSEPORT is off: by default a second server on a port another one
// serves would start too, and clients would alternate between the two.
// Unavailable naming `what` and the address when it cannot be bound:
//   ps server: cannot listen on "127.0.0.1:7070": Address already in use
absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(
    grpc::ServerBuilder& builder, const std::string& what, const std::string& address,
    const std::shared_ptr<grpc::ServerCredentials>& credentials, int* port);

// Channel credentials: TLS verified against `ca_file` when given.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>>
MakeChannelCredentials(const std::string& ca_file);

// A channel with its own TCP connection (channels with equal arguments
// otherwise share one) and no receive-size limit.
std::shared_ptr<grpc::Channel> MakeChannel(
    const std::string& address,
    const std::shared_ptr<grpc::ChannelCredentials>& credentials);

// ---- Framed messages: `message M { Header header = 1; bytes payload = 2; }`
//
// The header is a small protobuf; the payload is sent as slices that point
// at tensor memory (no copy) and read back slice by slice.

// Encodes header and payload. `payload` slices are referenced, not copied.
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
