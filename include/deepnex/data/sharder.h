// Data sharding for data-parallel training: each of a job's workers reads its
// own equal share of a dataset's indices, reshuffled every epoch, the same way
// on every rank and every platform, and can resume mid-epoch after a restart.
#ifndef DEEPNEX_DATA_SHARDER_H_
#define DEEPNEX_DATA_SHARDER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "deepnex/status.h"

namespace deepnex::data {

// What happens to the size % num_shards indices that do not divide evenly.
enum class Remainder {
  // Every shard gets floor(size / num_shards) indices; the rest of each
  // epoch's permutation is left out (a different rest every epoch).
  kDrop,
  // Every shard gets ceil(size / num_shards) indices; the permutation is
  // extended by repeating it from its start, as torch's DistributedSampler
  // does, so a few indices are seen twice per epoch.
  kPad,
};

struct SharderOptions {
  // Number of items; the indices are [0, size). Must be >= 1, and
  // >= num_shards with Remainder::kDrop.
  uint64_t size = 0;
  // Number of shards (the job's workers) and this one's index.
  int num_shards = 1;
  int shard = 0;
  // Shuffle every epoch with a permutation drawn from (seed, epoch); false
  // keeps the dataset's order, each shard a contiguous block.
  bool shuffle = true;
  uint64_t seed = 0;
  // Default: kPad (no item of the dataset is ever left out).
  Remainder remainder = Remainder::kPad;
};

// Parses "drop" or "pad"; InvalidArgument naming `field` otherwise.
absl::StatusOr<Remainder> ParseRemainder(const std::string& text,
                                         const std::string& field = "remainder");

// One shard's indices, epoch by epoch, with a cursor (epoch, position) that
// a trainer checkpoints and restores to resume where it stopped.
//
// Shard k of n takes the k-th contiguous block of the epoch's permutation, so
// the shards of one epoch are disjoint (with kDrop; with kPad only the
// repeated indices overlap) and together cover the dataset. The permutation
// is a Fisher-Yates shuffle driven by splitmix64, written here rather than
// taken from <random>/<algorithm>, whose distributions and std::shuffle differ
// between standard libraries: the same (seed, epoch) gives the same
// permutation everywhere, which is what keeps the ranks' shards disjoint.
//
// Thread-compatible.
class Sharder {
 public:
  static absl::StatusOr<Sharder> Create(const SharderOptions& options);

  const SharderOptions& options() const { return options_; }
  // Indices this shard yields per epoch.
  uint64_t shard_size() const { return shard_size_; }

  // The whole dataset's order in `epoch` (the identity without shuffle).
  std::vector<uint64_t> Permutation(uint64_t epoch) const;
  // This shard's indices in `epoch`, in the order Next yields them.
  std::vector<uint64_t> Indices(uint64_t epoch) const;

  // The cursor: the next index Next yields is Indices(epoch())[position()].
  uint64_t epoch() const { return epoch_; }
  uint64_t position() const { return position_; }
  // Moves the cursor. Seek(e, shard_size()) (epoch e done) is Seek(e + 1, 0);
  // a position past shard_size() is InvalidArgument.
  absl::Status Seek(uint64_t epoch, uint64_t position);

  // Up to `max_count` (0 counts as 1) next indices, never crossing into the next
  // epoch; advances the cursor past them, to (epoch + 1, 0) when they end
  // the epoch. Never empty: a stream of epochs without end.
  std::vector<uint64_t> Next(uint64_t max_count);

 private:
  Sharder(const SharderOptions& options, uint64_t shard_size);
  // Loads the cursor's epoch into current_ if it is not already there.
  void LoadEpoch();

  SharderOptions options_;
  uint64_t shard_size_;
  uint64_t epoch_ = 0;
  uint64_t position_ = 0;
  // Indices(loaded_epoch_), kept so that Next costs O(count), not O(size).
  std::vector<uint64_t> current_;
  bool loaded_ = false;
  uint64_t loaded_epoch_ = 0;
};

}  // namespace deepnex::data

#endif  // DEEPNEX_DATA_SHARDER_H_
