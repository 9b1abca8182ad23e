#include "deepnex/data/sharder.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace deepnex::data {
namespace {

// splitmix64 (Steele, Lea, Flood 2014): a 64-bit generator defined entirely
// by integer arithmetic, hence identical on every platform.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound), bound >= 1: rejects the low values that would make
  // `% bound` favour small results.
  uint64_t Below(uint64_t bound) {
    uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
    uint64_t x;
    do {
      x = Next();
    } while (x < threshold);
    return x % bound;
  }

 private:
  uint64_t state_;
};

// The generator's start for (seed, epoch): the seed and the epoch each go
// through a round of splitmix64 so that neighbouring seeds or epochs start far
// apart.
uint64_t StreamStart(uint64_t seed, uint64_t epoch) {
  uint64_t a = SplitMix64(seed).Next();
  uint64_t b = SplitMix64(epoch ^ 0x5851f42d4c957f2dull).Next();
  return a ^ (b * 0xff51afd7ed558ccdull);
}

// Indices per shard when `items` are split over num_shards >= 1 shards:
// every shard gets as many, the rest left out (kDrop) or padded (kPad).
uint64_t Share(uint64_t items, int num_shards, Remainder remainder) {
  const uint64_t n = static_cast<uint64_t>(num_shards);
  return remainder == Remainder::kDrop ? items / n : (items + n - 1) / n;
}

// Indices per shard of an epoch laid out for num_shards shards.
uint64_t ShardSize(const SharderOptions& options, int num_shards) {
  return Share(options.size, num_shards, options.remainder);
}

absl::Status CheckWorld(const SharderOptions& options, int num_shards, int shard) {
  if (num_shards <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_shards: ", num_shards, " must be at least 1"));
  }
  if (shard < 0 || shard >= num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard: ", shard, " is out of range [0, ", num_shards, ")"));
  }
  if (options.remainder == Remainder::kDrop && options.size < static_cast<uint64_t>(num_shards)) {
    return absl::InvalidArgumentError(
        absl::StrCat("size: ", options.size, " is below num_shards ", num_shards,
                     ": with remainder \"drop\" every shard would be empty"));
  }
  return absl::OkStatus();
}

using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;

uint64_t Total(const Ranges& ranges) {
  uint64_t total = 0;
  for (const auto& [first, second] : ranges) total += second - first;
  return total;
}

// Where block k of a re-sharded epoch's `total` items over n shards starts
// among them, and how many of them it takes: the first total % n blocks one
// more than the others (before the remainder policy evens them out).
struct Span {
  uint64_t start, length;
};
Span BlockSpan(uint64_t total, uint64_t n, uint64_t k) {
  const uint64_t q = total / n, r = total % n;
  return {k * q + std::min(k, r), q + (k < r ? 1 : 0)};
}

// The permutation positions of an epoch's blocks laid out for num_shards: the
// usual contiguous blocks (wrapping around for kPad), or with `ranges` the
// blocks of their items (see ShardState::ranges). Block(k) skips the whole
// ranges before block k from where the block before it began, so one block
// costs O(ranges + its length) and every block in turn O(ranges + items):
// Reshard, which walks a world's blocks, took O(num_shards * ranges) when
// each block skipped from the first range.
class Layout {
 public:
  Layout(const SharderOptions& options, int num_shards, const Ranges& ranges)
      : options_(options), n_(static_cast<uint64_t>(num_shards)), ranges_(ranges),
        total_(Total(ranges)) {}

  // REQUIRES: shard >= the shard of the call before.
  std::vector<uint64_t> Block(int shard) {
    const uint64_t k = static_cast<uint64_t>(shard);
    std::vector<uint64_t> out;
    if (ranges_.empty()) {
      const uint64_t shard_size = ShardSize(options_, static_cast<int>(n_));
      out.reserve(shard_size);
      // Padding wraps around the permutation (more than once when size < n).
      for (uint64_t i = 0; i < shard_size; ++i) out.push_back((k * shard_size + i) % options_.size);
      return out;
    }
    auto [start, length] = BlockSpan(total_, n_, k);
    // Every block as long as the others, as in a whole epoch (ranks that
    // take one batch a step end the epoch together; a torch DataLoader over
    // a shorter shard took one batch fewer, and DDP hung on it): kDrop
    // leaves out the last item of the longer blocks, kPad ends the shorter
    // ones with a repeat of the epoch's first items, as Horovod's
    // ElasticSampler pads its remaining indices.
    const uint64_t r = total_ % n_;
    const bool pad = options_.remainder == Remainder::kPad && r != 0 && k >= r;
    if (options_.remainder == Remainder::kDrop) length = total_ / n_;
    while (range_ < ranges_.size() && before_ + Length(range_) <= start) {
      before_ += Length(range_);
      ++range_;
    }
    out.reserve(length + (pad ? 1 : 0));
    uint64_t skip = start - before_;
    for (size_t i = range_; i < ranges_.size() && out.size() < length; ++i) {
      for (uint64_t p = ranges_[i].first + skip; p < ranges_[i].second && out.size() < length; ++p) {
        out.push_back(p);
      }
      skip = 0;
    }
    if (pad) out.push_back(Item((k - r) % total_));
    return out;
  }

 private:
  uint64_t Length(size_t range) const { return ranges_[range].second - ranges_[range].first; }
  // The index-th item of the ranges; O(1) amortized for the pads of the
  // blocks in turn, whose indices rise (wrapping only when total_ < n_).
  uint64_t Item(uint64_t index) {
    if (index < pad_before_) pad_range_ = pad_before_ = 0;
    while (pad_before_ + Length(pad_range_) <= index) pad_before_ += Length(pad_range_++);
    return ranges_[pad_range_].first + (index - pad_before_);
  }

  const SharderOptions& options_;
  const uint64_t n_;
  const Ranges& ranges_;
  const uint64_t total_;  // items in ranges_
  size_t range_ = 0;     // the first range that may hold the next block's items
  uint64_t before_ = 0;  // items in the ranges before it
  size_t pad_range_ = 0;  // the same for Item
  uint64_t pad_before_ = 0;
};

absl::Status CheckEpoch(uint64_t epoch, const char* field) {
  // Past it a cursor could count to 2^63, a state that Seek from Python (and
  // a checkpoint) refuses (probe).
  if (epoch > kMaxEpoch) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", epoch, " is past the last epoch, ", kMaxEpoch));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Remainder> ParseRemainder(const std::string& text, const std::string& field) {
  if (text == "drop") return Remainder::kDrop;
  if (text == "pad") return Remainder::kPad;
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": \"", text, "\" is not a remainder policy (drop or pad)"));
}

absl::StatusOr<Sharder> Sharder::Create(const SharderOptions& options) {
  if (options.size == 0) {
    return absl::InvalidArgumentError("size: 0; a dataset to shard needs at least 1 item");
  }
  // Past it, the first epoch asked for the memory: 2^62 items threw
  // std::length_error, 2^36 would have been killed by the OOM killer.
  if (options.size > kMaxSharderSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "size: ", options.size, " items is more than a Sharder holds (", kMaxSharderSize,
        ": each epoch's permutation is kept in memory, 8 bytes an item)"));
  }
  DEEPNEX_RETURN_IF_ERROR(CheckWorld(options, options.num_shards, options.shard));
  return Sharder(options, ShardSize(options, options.num_shards));
}

Sharder::Sharder(const SharderOptions& options, uint64_t shard_size)
    : options_(options), shard_size_(shard_size) {}

std::vector<uint64_t> Sharder::Permutation(uint64_t epoch) const {
  std::vector<uint64_t> order(options_.size);
  std::iota(order.begin(), order.end(), uint64_t{0});
  if (!options_.shuffle) return order;
  SplitMix64 rng(StreamStart(options_.seed, epoch));
  for (uint64_t i = options_.size - 1; i > 0; --i) {
    std::swap(order[i], order[rng.Below(i + 1)]);
  }
  return order;
}

std::vector<uint64_t> Sharder::Indices(uint64_t epoch) const {
  std::vector<uint64_t> order = Permutation(epoch);
  const Ranges none;
  std::vector<uint64_t> out =
      Layout(options_, options_.num_shards, Resharded(epoch) ? ranges_ : none)
          .Block(options_.shard);
  for (uint64_t& p : out) p = order[p];
  return out;
}

uint64_t Sharder::EpochLength(uint64_t epoch) const {
  if (!Resharded(epoch)) return shard_size_;
  return Share(Total(ranges_), options_.num_shards, options_.remainder);
}

uint64_t Sharder::remaining() const { return EpochLength(epoch_) - position_; }

absl::Status Sharder::Seek(uint64_t epoch, uint64_t position) {
  DEEPNEX_RETURN_IF_ERROR(CheckEpoch(epoch, "epoch"));
  const uint64_t length = EpochLength(epoch);
  if (position > length) {
    return absl::InvalidArgumentError(absl::StrCat("position: ", position,
                                                   " is past the shard's ", length,
                                                   " indices per epoch"));
  }
  epoch_ = epoch;
  position_ = position;
  if (position_ == length) {
    ++epoch_;
    position_ = 0;
  }
  return absl::OkStatus();
}

ShardState Sharder::state() const {
  ShardState out;
  out.epoch = epoch_;
  out.position = position_;
  out.num_shards = options_.num_shards;
  if (Resharded(epoch_)) out.ranges = ranges_;
  return out;
}

absl::Status Sharder::Reshard(const ShardState& from, int num_shards, int shard) {
  DEEPNEX_RETURN_IF_ERROR(CheckWorld(options_, num_shards, shard));
  DEEPNEX_RETURN_IF_ERROR(CheckEpoch(from.epoch, "state.epoch"));
  // The old world's blocks are laid out one by one below; a world past the
  // dataset's size (or a job's) is no state this dataset's sharders made.
  const uint64_t max_shards = std::max<uint64_t>(options_.size, kMaxReshardFrom);
  if (from.num_shards <= 0 || static_cast<uint64_t>(from.num_shards) > max_shards) {
    return absl::InvalidArgumentError(absl::StrCat("state.num_shards: ", from.num_shards,
                                                   " is not in 1-", max_shards));
  }
  uint64_t end = 0;  // of the range before
  for (const auto& [first, second] : from.ranges) {
    if (first >= second || second > options_.size) {
      return absl::InvalidArgumentError(
          absl::StrCat("state.ranges: [", first, ", ", second,
                       ") is not a non-empty range within [0, ", options_.size, ")"));
    }
    // Overlapping ranges would hand their items out twice.
    if (first < end) {
      return absl::InvalidArgumentError(
          absl::StrCat("state.ranges: [", first, ", ", second, ") overlaps or precedes the "
                       "range before it (ranges are disjoint, in order)"));
    }
    end = second;
  }
  const uint64_t from_length =
      Share(from.ranges.empty() ? options_.size : Total(from.ranges), from.num_shards,
            options_.remainder);
  if (from.position > from_length) {
    return absl::InvalidArgumentError(absl::StrCat("state.position: ", from.position,
                                                   " is past the epoch's ", from_length,
                                                   " positions"));
  }
  uint64_t epoch = from.epoch;
  Ranges ranges;
  if (from.position == from_length) {
    ++epoch;  // from's epoch is done: the next one is laid out for the new world
  } else if (from.num_shards == num_shards) {
    ranges = from.ranges;  // the same world: a resume
  } else if (from.position > 0 || !from.ranges.empty()) {
    // What no shard has handed out yet: the unread rest of every block, less
    // what a block read already (kPad repeats the permutation's start).
    enum Seen : uint8_t { kNot, kUnread, kRead };
    std::vector<uint8_t> seen(options_.size, kNot);
    Layout layout(options_, from.num_shards, from.ranges);
    for (int k = 0; k < from.num_shards; ++k) {
      const std::vector<uint64_t> block = layout.Block(k);
      for (uint64_t i = 0; i < block.size(); ++i) {
        uint8_t& p = seen[block[i]];
        if (i < from.position) {
          p = kRead;
        } else if (p == kNot) {
          p = kUnread;
        }
      }
    }
    for (uint64_t p = 0; p < options_.size; ++p) {
      if (seen[p] != kUnread) continue;
      if (!ranges.empty() && ranges.back().second == p) {
        ++ranges.back().second;
      } else {
        ranges.emplace_back(p, p + 1);
      }
    }
    // Nothing left, or with kDrop fewer items than shards: the next epoch.
    if (Share(Total(ranges), num_shards, options_.remainder) == 0) {
      ranges.clear();
      ++epoch;
    }
  }
  options_.num_shards = num_shards;
  options_.shard = shard;
  shard_size_ = ShardSize(options_, num_shards);
  ranges_ = std::move(ranges);
  reshard_epoch_ = epoch;
  epoch_ = epoch;
  position_ = from.num_shards == num_shards && epoch == from.epoch ? from.position : 0;
  loaded_ = false;
  return absl::OkStatus();
}

void Sharder::LoadEpoch() {
  if (loaded_ && loaded_epoch_ == epoch_) return;
  current_ = Indices(epoch_);
  loaded_ = true;
  loaded_epoch_ = epoch_;
}

std::vector<uint64_t> Sharder::Next(uint64_t max_count) {
  LoadEpoch();
  const uint64_t length = EpochLength(epoch_);
  const uint64_t count = std::min(std::max<uint64_t>(max_count, 1), length - position_);
  std::vector<uint64_t> out(current_.begin() + position_, current_.begin() + position_ + count);
  position_ += count;
  if (position_ == length) {
    ++epoch_;
    position_ = 0;
  }
  return out;
}

}  // namespace deepnex::data
