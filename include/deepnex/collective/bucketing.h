// Gradient bucketing, as PyTorch DDP does it: many small gradients are packed
// into buckets of about 25 MiB and allreduced bucket by bucket,
// asynchronously, so communication starts while later gradients are still
// being computed and small tensors do not each pay a collective's latency.
#ifndef DEEPNEX_COLLECTIVE_BUCKETING_H_
#define DEEPNEX_COLLECTIVE_BUCKETING_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "deepnex/collective/communicator.h"
#include "deepnex/status.h"
#include "deepnex/tensor.h"

namespace deepnex::collective {

struct BucketOptions {
  // Target bytes per bucket; a tensor larger than this is a bucket of its
  // own (allreduced in place, without a copy). Default: 25 MiB
  uint64_t bucket_bytes = 25ull << 20;
  // Default: kMean (averaged gradients)
  ReduceOp op = ReduceOp::kMean;
};

// Buckets over a fixed list of tensors (e.g. a model's gradients). Buckets
// are filled in reverse order of the list, the order in which backward
// produces gradients, and never mix dtypes. Every rank must build its
// bucketer from the same list (shapes and dtypes) and mark tensors in any
// order each round.
//
// Thread-compatible: one thread drives a round (MarkReady... then Wait).
class GradientBucketer {
 public:
  // REQUIRES: `comm` outlives the bucketer; the tensors stay alive and are
  // not written between MarkReady and Wait.
  static absl::StatusOr<std::unique_ptr<GradientBucketer>> Create(
      Communicator* comm, std::vector<TensorView> tensors, const BucketOptions& options = {});
  ~GradientBucketer();

  // Tensor `index` holds this round's gradient; when its bucket is complete,
  // the bucket is packed and its allreduce starts (asynchronously).
  // InvalidArgument for an index out of range or marked twice in a round.
  absl::Status MarkReady(size_t index);
  // Marks every tensor not yet marked.
  absl::Status MarkAllReady();
  // Waits for every bucket's allreduce, unpacks the results into the
  // tensors and starts a new round. The first error of the round, if any.
  absl::Status Wait();

  size_t num_buckets() const;
  // The bucket of each tensor, for tests and logs.
  std::vector<size_t> BucketOf() const;

 private:
  struct Impl;
  explicit GradientBucketer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace deepnex::collective

#endif  // DEEPNEX_COLLECTIVE_BUCKETING_H_
