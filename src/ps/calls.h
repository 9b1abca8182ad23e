// The Push and Pull calls that outlive their handlers: a Call waits on the
// partitions it names, which report to it from other calls' threads.
// Private to ps/service.cc and ps/service_bulk.cc.
#ifndef DEEPNEX_PS_CALLS_H_
#define DEEPNEX_PS_CALLS_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "core/grpc_util.h"
#include "deepnex/ps.pb.h"
#include "ps/partition.h"
#include "ps/reply_buffers.h"
#include "ps/shm_channel.h"

namespace deepnex::ps {

// A call that may outlive its handler: it waits on partitions, which report
// to it from other calls' threads. Finished exactly once, by whichever of
// completion, failure or cancellation comes first, through the transport
// it came over (gRPC, or a bulk connection).
class Call {
 public:
  virtual ~Call() = default;
  bool Finished() const { return finished_.load(std::memory_order_acquire); }
  void Fail(const absl::Status& status) {
    if (finished_.exchange(true)) return;
    failed_.store(true, std::memory_order_release);
    finish_(ToGrpcStatus(status));
  }
  // Runs once the transport is done with the call (its reply sent, or the
  // call cancelled); `failed` says whether it ended in an error, which may
  // leave parts of it behind in partitions.
  void OnDone(std::function<void(bool failed)> fn) { on_done_ = std::move(fn); }

  // For the transport (gRPC's CallReactor, a bulk connection): how the
  // reply goes, set before any partition sees the call; and Done, once the
  // reply is sent or can no longer be.
  void SetFinish(std::function<void(const grpc::Status&)> finish) { finish_ = std::move(finish); }
  void Done() {
    if (on_done_) on_done_(failed_.load(std::memory_order_acquire));
  }

 protected:
  // True for the one caller that gets to finish the call.
  bool Claim() { return !finished_.exchange(true); }
  void Finish(const grpc::Status& status) { finish_(status); }

 private:
  std::atomic<bool> finished_{false};
  std::atomic<bool> failed_{false};
  std::function<void(const grpc::Status&)> finish_;
  std::function<void(bool)> on_done_;
};

// Owns the Call until gRPC is done with it; a cancelled call (client gone,
// deadline passed) is finished so that the server never waits on it.
class CallReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit CallReactor(std::shared_ptr<Call> call) : call_(std::move(call)) {
    call_->SetFinish([this](const grpc::Status& status) { Finish(status); });
  }
  void OnCancel() override { call_->Fail(absl::CancelledError("call cancelled")); }
  void OnDone() override {
    call_->Done();
    delete this;
  }

 private:
  std::shared_ptr<Call> call_;
};

class PushCall final : public Call, public PushSink {
 public:
  // `lose_reply`: answer Unavailable once applied (testing hook).
  PushCall(size_t slices, bool lose_reply) : remaining_(slices), lose_reply_(lose_reply) {}
  void SliceApplied(size_t) override {
    if (remaining_.fetch_sub(1) != 1 || !Claim()) return;
    Finish(lose_reply_
                         ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "reply dropped for testing")
                         : grpc::Status::OK);
  }
  void Fail(const absl::Status& status) override { Call::Fail(status); }
  bool Finished() const override { return Call::Finished(); }

 private:
  std::atomic<size_t> remaining_;
  const bool lose_reply_;
};

// A pull: each partition gives its slice's values to the reply, which goes
// once the last one has: by reference to the partition's values when it can
// (the reply sent from them, with no copy on the server), else as a copy.
// A PushPullCall is one too.
class PullCall : public Call, public PullSink {
 public:
  // With `segment`, the values go into it at `shm_offset` (the caller's
  // shared memory), and the reply only says so.
  // Else they go into a buffer of `buffers`.
  PullCall(std::vector<uint64_t> offsets, uint64_t total, grpc::ByteBuffer* response,
           std::shared_ptr<ReplyBuffers> buffers, std::shared_ptr<ShmSegment> segment,
           uint64_t shm_offset)
      : offsets_(std::move(offsets)),
        total_(total),
        versions_(offsets_.size()),
        shared_(offsets_.size()),
        remaining_(offsets_.size()),
        response_(response),
        buffers_(std::move(buffers)),
        segment_(std::move(segment)),
        shm_offset_(shm_offset) {}
  // Shared memory takes a copy whichever way; a reply message can carry the
  // partitions' own buffers.
  bool Shares() const override { return segment_ == nullptr; }
  // The buffer is made when the first values arrive, so that a pull waiting
  // for its round holds no reply memory.
  char* Destination(size_t slice) override {
    if (segment_) return segment_->data() + shm_offset_ + offsets_[slice];
    std::call_once(allocated_, [this] { buffer_ = buffers_->Take(total_); });
    return buffer_.get() + offsets_[slice];
  }
  void SliceShared(size_t slice, SharedBytes values, uint64_t version) override {
    shared_[slice] = std::move(values);
    SliceReady(slice, version);
  }
  void SliceReady(size_t slice, uint64_t version) override {
    versions_[slice] = version;
    if (remaining_.fetch_sub(1) != 1 || !Claim()) return;
    proto::PullHeader header;
    for (uint64_t v : versions_) header.add_versions(v);
    std::vector<grpc::Slice> payload;
    if (segment_) {
      header.set_shm(true);
    } else {
      payload = Payload();
    }
    *response_ = EncodeFramed(header, std::move(payload));
    Finish(grpc::Status::OK);
  }
  void Fail(const absl::Status& status) override { Call::Fail(status); }
  bool Finished() const override { return Call::Finished(); }

 private:
  // Bytes [begin, end) of `whole` (refcounted), sharing its memory at any
  // size. grpc::Slice::sub copies 23 bytes or fewer into an inlined slice,
  // and a ByteBuffer merges such a slice into an inlined one before it:
  // EncodeFramed's prefix, whose size a bulk reply tells the client so that
  // it reads the values straight into the caller's tensors.
  static grpc::Slice Part(const grpc::Slice& whole, size_t begin, size_t end) {
    // c_slice() takes a reference, which the part keeps.
    grpc_slice part = grpc_slice_sub_no_ref(whole.c_slice(), begin, end);
    return grpc::Slice(part, grpc::Slice::STEAL_REF);
  }

  // The reply's values in offset order: the shared slices as they are, and
  // the runs of copied ones between them from the buffer.
  std::vector<grpc::Slice> Payload() {
    grpc::Slice copied;
    if (buffer_) copied = buffers_->Wrap(std::move(buffer_), total_);
    std::vector<grpc::Slice> payload;
    uint64_t run = 0;  // where the copied bytes not yet in payload start
    for (size_t i = 0; i < shared_.size(); ++i) {
      SharedBytes& b = shared_[i];
      if (b.owner == nullptr) continue;
      if (offsets_[i] > run) payload.push_back(Part(copied, run, offsets_[i]));
      run = offsets_[i] + b.size;
      auto* owner = new std::shared_ptr<const void>(std::move(b.owner));
      payload.emplace_back(const_cast<char*>(b.data), b.size,
                           +[](void* o) { delete static_cast<std::shared_ptr<const void>*>(o); },
                           owner);
    }
    if (total_ > run) payload.push_back(Part(copied, run, total_));
    return payload;
  }

  const std::vector<uint64_t> offsets_;
  const uint64_t total_;
  std::once_flag allocated_;
  std::unique_ptr<char[]> buffer_;
  std::vector<uint64_t> versions_;  // each written by one partition, once
  std::vector<SharedBytes> shared_;  // likewise; those given by reference
  std::atomic<size_t> remaining_;
  grpc::ByteBuffer* const response_;
  const std::shared_ptr<ReplyBuffers> buffers_;
  const std::shared_ptr<ShmSegment> segment_;
  const uint64_t shm_offset_;
};

// A push that replies with the values of its slices (PushHeader.pull):
// once every slice is applied, it pulls them from `parts` for the push's
// seqs, which serve them as they would a pull of those seqs.
class PushPullCall final : public PullCall,
                           public PushSink,
                           public std::enable_shared_from_this<PushPullCall> {
 public:
  // `lose_reply`: answer Unavailable once applied (testing hook).
  PushPullCall(const proto::PushHeader& header, std::vector<Partition*> parts, bool lose_reply,
               std::vector<uint64_t> offsets, uint64_t total, grpc::ByteBuffer* response,
               std::shared_ptr<ReplyBuffers> buffers, std::shared_ptr<ShmSegment> segment)
      : PullCall(std::move(offsets), total, response, std::move(buffers), std::move(segment),
                 header.shm().offset()),
        worker_(header.worker_id()),
        incarnation_(header.incarnation()),
        parts_(std::move(parts)),
        served_(parts_.size()),
        pushes_left_(parts_.size()),
        lose_reply_(lose_reply) {
    for (const proto::Slice& slice : header.slices()) seqs_.push_back(slice.seq());
  }
  // Into shared memory the values are copied whichever way: the partition
  // copies them as it applies the push, where it can.
  char* ValuesAsApplied(size_t slice) override { return Shares() ? nullptr : Destination(slice); }
  void SliceServed(size_t slice, uint64_t version) override { served_[slice] = version + 1; }
  void SliceApplied(size_t) override {
    if (pushes_left_.fetch_sub(1) != 1 || Finished()) return;
    if (lose_reply_) {
      if (Claim()) {
        Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "reply dropped for testing"));
      }
      return;
    }
    Completions done;
    for (size_t i = 0; i < parts_.size(); ++i) {
      if (served_[i] != 0) {
        SliceReady(i, served_[i] - 1);
      } else {
        parts_[i]->Pull(worker_, incarnation_, seqs_[i], shared_from_this(), i, &done);
      }
    }
    RunAll(done);
  }
  void Fail(const absl::Status& status) override { PullCall::Fail(status); }
  bool Finished() const override { return PullCall::Finished(); }

 private:
  const int worker_;
  const uint64_t incarnation_;
  const std::vector<Partition*> parts_;
  std::vector<uint64_t> seqs_;
  // Per slice, 1 + the version its values were served at as its push was
  // applied, else 0; each written by one partition, before pushes_left_
  // counts that push.
  std::vector<uint64_t> served_;
  std::atomic<size_t> pushes_left_;
  const bool lose_reply_;
};

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_CALLS_H_
