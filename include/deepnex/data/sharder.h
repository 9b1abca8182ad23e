// Data sharding for data-parallel training: each of a job's workers reads its
// own equal share of a dataset's indices, reshuffled every epoch, the same way
// on every rank and every platform, and can resume mid-epoch after a restart.
#ifndef DEEPNEX_DATA_SHARDER_H_
#define DEEPNEX_DATA_SHARDER_H_

#include <cstdint>
#include <string>
#include <utility>
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

// The most items a Sharder takes: it holds each epoch's permutation in
// memory, 8 bytes an item (32 GiB here), as torch's DistributedSampler does.
inline constexpr uint64_t kMaxSharderSize = uint64_t{1} << 32;

struct SharderOptions {
  // Number of items; the indices are [0, size). Must be >= 1, at most
  // kMaxSharderSize, and >= num_shards with Remainder::kDrop.
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

// Where a world of shards in lockstep stands: what Sharder::state() returns
// and what Sharder::Reshard continues from. Ranks that take one batch each
// per step share their cursor, so any one shard's state describes the whole
// world: that is what lets rank 0 alone hand it to a new world.
struct ShardState {
  uint64_t epoch = 0;
  uint64_t position = 0;
  int num_shards = 1;
  // Empty: `epoch` is laid out as every other epoch. Otherwise `epoch` was
  // re-sharded mid-way: its items are the permutation positions in these
  // [first, second) ranges, in this order, and shard k of num_shards takes
  // the k-th of num_shards contiguous blocks of them, the first
  // r = total % num_shards blocks one item longer than the others. The
  // remainder policy then makes them all as long: kDrop leaves out those r
  // blocks' last items, kPad ends each other block k with the (k - r)-th
  // item (mod total).
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
};

// Parses "drop" or "pad"; InvalidArgument naming `field` otherwise.
absl::StatusOr<Remainder> ParseRemainder(const std::string& text,
                                         const std::string& field = "remainder");

// The last epoch a cursor moves to (Seek, Reshard): from there it counts
// 2^62 epochs more before its state no longer fits a signed 64-bit int
// (Python's, a checkpoint's).
inline constexpr uint64_t kMaxEpoch = (uint64_t{1} << 62);

// The largest world a Reshard continues from, beyond a dataset's size.
inline constexpr uint64_t kMaxReshardFrom = 1 << 16;

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
// A job whose world changes mid-epoch (elastic training) re-shards: Reshard
// splits the items of the epoch that no shard has handed out yet over the new
// world (the padding's repeats already seen left out), every shard as many
// as the others, as in any epoch: kPad repeats a few of them, kDrop leaves
// fewer than num_shards out. Later epochs are laid out for the new world as
// usual.
//
// Thread-compatible.
class Sharder {
 public:
  static absl::StatusOr<Sharder> Create(const SharderOptions& options);

  const SharderOptions& options() const { return options_; }
  // Indices this shard yields per epoch (one that was not re-sharded).
  uint64_t shard_size() const { return shard_size_; }
  // Indices every shard yields in the cursor's epoch: shard_size(), or the
  // re-sharded epoch's share.
  uint64_t epoch_length() const { return EpochLength(epoch_); }
  // Indices Next yields from the cursor to the end of its epoch:
  // epoch_length() - position(), the same on every shard.
  uint64_t remaining() const;

  // The whole dataset's order in `epoch` (the identity without shuffle).
  std::vector<uint64_t> Permutation(uint64_t epoch) const;
  // This shard's indices in `epoch`, in the order Next yields them.
  std::vector<uint64_t> Indices(uint64_t epoch) const;

  // The cursor: the next index Next yields is Indices(epoch())[position()].
  uint64_t epoch() const { return epoch_; }
  uint64_t position() const { return position_; }
  // Moves the cursor. Seek(e, length) (epoch e done) is Seek(e + 1, 0);
  // a position past epoch e's length, or an epoch past kMaxEpoch, is
  // InvalidArgument.
  absl::Status Seek(uint64_t epoch, uint64_t position);

  // The cursor, the world, and the layout of a re-sharded cursor epoch.
  ShardState state() const;
  // Continues `from` (the state() of any shard of a world in lockstep) as
  // shard `shard` of `num_shards`. The same world: a resume at from's cursor.
  // Another world: from's epoch's items that no shard of that world has
  // handed out are split over the new world, in permutation order, and the
  // cursor is at their start (from position 0 of a laid-out epoch: that
  // epoch laid out for the new world; nothing left, or with kDrop fewer
  // items than num_shards: the next epoch).
  // InvalidArgument naming the field for a bad world or state (a range
  // outside [0, size) or overlapping another, a position past the epoch,
  // from.num_shards past max(size, kMaxReshardFrom)).
  absl::Status Reshard(const ShardState& from, int num_shards, int shard);

  // The next `max_count` (0 counts as 1) indices, fewer only where the epoch
  // ends (never crossing into the next one); advances the cursor past them,
  // to (epoch + 1, 0) when they end the epoch: a stream of epochs without end.
  std::vector<uint64_t> Next(uint64_t max_count);

 private:
  Sharder(const SharderOptions& options, uint64_t shard_size);
  // Loads the cursor's epoch into current_ if it is not already there.
  void LoadEpoch();
  bool Resharded(uint64_t epoch) const { return !ranges_.empty() && epoch == reshard_epoch_; }
  uint64_t EpochLength(uint64_t epoch) const;

  SharderOptions options_;
  uint64_t shard_size_;
  uint64_t epoch_ = 0;
  uint64_t position_ = 0;
  // The layout of epoch reshard_epoch_ (see ShardState::ranges); empty when
  // no epoch is re-sharded.
  std::vector<std::pair<uint64_t, uint64_t>> ranges_;
  uint64_t reshard_epoch_ = 0;
  // Indices(loaded_epoch_), kept so that Next costs O(count), not O(size).
  std::vector<uint64_t> current_;
  bool loaded_ = false;
  uint64_t loaded_epoch_ = 0;
};

}  // namespace deepnex::data

#endif  // DEEPNEX_DATA_SHARDER_H_
