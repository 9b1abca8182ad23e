// One partition of one tensor on a parameter server: its values, optimizer
// state, the open rounds' aggregates, and the calls waiting on it.
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
#include "ps/membership.h"
#include "ps/plan.h"

namespace deepnex::ps {

// Bytes that stay as they are for as long as `owner` is held.
struct SharedBytes {
  const char* data = nullptr;
  uint64_t size = 0;
  std::shared_ptr<const void> owner;
};

// A server call that spans several partitions; each partition reports its
// slice to it. Implementations are thread-safe.
class PullSink {
 public:
  virtual ~PullSink() = default;
  // Whether the sink takes a slice by reference to the partition's values
  // (SliceShared) when it can, rather than as a copy into Destination.
  virtual bool Shares() const = 0;
  // Where slice `slice`'s values go (count * dtype size bytes).
  virtual char* Destination(size_t slice) = 0;
  // The slice has been copied; `version` is the partition's then.
  virtual void SliceReady(size_t slice, uint64_t version) = 0;
  // The slice's values at `version`, by reference; what `values.owner`
  // holds is never written again (updates go to another buffer meanwhile).
  virtual void SliceShared(size_t slice, SharedBytes values, uint64_t version) = 0;
  virtual void Fail(const absl::Status& status) = 0;
  virtual bool Finished() const = 0;
};

class PushSink {
 public:
  virtual ~PushSink() = default;
  virtual void SliceApplied(size_t slice) = 0;
  virtual void Fail(const absl::Status& status) = 0;
  virtual bool Finished() const = 0;
  // Where the push wants the slice's values as it leaves them, as a copy
  // (a PushPull replying into shared memory): in async mode, where no
  // round stands between a push and its pull, the partition writes them
  // there chunk by chunk as it applies the push, from cache, and calls
  // SliceServed before SliceApplied. Null: the values are pulled later.
  virtual char* ValuesAsApplied(size_t /*slice*/) { return nullptr; }
  virtual void SliceServed(size_t /*slice*/, uint64_t /*version*/) {}
};

// Callbacks to run once the partition's lock is released.
using Completions = std::vector<std::function<void()>>;

// Runs the completions (outside the partitions' locks) and clears them.
inline void RunAll(Completions& done) {
  for (auto& fn : done) fn();
  done.clear();
}

// What partitions report for the server's metrics. Thread-safe.
class PartitionObserver {
 public:
  virtual ~PartitionObserver() = default;
  virtual void RoundCompleted(double latency_seconds) = 0;
  // A pull of `worker` served while it was `lead` rounds ahead of the
  // partition's applied version.
  virtual void PullServed(int worker, uint64_t lead) = 0;
  virtual void LatePush(int worker) = 0;
};

// Bounds the bytes of the pushes each worker has kept waiting on the server
// (ServerOptions::max_deferred_push_bytes). Thread-safe.
class DeferredLimit {
 public:
  virtual ~DeferredLimit() = default;
  // Takes `bytes` of `worker`'s allowance; ResourceExhausted (naming the
  // worker and the cap) when it would pass the cap, and nothing is taken.
  virtual absl::Status Take(int worker, uint64_t bytes) = 0;
  virtual void Give(int worker, uint64_t bytes) = 0;
};

class Partition;
struct PartitionState;

// Receives the snapshots partitions take every PartitionConfig::
// snapshot_every updates. Thread-safe.
class SnapshotSink {
 public:
  virtual ~SnapshotSink() = default;
  virtual void Periodic(const Partition* partition, PartitionState state) = 0;
};

struct PartitionConfig {
  Mode mode = Mode::kSync;
  int num_workers = 1;
  // Rounds a worker may run ahead of the slowest (0 in sync mode).
  int staleness = 0;
  Reduction reduction = Reduction::kMean;
  OptimizerConfig optimizer;
  // When a worker's lease expires, keep (true) or drop what it pushed into
  // rounds still open.
  bool keep_dead_contributions = true;
  const Membership* membership = nullptr;
  PartitionObserver* observer = nullptr;
  // Take a snapshot for `snapshots` whenever the version reaches a multiple
  // of this (0: never).
  uint64_t snapshot_every = 0;
  SnapshotSink* snapshots = nullptr;
  // Where deferred pushes take their bytes from (nullptr: unbounded).
  DeferredLimit* deferred_limit = nullptr;
};

// A partition's state at a round boundary, as a checkpoint stores it.
struct PartitionState {
  uint64_t version = 0;
  uint64_t step = 0;
  std::string values, m, v;  // raw compute-type arrays (float or double)
  struct Worker {
    uint64_t incarnation = 0;
    uint64_t first_round = 1;
    uint64_t next_seq = 1;
  };
  std::vector<Worker> workers;
};

// The error of a push of `key` refused for a NaN or Inf (`detail` names
// the element).
absl::Status RefuseNonFinite(const std::string& key, const std::string& detail);

// Thread-safe; every method takes the partition's own lock, so calls on
// different partitions never contend.
class Partition {
 public:
  // Below this size a copy costs less than a reference's bookkeeping, and
  // the values stay in one buffer, in cache.
  static constexpr uint64_t kShareMinBytes = 64 << 10;

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
  // Reads the next bytes() of `payload`; InvalidArgument (RefuseNonFinite
  // of `key`, naming the first bad element) if any value is NaN or Inf.
  virtual absl::Status CheckFinite(const std::string& key, PayloadReader* payload) const = 0;
  // Consumes the next bytes() of `payload` as push number `seq` (1-based,
  // per key) of worker `worker`'s client `incarnation`. A seq already
  // applied is acknowledged and ignored (a retry); one that must wait (an
  // earlier seq missing, or a round too far ahead of the slowest worker) is
  // kept, within the worker's deferred_limit, and acknowledged once applied.
  // With `check_finite`, a push holding NaN or Inf fails the sink with
  // RefuseNonFinite(key, ...) and changes nothing; in sync and ssp modes the
  // check rides on the pass that takes the push in. There, a push the
  // payload owns (not lent) in one aligned run of a dtype stored as it is,
  // of at least kShareMinBytes, may be referenced (its slice held) until its
  // round is applied instead of copied: two per round at most.
  virtual void Push(int worker, uint64_t incarnation, uint64_t seq, const std::string& key,
                    bool check_finite, PayloadReader* payload, std::shared_ptr<PushSink> sink,
                    size_t slice, Completions* done) = 0;
  // Gives the sink the values once they include what the worker's push
  // `last_seq` requires: its round minus the staleness (sync, ssp), the push
  // itself (async). last_seq 0, or worker kObserver: at once. They go by
  // reference when the sink Shares() and the partition stores its dtype as
  // it is (float32, float64) in at least kShareMinBytes; else as a copy.
  virtual void Pull(int worker, uint64_t incarnation, uint64_t last_seq,
                    std::shared_ptr<PullSink> sink, size_t slice,
                    Completions* done) = 0;
  // Re-evaluates open rounds after a lease expired or a worker left.
  virtual void MembershipChanged(Completions* done) = 0;
  // Fails every waiting call with `status`.
  virtual void FailWaiters(const absl::Status& status, Completions* done) = 0;
  // Forgets the waiting pulls and kept pushes whose calls have finished
  // (cancelled, or failed elsewhere), so that their memory goes with them.
  virtual void DropFinished() = 0;

  // Asks for the state at the end of round `round` (sync, ssp; at once in
  // async mode, or when the partition is there already): `fn` gets it, from
  // whichever thread completes that round, after the lock is released.
  virtual void SnapshotAt(uint64_t round,
                          std::function<void(PartitionState)> fn,
                          Completions* done) = 0;
  virtual void Restore(const PartitionState& state) = 0;

  virtual uint64_t version() const = 0;
  // The workers that `worker`'s deferred pushes, and a pull of it after its
  // last push, wait for: the required ones that have not pushed into one of
  // the rounds these need (sync, ssp). None when nothing of it would wait,
  // and in async mode.
  virtual std::vector<int> Awaited(int worker) const = 0;

 protected:
  Partition(DType dtype, uint64_t offset, uint64_t count)
      : dtype_(dtype), offset_(offset), count_(count) {}
  const DType dtype_;
  const uint64_t offset_, count_;
};

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_PARTITION_H_
