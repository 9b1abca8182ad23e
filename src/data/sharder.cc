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

}  // namespace

absl::StatusOr<Remainder> ParseRemainder(const std::string& text, const std::string& field) {
  if (text == "drop") return Remainder::kDrop;
  if (text == "pad") return Remainder::kPad;
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": \"", text, "\" is not a remainder policy (drop or pad)"));
}

absl::StatusOr<Sharder> Sharder::Create(const SharderOptions& options) {
  if (options.num_shards <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_shards: ", options.num_shards, " must be at least 1"));
  }
  if (options.shard < 0 || options.shard >= options.num_shards) {
    return absl::InvalidArgumentError(absl::StrCat("shard: ", options.shard,
                                                   " is out of range [0, ",
                                                   options.num_shards, ")"));
  }
  if (options.size == 0) {
    return absl::InvalidArgumentError("size: 0; a dataset to shard needs at least 1 item");
  }
  const uint64_t n = static_cast<uint64_t>(options.num_shards);
  if (options.remainder == Remainder::kDrop && options.size < n) {
    return absl::InvalidArgumentError(
        absl::StrCat("size: ", options.size, " is below num_shards ", n,
                     ": with remainder \"drop\" every shard would be empty"));
  }
  uint64_t shard_size =
      options.remainder == Remainder::kDrop ? options.size / n : (options.size + n - 1) / n;
  return Sharder(options, shard_size);
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
  std::vector<uint64_t> out(shard_size_);
  const uint64_t first = static_cast<uint64_t>(options_.shard) * shard_size_;
  // Padding wraps around the permutation (more than once when size < n).
  for (uint64_t i = 0; i < shard_size_; ++i) out[i] = order[(first + i) % options_.size];
  return out;
}

absl::Status Sharder::Seek(uint64_t epoch, uint64_t position) {
  if (position > shard_size_) {
    return absl::InvalidArgumentError(absl::StrCat("position: ", position,
                                                   " is past the shard's ", shard_size_,
                                                   " indices per epoch"));
  }
  epoch_ = epoch;
  position_ = position;
  if (position_ == shard_size_) {
    ++epoch_;
    position_ = 0;
  }
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
  uint64_t count = std::min(std::max<uint64_t>(max_count, 1), shard_size_ - position_);
  std::vector<uint64_t> out(current_.begin() + position_, current_.begin() + position_ + count);
  position_ += count;
  if (position_ == shard_size_) {
    ++epoch_;
    position_ = 0;
  }
  return out;
}

}  // namespace deepnex::data
