// One partition of one tensor on a parameter server: its values, optimizer
// state, the open round's accumulator, and the calls waiting on it.
#ifndef DEEPNEX_PS_PARTITION_H_
#define DEEPNEX_PS_PARTITION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/grpc_util.h"
#include "deepnex/ps/optimizer.h"
#include "deepnex/ps/server.h"
#include "deepnex/tensor.h"

namespace deepnex::ps {

// A server call that spans several partitions; each partition reports its
// slice to it. Implementations are thread-safe.
class PullSink {
 public:
  virtual ~PullSink() = default;
  // Where slice `slice`'s values go (count * dtype size bytes).
  virtual char* Destination(size_t slice) = 0;
  // The slice has been copied; `version` is the partition's then.
  virtual void SliceReady(size_t slice, uint64_t version) = 0;
  virtual bool Finished() const = 0;
};

class PushSink {
 public:
  virtual ~PushSink() = default;
  virtual void SliceApplied(size_t slice) = 0;
  virtual bool Finished() const = 0;
};

// Callbacks to run once the partition's lock is released.
using Completions = std::vector<std::function<void()>>;

struct PartitionConfig {
  Mode mode = Mode::kSync;
  int num_workers = 1;
  Reduction reduction = Reduction::kMean;
  OptimizerConfig optimizer;
};

// Thread-safe; every method takes the partition's own lock, so calls on
// different partitions never contend.
class Partition {
 public:
  static std::unique_ptr<Partition> Create(const PartitionConfig& config,
                                           DType dtype, uint64_t offset,
                                           uint64_t count);
  virtual ~Partition() = default;

  DType dtype() const { return dtype_; }
  uint64_t offset() const { return offset_; }
  uint64_t count() const { return count_; }
  uint64_t bytes() const { return count_ * DTypeSize(dtype_); }

  // Sets the values from the next bytes() of `payload`.
  virtual void Write(PayloadReader* payload) = 0;
  // Reads the next bytes() of `payload`; InvalidArgument (naming the first
  // bad element) if any value is NaN or Inf.
  virtual absl::Status CheckFinite(PayloadReader* payload) const = 0;
  // Consumes the next bytes() of `payload` as worker `worker`'s gradient for
  // its round `round` (1-based, per worker). A round already applied is
  // acknowledged and ignored (a retry); a round ahead of what the mode
  // allows is kept until it may be applied, and acknowledged then.
  virtual void Push(int worker, uint64_t round, PayloadReader* payload,
                    std::shared_ptr<PushSink> sink, size_t slice,
                    Completions* done) = 0;
  // Copies the values into the sink once version >= min_version.
  virtual void Pull(uint64_t min_version, std::shared_ptr<PullSink> sink,
                    size_t slice, Completions* done) = 0;

  virtual uint64_t version() const = 0;
  // The round worker `worker` pushes next.
  virtual uint64_t next_round(int worker) const = 0;
  // Drops waiting calls (their sinks are failed by the caller).
  virtual void DropWaiters() = 0;

 protected:
  Partition(DType dtype, uint64_t offset, uint64_t count)
      : dtype_(dtype), offset_(offset), count_(count) {}
  const DType dtype_;
  const uint64_t offset_, count_;
};

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_PARTITION_H_
