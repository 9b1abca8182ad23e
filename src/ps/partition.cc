#include "ps/partition.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <chrono>
#include <deque>
#include <iterator>
#include <limits>
#include <list>
#include <memory>
#include <mutex>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ps/update.h"
#include "ps/values.h"

namespace deepnex::ps {
namespace {

template <typename T>
class TypedPartition final : public Partition {
 public:
  TypedPartition(const PartitionConfig& config, DType dtype, uint64_t offset,
                 uint64_t count)
      : Partition(dtype, offset, count),
        config_(config),
        values_(std::make_shared<Values>(count)),
        workers_(config.num_workers) {
    if (UsesFirstMoment(config.optimizer)) m_.assign(count, T(0));
    if (UsesSecondMoment(config.optimizer)) {
      v_.assign(count, static_cast<T>(config.optimizer.kind ==
                                              OptimizerKind::kAdagrad
                                          ? config.optimizer.initial_accumulator
                                          : 0.0));
    }
  }

  void Write(PayloadReader* payload) override {
    std::lock_guard<std::mutex> lock(mu_);
    T* out = Writable().out;
    ForEachChunk<T>(dtype_, count_, payload, /*check=*/false,
                    [&](const T* g, uint64_t at, size_t n) { std::copy(g, g + n, out + at); });
  }

  absl::Status CheckFinite(const std::string& key, PayloadReader* payload) const override {
    absl::Status finite = CheckFiniteBits(dtype_, offset_, count_, payload);
    if (finite.ok()) return finite;
    return RefuseNonFinite(key, std::string(finite.message()));
  }

  void Push(int worker, uint64_t incarnation, uint64_t seq, const std::string& key,
            bool check_finite, PayloadReader* payload, std::shared_ptr<PushSink> sink,
            size_t slice, Completions* done) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto refuse = [&](absl::Status s) { done->push_back([sink, s] { sink->Fail(s); }); };
    auto fail = [&](absl::Status s) {
      payload->Skip(bytes());
      refuse(std::move(s));
    };
    auto non_finite = [&](int64_t element) {
      refuse(RefuseNonFinite(key, absl::StrFormat("element %d is NaN or Inf", offset_ + element)));
    };
    absl::Status bound = Bind(worker, incarnation);
    if (!bound.ok()) return fail(bound);
    WorkerState& ws = workers_[worker];
    if (seq < ws.next_seq) {  // a retry of an applied push
      payload->Skip(bytes());
      done->push_back([sink, slice] { sink->SliceApplied(slice); });
      return;
    }
    if (seq > ws.next_seq && ws.restored) return fail(Lost(worker, ws));
    // Under lease_policy abort a dead worker's round never completes: a push
    // fails at once naming it, as a pull does (a probe's next push after the
    // abort waited out its client's whole timeout, naming no one).
    if (std::string reason = config_.membership->AbortReason(); !reason.empty()) {
      return fail(absl::AbortedError(reason));
    }
    if (!Eligible(worker, seq)) {
      // Pushes whose callers went are dropped here too, so that a worker
      // that keeps sending out of order is held to what is still wanted.
      DropFinishedLocked();
      const uint64_t kept = count_ * sizeof(T);
      if (config_.deferred_limit != nullptr) {
        absl::Status taken = config_.deferred_limit->Take(worker, kept);
        if (!taken.ok()) return fail(taken);
      }
      Deferred d{worker, seq, sink, slice, std::vector<T>(count_)};
      int64_t bad = ForEachChunk<T>(dtype_, count_, payload, check_finite,
                                    [&](const T* g, uint64_t at, size_t n) {
                                      std::copy(g, g + n, d.grad.begin() + at);
                                    });
      if (bad >= 0) {
        if (config_.deferred_limit != nullptr) config_.deferred_limit->Give(worker, kept);
        return non_finite(bad);
      }
      deferred_.push_back(std::move(d));
      return;
    }
    if (check_finite && config_.mode == Mode::kAsync) {
      // Async pushes update the values in place: a bad one must be found
      // before any of it is applied, in a pass of its own.
      PayloadReader scan = *payload;
      absl::Status finite = CheckFiniteBits(dtype_, offset_, count_, &scan);
      if (!finite.ok()) return fail(RefuseNonFinite(key, std::string(finite.message())));
    }
    char* reply = config_.mode == Mode::kAsync && dtype_ == kStored
                      ? sink->ValuesAsApplied(slice)
                      : nullptr;
    int64_t bad = Accept(worker, payload, nullptr,
                         check_finite && config_.mode != Mode::kAsync, done, reply);
    if (bad >= 0) return non_finite(bad);
    if (reply != nullptr) {
      done->push_back([sink, slice, v = version_] { sink->SliceServed(slice, v); });
    }
    // What the push releases goes first: the pulls of the workers that
    // waited for this round are answered before this push's own reply
    // (in a PushPull, its values). Answered last, the push that closed the
    // round came first to the next one and waited there: the workers took
    // turns at a long round, each worker's step time jittered by a reply's
    // send time, and the round's slowest worker was always a long one.
    Progress(done);
    done->push_back([sink, slice] { sink->SliceApplied(slice); });
  }

  void Pull(int worker, uint64_t incarnation, uint64_t last_seq,
            std::shared_ptr<PullSink> sink, size_t slice, Completions* done) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (worker == kObserver) {  // reads the values as they are
      CopyOut(Waiter{worker, 0, 0, std::move(sink), slice}, done);
      return;
    }
    absl::Status bound = Bind(worker, incarnation);
    if (!bound.ok()) {
      done->push_back([sink, bound] { sink->Fail(bound); });
      return;
    }
    WorkerState& ws = workers_[worker];
    if (last_seq >= ws.next_seq && ws.restored) {
      absl::Status lost = Lost(worker, ws);
      done->push_back([sink, lost] { sink->Fail(lost); });
      return;
    }
    if (last_seq > std::numeric_limits<uint64_t>::max() - ws.first_round) {
      absl::Status bad = absl::InvalidArgumentError(
          absl::StrFormat("pull: seq %d is out of range", last_seq));
      done->push_back([sink, bad] { sink->Fail(bad); });
      return;
    }
    Waiter w{worker, 0, 0, std::move(sink), slice};
    if (last_seq > 0) {
      if (config_.mode == Mode::kAsync) {
        w.min_seq = last_seq;  // read your own writes
      } else {
        uint64_t round = ws.first_round + last_seq - 1;
        w.min_version = round > static_cast<uint64_t>(config_.staleness)
                            ? round - config_.staleness
                            : 0;
      }
    }
    if (Ready(w)) {
      CopyOut(w, done);
      return;
    }
    std::string reason = config_.membership->AbortReason();
    if (!reason.empty()) {
      done->push_back([sink = w.sink, reason] { sink->Fail(absl::AbortedError(reason)); });
      return;
    }
    DropFinishedLocked();
    waiters_.push_back(std::move(w));
  }

  void MembershipChanged(Completions* done) override {
    std::lock_guard<std::mutex> lock(mu_);
    Progress(done);
  }

  void FailWaiters(const absl::Status& status, Completions* done) override {
    std::lock_guard<std::mutex> lock(mu_);
    FailAll(status, done);
  }

  void DropFinished() override {
    std::lock_guard<std::mutex> lock(mu_);
    DropFinishedLocked();
  }

  void SnapshotAt(uint64_t round, std::function<void(PartitionState)> fn,
                  Completions* done) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (config_.mode == Mode::kAsync || version_ >= round) {
      done->push_back([fn, state = Snapshot()]() mutable { fn(std::move(state)); });
      return;
    }
    snapshots_.push_back({round, std::move(fn)});
  }

  void Restore(const PartitionState& state) override {
    std::lock_guard<std::mutex> lock(mu_);
    version_ = state.version;
    step_ = state.step;
    auto load = [](const std::string& raw, std::vector<T>* out) {
      if (raw.empty()) return;
      out->resize(raw.size() / sizeof(T));
      std::memcpy(out->data(), raw.data(), raw.size());
    };
    if (!state.values.empty()) {
      values_ = std::make_shared<Values>(0);  // replies may hold the old ones
      load(state.values, &values_->data);
    }
    load(state.m, &m_);
    load(state.v, &v_);
    for (size_t w = 0; w < workers_.size() && w < state.workers.size(); ++w) {
      workers_[w] = {state.workers[w].incarnation, state.workers[w].first_round,
                     state.workers[w].next_seq, /*restored=*/true};
    }
  }

  uint64_t version() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return version_;
  }

  std::vector<int> Awaited(int worker) const override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int> out;
    if (config_.mode == Mode::kAsync) return out;
    const WorkerState& ws = workers_[worker];
    if (ws.incarnation == 0) return out;
    const uint64_t staleness = static_cast<uint64_t>(config_.staleness);
    // The last round that must be complete: as Ready, its pull needs the
    // round of its last push, less staleness; as Eligible, a push it
    // deferred needs the round before its own, less staleness.
    uint64_t needed = 0;
    if (ws.next_seq > 1) {
      const uint64_t last = RoundOf(worker, ws.next_seq - 1);
      if (last > staleness) needed = last - staleness;
    }
    for (const Deferred& d : deferred_) {
      if (d.worker != worker) continue;
      const uint64_t round = RoundOf(worker, d.seq);
      if (round > staleness + 1) needed = std::max(needed, round - 1 - staleness);
    }
    if (needed <= version_) return out;
    const uint64_t rounds = needed - version_;
    for (int w = 0; w < config_.num_workers; ++w) {
      if (!config_.membership->Required(w)) continue;
      for (uint64_t i = 0; i < rounds; ++i) {
        const bool in = i < open_.size() && !open_[i].contributed.empty() &&
                        open_[i].contributed[w];
        if (!in) {
          out.push_back(w);
          break;
        }
      }
    }
    return out;
  }

 private:
  struct WorkerState {
    uint64_t incarnation = 0;  // the client whose seqs these are
    uint64_t first_round = 1;  // the round of its seq 1
    uint64_t next_seq = 1;     // the seq it pushes next
    bool restored = false;     // from a checkpoint: later seqs may be lost
  };
  struct Waiter {
    int worker;
    uint64_t min_version;
    uint64_t min_seq;
    std::shared_ptr<PullSink> sink;
    size_t slice;
  };
  struct Deferred {
    int worker;
    uint64_t seq;
    std::shared_ptr<PushSink> sink;
    size_t slice;
    std::vector<T> grad;
  };
  // A push kept where it was received (Hold).
  struct Held {
    grpc::Slice slice;  // keeps `values` as they are
    const T* values;
  };
  // A round that some worker pushed into and that is not applied yet.
  struct Round {
    // Keep policy: the contributions, held where they were received or
    // added into `sum` (the rest of them).
    std::vector<Held> held;
    std::vector<T> sum;
    std::vector<std::vector<T>> by_worker;  // drop policy: each worker's
    std::vector<char> contributed;
    int contributions = 0;
    std::chrono::steady_clock::time_point opened;
  };
  static constexpr DType kStored = std::is_same_v<T, double> ? DType::kFloat64 : DType::kFloat32;
  // Pushes a round holds at most: two cover two workers' round without a
  // copy; with more workers the rest are added into the sum, so the memory
  // a round keeps does not grow with the number of workers.
  static constexpr size_t kMaxHeld = 2;
  struct SnapshotRequest {
    uint64_t round;
    std::function<void(PartitionState)> fn;
  };

  // Ties `worker`'s state here to the client `incarnation`, starting a
  // newly registered one at the first round it has not pushed into.
  // REQUIRES: mu_ held.
  absl::Status Bind(int worker, uint64_t incarnation) {
    WorkerState& ws = workers_[worker];
    if (ws.incarnation == incarnation) return absl::OkStatus();
    if (config_.membership->Incarnation(worker) != incarnation) {
      return absl::AbortedError(absl::StrFormat(
          "worker %d: this client is not the registered one (the worker was "
          "registered again, or the server restarted); register again",
          worker));
    }
    uint64_t next_round = ws.incarnation ? ws.first_round + ws.next_seq - 1 : 1;
    ws = {incarnation, std::max(next_round, version_ + 1), 1, false};
    return absl::OkStatus();
  }

  absl::Status Lost(int worker, const WorkerState& ws) const {
    return absl::AbortedError(absl::StrFormat(
        "worker %d: the server restarted from a checkpoint at round %d and "
        "lost this worker's later pushes; continue from round %d",
        worker, version_, version_ + 1));
  }

  uint64_t RoundOf(int worker, uint64_t seq) const {
    return workers_[worker].first_round + seq - 1;
  }

  // REQUIRES: mu_ held, seq >= next_seq.
  bool Eligible(int worker, uint64_t seq) const {
    if (seq != workers_[worker].next_seq) return false;  // an earlier one is missing
    if (config_.mode == Mode::kAsync) return true;
    return RoundOf(worker, seq) <= version_ + 1 + config_.staleness;
  }

  // Takes the worker's next push from `payload` or `grad`. A push for a
  // round already applied without it (its lease had expired) is dropped.
  // With `check` (sync, ssp), a push holding NaN or Inf is refused in the
  // pass that takes it in, leaving everything as it was: returns the first
  // bad element's index, else -1. With `reply` (async), the values as the
  // push leaves them are copied there too, a chunk at a time while it is in
  // cache: a PushPull through shared memory, whose reply region is where
  // its values came (each chunk is written after it was read).
  // REQUIRES: mu_ held, Eligible().
  int64_t Accept(int worker, PayloadReader* payload, const std::vector<T>* grad, bool check,
                 Completions* done, char* reply = nullptr) {
    WorkerState& ws = workers_[worker];
    uint64_t round = ws.first_round + ws.next_seq - 1;
    if (config_.mode == Mode::kAsync) {
      ++ws.next_seq;
      const Update u = Writable();
      Each(payload, grad, false, [&](const T* g, uint64_t at, size_t n) {
        ApplyUpdate<T>(config_.optimizer, step_ + 1, T(1), u.in + at, u.out + at, g,
                       m_.empty() ? nullptr : m_.data() + at,
                       v_.empty() ? nullptr : v_.data() + at, n);
        if (reply != nullptr) std::memcpy(reply + at * sizeof(T), u.out + at, n * sizeof(T));
      });
      ++step_;
      ++version_;
      MaybeSnapshot(done);
      return -1;
    }
    if (round <= version_) {
      if (payload && check) {
        int64_t bad = Each(payload, grad, check, [](const T*, uint64_t, size_t) {});
        if (bad >= 0) return bad;
      } else if (payload) {
        payload->Skip(bytes());
      }
      ++ws.next_seq;
      if (config_.observer) config_.observer->LatePush(worker);
      return -1;
    }
    while (open_.size() < round - version_) open_.push_back(SpareRound());
    Round& r = open_[round - version_ - 1];
    if (r.contributed.empty()) {
      r.contributed.assign(config_.num_workers, 0);
      r.opened = std::chrono::steady_clock::now();
    }
    int64_t bad;
    if (!config_.keep_dead_contributions) {
      if (r.by_worker.empty()) r.by_worker.resize(config_.num_workers);
      std::vector<T>& mine = r.by_worker[worker];
      mine.resize(count_);
      bad = Each(payload, grad, check, [&](const T* g, uint64_t at, size_t n) {
        std::copy(g, g + n, mine.begin() + at);
      });
    } else if (Hold(payload, check, r, &bad)) {
      // Referenced where it was received; summed as the round is applied.
    } else if (Summed(r) == 0) {
      r.sum.resize(count_);  // a recycled round's buffer: no allocation
      bad = Each(payload, grad, check, [&](const T* g, uint64_t at, size_t n) {
        std::copy(g, g + n, r.sum.begin() + at);
      });
    } else if (check) {
      // The sum goes to a second buffer, swapped in once all of the push
      // proved finite: the same memory traffic as adding in place, and a
      // refused push leaves the sum untouched.
      scratch_.resize(count_);
      bad = Each(payload, grad, check, [&](const T* g, uint64_t at, size_t n) {
        const T* acc = r.sum.data() + at;
        T* out = scratch_.data() + at;
        for (size_t i = 0; i < n; ++i) out[i] = acc[i] + g[i];
      });
      if (bad < 0) r.sum.swap(scratch_);
    } else {
      bad = Each(payload, grad, check, [&](const T* g, uint64_t at, size_t n) {
        T* acc = r.sum.data() + at;
        for (size_t i = 0; i < n; ++i) acc[i] += g[i];
      });
    }
    if (bad >= 0) return bad;
    ++ws.next_seq;
    r.contributed[worker] = 1;
    ++r.contributions;
    return -1;
  }

  // Keeps a push where it was received when the request owns it and it is
  // big enough to be worth it (kShareMinBytes), in one aligned run of the
  // stored dtype: the round references it instead of copying it into its
  // sum, at most kMaxHeld per round. With `check` it is scanned first (a
  // read, where a copy would also write); a push with NaN or Inf sets `bad`
  // and is not kept. False, the payload untouched, when it is not held.
  // REQUIRES: mu_ held.
  bool Hold(PayloadReader* payload, bool check, Round& r, int64_t* bad) {
    grpc::Slice slice;
    const char* data;
    if (payload == nullptr || dtype_ != kStored || bytes() < kShareMinBytes ||
        r.held.size() >= kMaxHeld || !payload->Whole(bytes(), &slice, &data) ||
        reinterpret_cast<uintptr_t>(data) % alignof(T) != 0) {
      return false;
    }
    payload->Skip(bytes());
    const T* values = reinterpret_cast<const T*>(data);
    *bad = check ? FirstNonFinite<T>(values, count_) : -1;
    if (*bad < 0) r.held.push_back({std::move(slice), values});
    return true;
  }

  // Applies round `r`: its sum and the pushes it holds are added chunk by
  // chunk, in cache, into what the optimizer reads, so that adding them
  // costs no pass of its own. REQUIRES: mu_ held.
  void ApplyRound(const Round& r, T scale) {
    const T* parts[kMaxHeld + 1];
    size_t n = 0;
    if (Summed(r) > 0) parts[n++] = r.sum.data();
    for (const Held& h : r.held) parts[n++] = h.values;
    const Update u = Writable();
    auto apply = [&](const T* g, uint64_t at, size_t k) {
      ApplyUpdate<T>(config_.optimizer, step_, scale, u.in + at, u.out + at, g,
                     m_.empty() ? nullptr : m_.data() + at,
                     v_.empty() ? nullptr : v_.data() + at, k);
    };
    if (n == 1) return apply(parts[0], 0, count_);
    chunk_.resize(std::min<uint64_t>(count_, kChunkElems));
    for (uint64_t at = 0; at < count_; at += kChunkElems) {
      const size_t k = static_cast<size_t>(std::min<uint64_t>(kChunkElems, count_ - at));
      for (size_t i = 0; i < k; ++i) chunk_[i] = parts[0][at + i] + parts[1][at + i];
      for (size_t p = 2; p < n; ++p) {
        for (size_t i = 0; i < k; ++i) chunk_[i] += parts[p][at + i];
      }
      apply(chunk_.data(), at, k);
    }
  }

  // Contributions to `r` added into its sum (the drop policy sums all it
  // uses as the round completes).
  static size_t Summed(const Round& r) { return r.contributions - r.held.size(); }

  template <typename Fn>
  int64_t Each(PayloadReader* payload, const std::vector<T>* grad, bool check, Fn fn) {
    if (payload) return ForEachChunk<T>(dtype_, count_, payload, check, fn);
    fn(grad->data(), 0, count_);  // a deferred push, checked when it came
    return -1;
  }

  // An empty round, with the buffers of the last one completed, so that a
  // round at steady state allocates nothing. REQUIRES: mu_ held.
  Round SpareRound() {
    Round r = std::move(spare_round_);
    spare_round_ = Round();
    r.contributed.clear();
    r.contributions = 0;
    return r;
  }

  // Completes every round that can complete, releases the pulls it
  // satisfies and takes deferred pushes that became eligible, until nothing
  // moves. REQUIRES: mu_ held.
  void Progress(Completions* done) {
    std::string reason = config_.membership->AbortReason();
    if (!reason.empty()) {
      FailAll(absl::AbortedError(reason), done);
      return;
    }
    bool moved = true;
    while (moved) {
      moved = false;
      while (!open_.empty() && RoundReady(open_.front())) {
        CompleteRound(done);
        moved = true;
      }
      for (auto it = deferred_.begin(); it != deferred_.end();) {
        if (it->sink->Finished()) {
          it = EraseDeferred(it);
        } else if (Eligible(it->worker, it->seq)) {
          Accept(it->worker, nullptr, &it->grad, /*check=*/false, done);
          done->push_back([sink = it->sink, slice = it->slice] {
            sink->SliceApplied(slice);
          });
          it = EraseDeferred(it);
          moved = true;
        } else {
          ++it;
        }
      }
    }
    ReleaseWaiters(done);
  }

  // REQUIRES: mu_ held.
  bool RoundReady(const Round& r) const {
    if (r.contributions == 0) return false;
    for (int w = 0; w < config_.num_workers; ++w) {
      if (!r.contributed[w] && config_.membership->Required(w)) return false;
    }
    return true;
  }

  // REQUIRES: mu_ held, RoundReady(open_.front()).
  void CompleteRound(Completions* done) {
    Round r = std::move(open_.front());
    open_.pop_front();
    int used = r.contributions;
    if (!config_.keep_dead_contributions) {
      used = 0;
      r.sum.assign(count_, T(0));
      for (int w = 0; w < config_.num_workers; ++w) {
        if (!r.contributed[w] ||
            config_.membership->state(w) == Membership::State::kDead) {
          continue;
        }
        const std::vector<T>& g = r.by_worker[w];
        for (uint64_t i = 0; i < count_; ++i) r.sum[i] += g[i];
        ++used;
      }
      r.contributions = used;  // all of them in `sum`
    }
    if (used > 0) {
      T scale = config_.reduction == Reduction::kMean ? T(1) / static_cast<T>(used) : T(1);
      ++step_;
      ApplyRound(r, scale);
    }
    r.held.clear();  // the requests' buffers go back now
    ++version_;
    if (config_.observer) {
      double latency = std::chrono::duration<double>(
                           std::chrono::steady_clock::now() - r.opened)
                           .count();
      // Counted before anything this call completes runs: the push that
      // closed the round may have its reply (with the values) sent by an
      // earlier completion, and a caller who then reads the metrics must
      // find the round there.
      done->insert(done->begin(),
                   [obs = config_.observer, latency] { obs->RoundCompleted(latency); });
    }
    spare_round_ = std::move(r);
    MaybeSnapshot(done);
    for (auto it = snapshots_.begin(); it != snapshots_.end();) {
      if (it->round == version_) {
        done->push_back([fn = std::move(it->fn), state = Snapshot()]() mutable {
          fn(std::move(state));
        });
        it = snapshots_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // REQUIRES: mu_ held.
  void MaybeSnapshot(Completions* done) {
    if (config_.snapshot_every == 0 || version_ % config_.snapshot_every != 0) return;
    done->push_back([sink = config_.snapshots, self = this, state = Snapshot()]() mutable {
      sink->Periodic(self, std::move(state));
    });
  }

  // REQUIRES: mu_ held.
  bool Ready(const Waiter& w) const {
    return version_ >= w.min_version && workers_[w.worker].next_seq > w.min_seq;
  }

  // REQUIRES: mu_ held.
  void ReleaseWaiters(Completions* done) {
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->sink->Finished()) {
        it = waiters_.erase(it);
      } else if (Ready(*it)) {
        CopyOut(*it, done);
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // REQUIRES: mu_ held.
  void FailAll(const absl::Status& status, Completions* done) {
    for (auto& w : waiters_) done->push_back([sink = w.sink, status] { sink->Fail(status); });
    for (auto& d : deferred_) done->push_back([sink = d.sink, status] { sink->Fail(status); });
    waiters_.clear();
    while (!deferred_.empty()) EraseDeferred(deferred_.begin());
  }

  // REQUIRES: mu_ held.
  typename std::list<Deferred>::iterator EraseDeferred(
      typename std::list<Deferred>::iterator it) {
    if (config_.deferred_limit != nullptr) {
      config_.deferred_limit->Give(it->worker, it->grad.size() * sizeof(T));
    }
    return deferred_.erase(it);
  }

  // REQUIRES: mu_ held.
  void DropFinishedLocked() {
    waiters_.remove_if([](const Waiter& w) { return w.sink->Finished(); });
    for (auto it = deferred_.begin(); it != deferred_.end();) {
      it = it->sink->Finished() ? EraseDeferred(it) : std::next(it);
    }
  }

  // Where an update reads the values and writes the new ones.
  struct Update {
    const T* in;
    T* out;
  };
  // In place, unless a pull reply still references the values
  // (SliceShared); then `out` is a buffer that no reply holds, which
  // becomes the values, and `in` the old ones. Either way each element is
  // read once and written once: sharing costs no pass of its own.
  // REQUIRES: mu_ held.
  Update Writable() {
    T* current = values_->data.data();
    // Leases are taken only under mu_, so none can appear after this load,
    // and its acquire orders the last reply's reads before our writes.
    if (values_->lent.load(std::memory_order_acquire) == 0) return {current, current};
    std::shared_ptr<Values> next;
    for (auto it = spare_.begin(); it != spare_.end(); ++it) {
      if ((*it)->lent.load(std::memory_order_acquire) == 0) {
        next = std::move(*it);
        spare_.erase(it);
        break;
      }
    }
    if (!next) next = std::make_shared<Values>(count_);
    spare_.push_back(std::move(values_));
    // The oldest goes; a reply that still holds it frees it when sent.
    if (spare_.size() > kMaxSpare) spare_.erase(spare_.begin());
    values_ = std::move(next);
    return {current, values_->data.data()};  // spare_ keeps `current`
  }

  // REQUIRES: mu_ held.
  void CopyOut(const Waiter& w, Completions* done) {
    if (config_.observer && config_.mode != Mode::kAsync && w.worker != kObserver) {
      const WorkerState& ws = workers_[w.worker];
      uint64_t clock = ws.first_round + ws.next_seq - 2;  // last round pushed
      uint64_t lead = clock > version_ ? clock - version_ : 0;
      done->push_back([obs = config_.observer, worker = w.worker, lead] {
        obs->PullServed(worker, lead);
      });
    }
    if (dtype_ == kStored && bytes() >= kShareMinBytes && w.sink->Shares()) {
      SharedBytes values{reinterpret_cast<const char*>(values_->data.data()), bytes(),
                         std::make_shared<const Lease>(values_)};
      done->push_back([sink = w.sink, slice = w.slice, values, v = version_] {
        sink->SliceShared(slice, values, v);
      });
      return;
    }
    FromCompute<T>(dtype_, values_->data.data(), w.sink->Destination(w.slice), count_);
    done->push_back([sink = w.sink, slice = w.slice, v = version_] {
      sink->SliceReady(slice, v);
    });
  }

  // The state at the current round boundary: open rounds are left out, and
  // each worker's seqs are cut back to the last round included.
  // REQUIRES: mu_ held.
  PartitionState Snapshot() const {
    PartitionState s;
    s.version = version_;
    s.step = step_;
    auto raw = [](const std::vector<T>& v) {
      return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
    };
    s.values = raw(values_->data);
    s.m = raw(m_);
    s.v = raw(v_);
    for (const WorkerState& ws : workers_) {
      uint64_t next_seq = ws.next_seq;
      if (config_.mode != Mode::kAsync && ws.incarnation != 0) {
        uint64_t cut = version_ + 2 > ws.first_round ? version_ + 2 - ws.first_round : 1;
        next_seq = std::min(next_seq, cut);
      }
      s.workers.push_back({ws.incarnation, ws.first_round, next_seq});
    }
    return s;
  }

  // A buffer of values, and the replies that reference it.
  struct Values {
    explicit Values(uint64_t n) : data(n) {}
    std::vector<T> data;
    std::atomic<int> lent{0};  // Leases alive
  };
  // A reply's hold on a Values: taken under mu_, let go from any thread.
  struct Lease {
    explicit Lease(std::shared_ptr<Values> v) : values(std::move(v)) {
      values->lent.fetch_add(1, std::memory_order_relaxed);
    }
    ~Lease() { values->lent.fetch_sub(1, std::memory_order_release); }
    const std::shared_ptr<Values> values;
  };
  // Buffers kept for Writable() to reuse: a round at steady state allocates
  // none, even with a reply still being sent from the last one's values.
  static constexpr size_t kMaxSpare = 2;

  const PartitionConfig config_;
  mutable std::mutex mu_;
  std::shared_ptr<Values> values_;
  std::vector<std::shared_ptr<Values>> spare_;  // earlier values' buffers
  std::vector<T> m_, v_;  // optimizer moments (empty when unused)
  uint64_t version_ = 0;  // rounds (sync, ssp) or pushes (async) applied
  uint64_t step_ = 0;     // optimizer steps taken
  std::vector<WorkerState> workers_;
  std::deque<Round> open_;  // open_[i] is round version_ + 1 + i
  Round spare_round_;       // the last completed round, for its buffers
  std::vector<T> scratch_;  // a checked push's sum, before it is swapped in
  std::vector<T> chunk_;    // a chunk of a round's gradient (ApplyRound)
  std::list<Waiter> waiters_;
  std::list<Deferred> deferred_;
  std::list<SnapshotRequest> snapshots_;
};

}  // namespace

absl::Status RefuseNonFinite(const std::string& key, const std::string& detail) {
  return absl::InvalidArgumentError(absl::StrCat("push of \"", key,
                                                 "\": the gradient holds NaN or Inf (", detail,
                                                 "); refused, nothing applied"));
}

std::unique_ptr<Partition> Partition::Create(const PartitionConfig& config,
                                             DType dtype, uint64_t offset,
                                             uint64_t count) {
  if (dtype == DType::kFloat64) {
    return std::make_unique<TypedPartition<double>>(config, dtype, offset, count);
  }
  return std::make_unique<TypedPartition<float>>(config, dtype, offset, count);
}

}  // namespace deepnex::ps
