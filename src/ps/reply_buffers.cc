#include "ps/reply_buffers.h"

#include <utility>

namespace deepnex::ps {

struct ReplyBuffers::Lent {
  std::shared_ptr<ReplyBuffers> owner;  // outlives the service if gRPC does
  std::unique_ptr<char[]> buffer;
  uint64_t bytes;
};

std::unique_ptr<char[]> ReplyBuffers::Take(uint64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = idle_.find(bytes);
    if (it != idle_.end()) {
      std::unique_ptr<char[]> buffer = std::move(it->second);
      idle_.erase(it);
      idle_bytes_ -= bytes;
      return buffer;
    }
  }
  return std::unique_ptr<char[]>(new char[bytes]);
}

grpc::Slice ReplyBuffers::Wrap(std::unique_ptr<char[]> buffer, uint64_t bytes) {
  char* data = buffer.get();
  auto* lent = new Lent{shared_from_this(), std::move(buffer), bytes};
  return grpc::Slice(data, bytes, &ReplyBuffers::Return, lent);
}

void ReplyBuffers::Return(void* arg) {
  std::unique_ptr<Lent> lent(static_cast<Lent*>(arg));
  lent->owner->Keep(std::move(lent->buffer), lent->bytes);
}

void ReplyBuffers::Keep(std::unique_ptr<char[]> buffer, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes > max_idle_bytes_ - std::min(idle_bytes_, max_idle_bytes_)) return;  // freed
  idle_bytes_ += bytes;
  idle_.emplace(bytes, std::move(buffer));
}

}  // namespace deepnex::ps
