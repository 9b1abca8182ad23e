// A server stream whose writes queue, for deepnex's long-lived callback
// streams (an agent's stream to central, a session's). gRPC allows one write
// in flight per stream: Send queues behind it from any thread, and Close
// finishes the stream once what was queued is out. Private to libdeepnex.
#ifndef DEEPNEX_CORE_GRPC_STREAM_H_
#define DEEPNEX_CORE_GRPC_STREAM_H_

#include <grpcpp/grpcpp.h>

#include <deque>
#include <mutex>

#include "core/grpc_util.h"
#include "deepnex/status.h"

namespace deepnex {

// Subclasses read (ReadUnlessClosed, OnReadDone) and delete themselves in
// OnDone.
template <class In, class Out>
class QueuedServerStream : public grpc::ServerBidiReactor<In, Out> {
 public:
  // Queues `m`; false once the stream is closing.
  bool Send(Out m) {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return false;
    queued_bytes_ += m.ByteSizeLong();
    out_.push_back(std::move(m));
    if (!writing_) {
      writing_ = true;
      this->StartWrite(&out_.front());
    }
    return true;
  }

  // Ends the stream with `status` once the queued writes are out. Idempotent.
  void Close(const absl::Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    final_ = ToGrpcStatus(status);
    if (!writing_) this->Finish(final_);
  }

  // Bytes of messages queued and not yet written: a sender that must not
  // let them grow waits for OnWritten.
  size_t QueuedBytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return queued_bytes_;
  }

  void OnWriteDone(bool ok) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queued_bytes_ -= out_.front().ByteSizeLong();
      out_.pop_front();
      if (!ok) {
        out_.clear();
        queued_bytes_ = 0;
      }
      if (ok && !out_.empty()) {
        this->StartWrite(&out_.front());
      } else {
        writing_ = false;
        if (closed_) this->Finish(final_);
      }
    }
    OnWritten();
  }

 protected:
  // After each write, with no lock of the stream's held (before OnDone).
  virtual void OnWritten() {}

  // The next read, unless the stream was closed: never a read after Finish.
  void ReadUnlessClosed(In* in) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!closed_) this->StartRead(in);
  }

 private:
  std::mutex mu_;
  std::deque<Out> out_;
  size_t queued_bytes_ = 0;
  bool writing_ = false;
  bool closed_ = false;
  grpc::Status final_;
};

}  // namespace deepnex

#endif  // DEEPNEX_CORE_GRPC_STREAM_H_
