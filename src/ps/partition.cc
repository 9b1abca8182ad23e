#include "ps/partition.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <list>
#include <mutex>

#include "absl/strings/str_format.h"
#include "ps/update.h"

namespace deepnex::ps {
namespace {

// Gradients are read in chunks small enough to stay in cache.
constexpr size_t kChunkElems = 16384;

// Converts `n` elements stored as `dtype` into the compute type T.
template <typename T>
void ToCompute(DType dtype, const char* src, T* dst, size_t n) {
  switch (dtype) {
    case DType::kFloat16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = HalfToFloat(h);
      }
      return;
    case DType::kBFloat16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        dst[i] = BFloat16ToFloat(b);
      }
      return;
    default:  // float32 into float, float64 into double
      std::memcpy(dst, src, n * sizeof(T));
  }
}

template <typename T>
void FromCompute(DType dtype, const T* src, char* dst, size_t n) {
  switch (dtype) {
    case DType::kFloat16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h = FloatToHalf(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    case DType::kBFloat16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t b = FloatToBFloat16(src[i]);
        std::memcpy(dst + 2 * i, &b, 2);
      }
      return;
    default:
      std::memcpy(dst, src, n * sizeof(T));
  }
}

// Reads the next `count` elements of `payload` chunk by chunk as T and calls
// fn(chunk, first_element, n) for each chunk.
template <typename T, typename Fn>
void ForEachChunk(DType dtype, uint64_t count, PayloadReader* payload, Fn fn) {
  thread_local std::vector<char> raw;
  thread_local std::vector<T> values;
  const size_t elem = DTypeSize(dtype);
  raw.resize(kChunkElems * elem);
  values.resize(kChunkElems);
  for (uint64_t done = 0; done < count;) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(kChunkElems, count - done));
    payload->Read(raw.data(), n * elem);
    ToCompute<T>(dtype, raw.data(), values.data(), n);
    fn(values.data(), done, n);
    done += n;
  }
}

template <typename T>
class TypedPartition final : public Partition {
 public:
  TypedPartition(const PartitionConfig& config, DType dtype, uint64_t offset,
                 uint64_t count)
      : Partition(dtype, offset, count),
        config_(config),
        values_(count),
        next_round_(config.num_workers, 1),
        contributed_(config.num_workers, false) {
    if (UsesFirstMoment(config.optimizer)) m_.assign(count, T(0));
    if (UsesSecondMoment(config.optimizer)) {
      v_.assign(count, static_cast<T>(config.optimizer.kind ==
                                              OptimizerKind::kAdagrad
                                          ? config.optimizer.initial_accumulator
                                          : 0.0));
    }
    if (config.mode == Mode::kSync) acc_.assign(count, T(0));
  }

  void Write(PayloadReader* payload) override {
    std::lock_guard<std::mutex> lock(mu_);
    ForEachChunk<T>(dtype_, count_, payload, [&](const T* g, uint64_t at, size_t n) {
      std::copy(g, g + n, values_.begin() + at);
    });
  }

  absl::Status CheckFinite(PayloadReader* payload) const override {
    absl::Status status;
    ForEachChunk<T>(dtype_, count_, payload, [&](const T* g, uint64_t at, size_t n) {
      if (!status.ok()) return;
      // x * 0 is NaN exactly for NaN and Inf; the sum vectorizes, and the
      // element is looked for only when there is one.
      T probe = 0;
      for (size_t i = 0; i < n; ++i) probe += g[i] * T(0);
      if (probe == T(0)) return;
      for (size_t i = 0; i < n; ++i) {
        if (!std::isfinite(g[i])) {
          status = absl::InvalidArgumentError(absl::StrFormat(
              "element %d is %g", offset_ + at + i, static_cast<double>(g[i])));
          return;
        }
      }
    });
    return status;
  }

  void Push(int worker, uint64_t round, PayloadReader* payload,
            std::shared_ptr<PushSink> sink, size_t slice,
            Completions* done) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (round < next_round_[worker]) {  // a retry of an applied push
      payload->Skip(bytes());
      done->push_back([sink, slice] { sink->SliceApplied(slice); });
      return;
    }
    if (!Eligible(worker, round)) {
      Deferred d{worker, round, sink, slice, std::vector<T>(count_)};
      ForEachChunk<T>(dtype_, count_, payload, [&](const T* g, uint64_t at, size_t n) {
        std::copy(g, g + n, d.grad.begin() + at);
      });
      deferred_.push_back(std::move(d));
      return;
    }
    ForEachChunk<T>(dtype_, count_, payload, [&](const T* g, uint64_t at, size_t n) {
      Consume(g, at, n);
    });
    Finish(worker, done);
    done->push_back([sink, slice] { sink->SliceApplied(slice); });
    DrainDeferred(done);
  }

  void Pull(uint64_t min_version, std::shared_ptr<PullSink> sink, size_t slice,
            Completions* done) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (version_ >= min_version) {
      CopyOut(sink, slice, done);
    } else {
      waiters_.push_back({min_version, std::move(sink), slice});
    }
  }

  uint64_t version() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return version_;
  }

  uint64_t next_round(int worker) const override {
    std::lock_guard<std::mutex> lock(mu_);
    return next_round_[worker];
  }

  void DropWaiters() override {
    std::lock_guard<std::mutex> lock(mu_);
    waiters_.clear();
    deferred_.clear();
  }

 private:
  struct Waiter {
    uint64_t min_version;
    std::shared_ptr<PullSink> sink;
    size_t slice;
  };
  struct Deferred {
    int worker;
    uint64_t round;
    std::shared_ptr<PushSink> sink;
    size_t slice;
    std::vector<T> grad;
  };

  // REQUIRES: mu_ held, round >= next_round_[worker].
  bool Eligible(int worker, uint64_t round) const {
    if (round != next_round_[worker]) return false;  // an earlier one is missing
    return config_.mode == Mode::kAsync || round == version_ + 1;
  }

  // Adds a chunk of gradient: into the round's accumulator (sync) or the
  // values through the optimizer (async). REQUIRES: mu_ held.
  void Consume(const T* g, uint64_t at, size_t n) {
    if (config_.mode == Mode::kAsync) {
      ApplyUpdate<T>(config_.optimizer, step_ + 1, T(1), values_.data() + at, g,
                     m_.empty() ? nullptr : m_.data() + at,
                     v_.empty() ? nullptr : v_.data() + at, n);
      return;
    }
    T* acc = acc_.data() + at;
    if (contributions_ == 0) {
      std::copy(g, g + n, acc);
    } else {
      for (size_t i = 0; i < n; ++i) acc[i] += g[i];
    }
  }

  // Records worker's push as complete; closes a round when it is full.
  // REQUIRES: mu_ held.
  void Finish(int worker, Completions* done) {
    ++next_round_[worker];
    if (config_.mode == Mode::kAsync) {
      ++step_;
      ++version_;
      ReleaseWaiters(done);
      return;
    }
    contributed_[worker] = true;
    if (++contributions_ < config_.num_workers) return;
    T scale = config_.reduction == Reduction::kMean
                  ? T(1) / static_cast<T>(config_.num_workers)
                  : T(1);
    ++step_;
    ApplyUpdate<T>(config_.optimizer, step_, scale, values_.data(), acc_.data(),
                   m_.empty() ? nullptr : m_.data(),
                   v_.empty() ? nullptr : v_.data(), count_);
    contributions_ = 0;
    std::fill(contributed_.begin(), contributed_.end(), false);
    ++version_;
    ReleaseWaiters(done);
  }

  // Applies deferred pushes that have become eligible. REQUIRES: mu_ held.
  void DrainDeferred(Completions* done) {
    bool progress = true;
    while (progress && !deferred_.empty()) {
      progress = false;
      for (auto it = deferred_.begin(); it != deferred_.end(); ++it) {
        if (it->sink->Finished()) {
          deferred_.erase(it);
          progress = true;
          break;
        }
        if (!Eligible(it->worker, it->round)) continue;
        Consume(it->grad.data(), 0, count_);
        Finish(it->worker, done);
        done->push_back([sink = it->sink, slice = it->slice] {
          sink->SliceApplied(slice);
        });
        deferred_.erase(it);
        progress = true;
        break;
      }
    }
  }

  // REQUIRES: mu_ held.
  void ReleaseWaiters(Completions* done) {
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->sink->Finished()) {
        it = waiters_.erase(it);
      } else if (version_ >= it->min_version) {
        CopyOut(it->sink, it->slice, done);
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // REQUIRES: mu_ held.
  void CopyOut(const std::shared_ptr<PullSink>& sink, size_t slice,
               Completions* done) {
    FromCompute<T>(dtype_, values_.data(), sink->Destination(slice), count_);
    done->push_back([sink, slice, v = version_] { sink->SliceReady(slice, v); });
  }

  const PartitionConfig config_;
  mutable std::mutex mu_;
  std::vector<T> values_;
  std::vector<T> m_, v_;          // optimizer moments (empty when unused)
  std::vector<T> acc_;            // sync: the open round's sum
  uint64_t version_ = 0;          // updates applied
  uint64_t step_ = 0;             // optimizer steps taken
  std::vector<uint64_t> next_round_;  // per worker
  std::vector<bool> contributed_;     // sync: who pushed into the open round
  int contributions_ = 0;
  std::list<Waiter> waiters_;
  std::list<Deferred> deferred_;
};

}  // namespace

std::unique_ptr<Partition> Partition::Create(const PartitionConfig& config,
                                             DType dtype, uint64_t offset,
                                             uint64_t count) {
  if (dtype == DType::kFloat64) {
    return std::make_unique<TypedPartition<double>>(config, dtype, offset, count);
  }
  return std::make_unique<TypedPartition<float>>(config, dtype, offset, count);
}

}  // namespace deepnex::ps
