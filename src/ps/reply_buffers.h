// Pull reply buffers kept from round to round. Private to ps/service.cc.
#ifndef DEEPNEX_PS_REPLY_BUFFERS_H_
#define DEEPNEX_PS_REPLY_BUFFERS_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace deepnex::ps {

// A round's pull replies take the buffers that the last round's gave back
// once gRPC had sent them, so that at steady state the server allocates
// nothing for replies. Fresh buffers cost more than the allocation: each
// round faulted its reply pages in again and the kernel zeroed them
// (clear_page_erms, a fifth of the server's CPU with 2 workers at 64 MiB,
// half of its page faults). Thread-safe.
class ReplyBuffers : public std::enable_shared_from_this<ReplyBuffers> {
 public:
  // Keeps at most `max_idle_bytes` of buffers nobody uses.
  explicit ReplyBuffers(uint64_t max_idle_bytes) : max_idle_bytes_(max_idle_bytes) {}

  // A buffer of `bytes`, reused when one of that size is idle.
  std::unique_ptr<char[]> Take(uint64_t bytes);
  // A slice over `buffer` (of `bytes`, from Take) that comes back here once
  // gRPC lets go of it.
  grpc::Slice Wrap(std::unique_ptr<char[]> buffer, uint64_t bytes);

 private:
  struct Lent;
  static void Return(void* lent);
  void Keep(std::unique_ptr<char[]> buffer, uint64_t bytes);

  const uint64_t max_idle_bytes_;
  std::mutex mu_;
  std::multimap<uint64_t, std::unique_ptr<char[]>> idle_;  // by size; guarded by mu_
  uint64_t idle_bytes_ = 0;                                // guarded by mu_
};

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_REPLY_BUFFERS_H_
