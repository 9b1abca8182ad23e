// The cpu backend: ring collectives over Links (TCP or shared memory).
//
// Allreduce is a ring reduce-scatter followed by a ring allgather, run as one
// pipelined stream per stripe: each step's chunk is sent as soon as the bytes
// it depends on have been received and reduced, so reduction overlaps the
// transfer (ring.h). A tensor is striped over several links (connections or
// shm rings), each driven by its own thread. Every collective starts with a
// tiny header exchange around the ring, so that ranks disagreeing on the
// collective fail together with InvalidArgument; a small allreduce carries
// its data in that exchange and needs no ring.
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <future>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <random>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collective/backends.h"
#include "collective/cpu_wire.h"
#include "collective/exchange.h"
#include "collective/reduce.h"
#include "collective/rendezvous.h"
#include "collective/ring.h"
#include "collective/stripe_pool.h"
#include "collective/transport.h"
#include "collective/work_queue.h"
#include "core/grpc_util.h"

namespace deepnex::collective {
namespace {

using std::chrono::milliseconds;

// Below this many bytes per stripe a collective uses fewer stripes.
constexpr size_t kMinStripeBytes = 256 << 10;
// How long a rank that breaks off waits for the store to say where the
// failure began and to record it. A live store answers in a millisecond or
// so; one that does not costs each rank round the ring this much.
constexpr std::chrono::milliseconds kBlameWait{100};

bool SupportedDType(DType d) {
  switch (d) {
    case DType::kFloat32:
    case DType::kFloat64:
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt32:
    case DType::kInt64: return true;
    default: return false;
  }
}

std::string RankName(int r) { return absl::StrCat("rank ", r); }

// `s` saying `message`, its payloads kept (PeerOf's among them).
absl::Status Reworded(const absl::Status& s, absl::string_view message) {
  absl::Status out(s.code(), message);
  s.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

// The CPUs this thread may run on, as RankInfo::cpus.
std::string CpuMask() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return "1";
  std::string hex;  // least significant digit first
  for (int cpu = 0; cpu < CPU_SETSIZE; cpu += 4) {
    int digit = 0;
    for (int b = 0; b < 4; ++b) digit |= CPU_ISSET(cpu + b, &set) ? 1 << b : 0;
    hex.push_back("0123456789abcdef"[digit]);
  }
  while (hex.size() > 1 && hex.back() == '0') hex.pop_back();
  std::reverse(hex.begin(), hex.end());
  return hex;
}

class CpuCommunicator final : public Communicator {
 public:
  explicit CpuCommunicator(const CommunicatorOptions& options) : o_(options) {}

  ~CpuCommunicator() override {
    if (InForkedChild()) {
      // The links' sockets and segments are the parent's too: shutting one
      // down (or unlinking a segment) would end the parent's collectives.
      new std::vector<std::unique_ptr<Link>>(std::move(links_));  // left, not closed
      rendezvous_.release();  // its store client is the parent's gRPC: left too
      return;  // queue_ leaves its thread (SerialQueue::Close)
    }
    // A collective in flight ends now, Aborted, not at its timeout (the
    // queue's Close waits for it).
    Abort();
    if (queue_ != nullptr) queue_->Close();
    for (auto& link : links_) link->Interrupt();
    links_.clear();
    for (int fd : ctl_fds_) close(fd);
  }

  absl::Status Init(Transport transport);

  std::shared_ptr<Work> AllReduceAsync(const TensorView& t, ReduceOp op) override {
    return Enqueue([this, t, op] { return DoAllReduce(t, op); }, Bytes(t));
  }
  std::shared_ptr<Work> BroadcastAsync(const TensorView& t, int root) override {
    return Enqueue([this, t, root] { return DoBroadcast(t, root); }, Bytes(t));
  }
  std::shared_ptr<Work> AllGatherAsync(const TensorView& in, const TensorView& out) override {
    return Enqueue([this, in, out] { return DoAllGather(in, out); }, Bytes(out));
  }
  std::shared_ptr<Work> ReduceScatterAsync(const TensorView& in, const TensorView& out,
                                           ReduceOp op) override {
    return Enqueue([this, in, out, op] { return DoReduceScatter(in, out, op); }, Bytes(in));
  }
  std::shared_ptr<Work> BarrierAsync() override {
    return Enqueue(
        [this] {
          Header h;
          h.kind = static_cast<uint8_t>(Kind::kBarrier);
          return Exchange(h, absl::OkStatus(), Deadline());
        },
        0);
  }

  void Abort() override {
    if (aborted_.exchange(true)) return;
    Break(absl::AbortedError("the communicator was aborted")).IgnoreError();
  }

  int rank() const override { return o_.rank; }
  int world_size() const override { return o_.world_size; }
  Backend backend() const override { return Backend::kCpu; }
  std::string transport() const override { return transport_name_; }

 private:
  struct Joining;
  absl::Status Publish(Transport transport, Joining& j, SteadyClock::time_point deadline);
  absl::Status ProbeSharedMemory(Transport transport, Joining& j,
                                 SteadyClock::time_point deadline);
  absl::Status Connect(Joining& j, SteadyClock::time_point deadline);
  absl::Status KeepSegments(Joining& j, SteadyClock::time_point deadline);
  void BuildLinks(Joining& j);
  int Stripes(const Joining& j) const;

  // Collectives up to kLazyBytes are left for their waiter to run.
  std::shared_ptr<Work> Enqueue(std::function<absl::Status()> fn, uint64_t bytes) {
    return queue_->Enqueue([this, fn = std::move(fn)] { return Run(fn); },
                           /*lazy=*/bytes <= kLazyBytes);
  }
  static uint64_t Bytes(const TensorView& t) {
    return static_cast<uint64_t>(std::max<int64_t>(t.NumElements(), 0)) * DTypeSize(t.dtype);
  }

  absl::Status Run(const std::function<absl::Status()>& fn) {
    {
      std::lock_guard<std::mutex> lock(broken_mu_);
      if (!broken_.ok()) {
        return absl::AbortedError(
            absl::StrCat("the communicator is broken by an earlier error: ", broken_.message()));
      }
    }
    absl::Status s = fn();
    // InvalidArgument comes from the header check, which left every rank in
    // step; anything else leaves the streams in an unknown state.
    if (!s.ok() && s.code() != absl::StatusCode::kInvalidArgument) {
      // The payload (PeerOf) was Break's; the caller gets the words.
      s = absl::Status(s.code(), Break(s).message());
    }
    if (aborted_.load() && s.ok()) s = absl::AbortedError("the communicator was aborted");
    return s;
  }

  // The first error ends the communicator. Before its links go, it is
  // recorded in the store for the neighbours, which see only that this rank
  // broke off (in a ring, the failure spreads rank by rank: a probe's ranks
  // blamed healthy ones). An error that is a neighbour's breaking off says
  // where the failure began, as that neighbour recorded it, and passes that
  // on. Aborts (and destruction) record nothing. Returns `s` as said.
  absl::Status Break(absl::Status s) {
    bool first;
    {
      std::lock_guard<std::mutex> lock(broken_mu_);
      first = broken_.ok();
      if (first) broken_ = s;
    }
    if (first && !aborted_.load() && rendezvous_ != nullptr) {
      // On a thread of its own, waited for briefly: a store that does not
      // answer holds each rank round the ring that long before it breaks
      // off in turn (the thread ends within its calls' timeouts; the
      // destructor waits for it).
      blame_ = std::async(std::launch::async,
                          [r = rendezvous_.get(), why = std::string(s.message()),
                           peer = PeerOf(s)] { return r->Blame(why, peer); });
      const std::string began =
          blame_.wait_for(kBlameWait) == std::future_status::ready ? blame_.get() : "";
      if (!began.empty()) {
        s = Reworded(s, absl::StrCat(s.message(), "; the failure began elsewhere: ", began));
        std::lock_guard<std::mutex> lock(broken_mu_);
        broken_ = s;
      }
    }
    stop_.store(true);
    for (auto& link : links_) link->Interrupt();
    for (int fd : ctl_fds_) shutdown(fd, SHUT_RDWR);
    return s;
  }

  SteadyClock::time_point Deadline() const { return SteadyClock::now() + o_.timeout; }

  // Every rank learns every rank's header, passed around the ring; all of
  // them then agree on whether the call is valid. A small collective folds
  // its data into this exchange (one ring pass, no second round): `payload`
  // of mine.payload_bytes, and when the call is valid every rank's payload is
  // in gathered_, rank i's at i * payload_bytes.
  absl::Status Exchange(Header mine, const absl::Status& local, SteadyClock::time_point deadline,
                        const char* payload = nullptr) {
    mine.seq = ++seq_;
    mine.invalid = local.ok() ? 0 : 1;
    if (!local.ok() || payload == nullptr) mine.payload_bytes = 0;
    const int n = o_.world_size, r = o_.rank;
    const size_t pb = mine.payload_bytes;
    const std::string what = KindName(static_cast<Kind>(mine.kind));
    if (n > 1) {
      std::vector<Header> all(n);
      all[r] = mine;
      gathered_.resize(n * pb);
      send_buf_.resize(sizeof(Header) + pb);
      std::memcpy(send_buf_.data(), &mine, sizeof(Header));
      if (pb > 0) std::memcpy(send_buf_.data() + sizeof(Header), payload, pb);
      if (pb > 0) std::memcpy(gathered_.data() + r * pb, payload, pb);
      // A payload whose size differs from ours (the ranks disagree) is read,
      // passed on and dropped, so that the streams stay in step.
      std::vector<char> stray;
      absl::Status s;
      for (int step = 0; s.ok() && step < n - 1; ++step) {
        const int from = (r - 1 - step + n) % n;
        char* in_payload = nullptr;
        s = PassRecord(*links_[0], send_buf_, &all[from], [&](const Header& h) {
          if (h.payload_bytes == pb) return gathered_.data() + from * pb;
          stray.resize(h.payload_bytes);
          return stray.data();
        }, &in_payload, deadline);
        if (s.ok() && step < n - 2) {
          send_buf_.resize(sizeof(Header) + all[from].payload_bytes);
          std::memcpy(send_buf_.data(), &all[from], sizeof(Header));
          if (all[from].payload_bytes > 0) {
            std::memcpy(send_buf_.data() + sizeof(Header), in_payload, all[from].payload_bytes);
          }
        }
      }
      if (!s.ok()) return Annotate(what, s);
      return Verdict(all, local, what);
    }
    return local;
  }

  // Whether every rank's header says the same valid call.
  absl::Status Verdict(const std::vector<Header>& all, const absl::Status& local,
                       const std::string& what) const {
    const int n = o_.world_size;
    if (!local.ok()) return local;
    std::vector<std::string> bad;
    for (int i = 0; i < n; ++i) {
      if (all[i].invalid) bad.push_back(absl::StrCat(i));
    }
    if (!bad.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": invalid arguments on rank ", absl::StrJoin(bad, ", "), "; nothing was done"));
    }
    bool same = true;
    for (int i = 0; i < n; ++i) same = same && all[i].SameCall(all[0]);
    if (!same) {
      std::string desc;
      for (int i = 0; i < n; ++i) {
        absl::StrAppend(&desc, i ? "; " : "", "rank ", i, ": ", all[i].Describe());
      }
      return absl::InvalidArgumentError(
          absl::StrCat("ranks disagree on the collective (", desc, "); nothing was done"));
    }
    return local;
  }

  // Two ranks, a small sum, mean or prod (see PairReduce): a + b == b + a,
  // so both ranks end equal. One copy each way, where Exchange makes five.
  absl::Status PairAllReduce(Header mine, const absl::Status& local, char* base,
                             SteadyClock::time_point deadline) {
    mine.seq = ++seq_;
    mine.invalid = local.ok() ? 0 : 1;
    if (!local.ok()) mine.payload_bytes = 0;
    const size_t pb = mine.payload_bytes;
    const DType dtype = static_cast<DType>(mine.dtype);
    const std::string what = KindName(static_cast<Kind>(mine.kind));
    std::vector<Header> all(2);
    all[o_.rank] = mine;
    Header& peer = all[1 - o_.rank];
    auto matches = [&](const Header& h) {
      return local.ok() && !h.invalid && h.SameCall(mine) && h.payload_bytes == pb;
    };
    absl::Status s = PairReduce(*links_[0], mine, base, &peer, matches, deadline);
    if (!s.ok()) return Annotate(what, s);
    DEEPNEX_RETURN_IF_ERROR(Verdict(all, local, what));
    if (static_cast<ReduceOp>(mine.op) == ReduceOp::kMean) {
      DivideInPlace(dtype, base, pb / DTypeSize(dtype), 2);
    }
    return absl::OkStatus();
  }

  absl::Status Annotate(const std::string& what, const absl::Status& s) const {
    if (stop_.load() && aborted_.load()) return absl::AbortedError("the communicator was aborted");
    return Reworded(s, absl::StrCat(what, " on rank ", o_.rank, ": ", s.message()));
  }

  absl::Status CheckTensor(const char* what, const TensorView& t) const {
    DEEPNEX_RETURN_IF_ERROR(t.CheckShape(what));
    if (!SupportedDType(t.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": dtype ", DTypeName(t.dtype),
          " is not supported (float32, float64, float16, bfloat16, int32, int64)"));
    }
    if (t.data == nullptr && t.NumElements() > 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": null data"));
    }
    return absl::OkStatus();
  }

  int StripesFor(size_t bytes) const {
    return static_cast<int>(std::clamp<size_t>(bytes / kMinStripeBytes, 1, links_.size()));
  }

  // Runs `plan_for(stripe, stripes)` on each stripe in parallel.
  absl::Status RunStripes(const std::string& what, int stripes,
                          const std::function<absl::Status(Link&, int, int)>& job) {
    std::vector<std::function<absl::Status()>> jobs;
    for (int k = 0; k < stripes; ++k) {
      jobs.push_back([this, k, stripes, &job] {
        absl::Status s = job(*links_[k], k, stripes);
        if (!s.ok()) Break(s).IgnoreError();  // wakes the other stripes; said by RunStripes
        return s;
      });
    }
    std::vector<absl::Status> results = pool_->Run(jobs);
    // The first real error, not the Aborted of stripes woken by it.
    absl::Status first;
    {
      std::lock_guard<std::mutex> lock(broken_mu_);
      first = broken_;
    }
    for (const absl::Status& s : results) {
      if (!s.ok()) return Annotate(what, first.ok() ? s : first);
    }
    return absl::OkStatus();
  }

  absl::Status DoAllReduce(const TensorView& t, ReduceOp op) {
    Header h;
    h.kind = static_cast<uint8_t>(Kind::kAllReduce);
    h.dtype = static_cast<uint8_t>(t.dtype);
    h.op = static_cast<uint8_t>(op);
    h.count = t.NumElements();
    auto deadline = Deadline();
    absl::Status local = CheckTensor("allreduce", t);
    if (local.ok()) local = CheckReduceOp("allreduce", op);
    if (!local.ok()) h.count = 0;  // its peers learn of the error; no data moves
    const int n = o_.world_size;
    const size_t esize = DTypeSize(t.dtype), count = h.count;
    char* base = static_cast<char*>(t.data);
    // Small: every rank's data goes around the ring with the headers and
    // each rank reduces all of them, in rank order (so identically).
    const bool small = n > 1 && n <= kSmallMaxRanks && count * esize <= kSmallBytes;
    if (n == 2 && count > 0 && count * esize <= kPairBytes &&
        (op == ReduceOp::kSum || op == ReduceOp::kMean || op == ReduceOp::kProd)) {
      h.payload_bytes = static_cast<uint32_t>(count * esize);
      return PairAllReduce(h, local, base, deadline);
    }
    if (small) h.payload_bytes = static_cast<uint32_t>(count * esize);
    DEEPNEX_RETURN_IF_ERROR(Exchange(h, local, deadline, small ? base : nullptr));
    if (n == 1 || count == 0) return absl::OkStatus();
    if (small) {
      std::memcpy(base, gathered_.data(), count * esize);
      for (int i = 1; i < n; ++i) {
        ReduceInto(t.dtype, op, base, gathered_.data() + i * count * esize, count);
      }
      if (op == ReduceOp::kMean) DivideInPlace(t.dtype, base, count, n);
      return absl::OkStatus();
    }
    return RunStripes("allreduce", StripesFor(count * esize), [&](Link& link, int k, int stripes) {
      RingPlan p;
      p.n = n;
      p.r = o_.rank;
      p.steps = 2 * (n - 1);
      p.rs_steps = n - 1;
      p.dtype = t.dtype;
      p.esize = esize;
      p.op = op;
      for (int c = 0; c < n; ++c) {
        auto [cb, cn] = Part(count, n, c);
        auto [sb, sn] = Part(cn, stripes, k);
        p.chunks.push_back({base + (cb + sb) * esize, sn * esize});
      }
      return RunRing(link, p, deadline);
    });
  }

  absl::Status DoReduceScatter(const TensorView& in, const TensorView& out, ReduceOp op) {
    const int n = o_.world_size;
    absl::Status local = CheckTensor("reduce_scatter", in);
    if (local.ok()) local = CheckTensor("reduce_scatter", out);
    if (local.ok()) local = CheckReduceOp("reduce_scatter", op);
    if (local.ok() && (in.dtype != out.dtype ||
                       in.NumElements() != out.NumElements() * static_cast<int64_t>(n))) {
      local = absl::InvalidArgumentError(absl::StrCat(
          "reduce_scatter: the input holds ", in.NumElements(), " ", DTypeName(in.dtype),
          ", the output ", out.NumElements(), " ", DTypeName(out.dtype), "; the input must hold ",
          n, " x the output's elements, of the same dtype"));
    }
    Header h;
    h.kind = static_cast<uint8_t>(Kind::kReduceScatter);
    h.dtype = static_cast<uint8_t>(out.dtype);
    h.op = static_cast<uint8_t>(op);
    h.count = out.NumElements();
    auto deadline = Deadline();
    DEEPNEX_RETURN_IF_ERROR(Exchange(h, local, deadline));
    const size_t esize = DTypeSize(out.dtype), m = h.count;
    if (m == 0) return absl::OkStatus();
    if (n == 1) {
      std::memmove(out.data, in.data, m * esize);
      return absl::OkStatus();
    }
    scratch_.resize(m * n * esize);
    std::memcpy(scratch_.data(), in.data, scratch_.size());
    char* base = scratch_.data();
    DEEPNEX_RETURN_IF_ERROR(
        RunStripes("reduce_scatter", StripesFor(m * esize * n), [&](Link& link, int k, int stripes) {
          RingPlan p;
          p.n = n;
          p.r = o_.rank;
          p.steps = n - 1;
          p.rs_steps = n - 1;
          p.shift = -1;
          p.dtype = out.dtype;
          p.esize = esize;
          p.op = op;
          for (int c = 0; c < n; ++c) {
            auto [sb, sn] = Part(m, stripes, k);
            p.chunks.push_back({base + (c * m + sb) * esize, sn * esize});
          }
          return RunRing(link, p, deadline);
        }));
    std::memcpy(out.data, base + o_.rank * m * esize, m * esize);
    return absl::OkStatus();
  }

  absl::Status DoAllGather(const TensorView& in, const TensorView& out) {
    const int n = o_.world_size;
    absl::Status local = CheckTensor("allgather", in);
    if (local.ok()) local = CheckTensor("allgather", out);
    if (local.ok() && (in.dtype != out.dtype ||
                       out.NumElements() != in.NumElements() * static_cast<int64_t>(n))) {
      local = absl::InvalidArgumentError(absl::StrCat(
          "allgather: the input holds ", in.NumElements(), " ", DTypeName(in.dtype),
          ", the output ", out.NumElements(), " ", DTypeName(out.dtype), "; the output must hold ",
          n, " x the input's elements, of the same dtype"));
    }
    Header h;
    h.kind = static_cast<uint8_t>(Kind::kAllGather);
    h.dtype = static_cast<uint8_t>(in.dtype);
    h.count = in.NumElements();
    auto deadline = Deadline();
    DEEPNEX_RETURN_IF_ERROR(Exchange(h, local, deadline));
    const size_t esize = DTypeSize(in.dtype), m = h.count;
    if (m == 0) return absl::OkStatus();
    char* base = static_cast<char*>(out.data);
    std::memmove(base + o_.rank * m * esize, in.data, m * esize);
    if (n == 1) return absl::OkStatus();
    return RunStripes("allgather", StripesFor(m * esize * n), [&](Link& link, int k, int stripes) {
      RingPlan p;
      p.n = n;
      p.r = o_.rank;
      p.steps = n - 1;
      p.rs_steps = 0;
      p.dtype = in.dtype;
      p.esize = esize;
      for (int c = 0; c < n; ++c) {
        auto [sb, sn] = Part(m, stripes, k);
        p.chunks.push_back({base + (c * m + sb) * esize, sn * esize});
      }
      return RunRing(link, p, deadline);
    });
  }

  absl::Status DoBroadcast(const TensorView& t, int root) {
    const int n = o_.world_size;
    absl::Status local = CheckTensor("broadcast", t);
    if (local.ok() && (root < 0 || root >= n)) {
      local = absl::InvalidArgumentError(
          absl::StrCat("broadcast: root ", root, " is outside 0..", n - 1));
    }
    Header h;
    h.kind = static_cast<uint8_t>(Kind::kBroadcast);
    h.dtype = static_cast<uint8_t>(t.dtype);
    h.root = root;
    h.count = t.NumElements();
    auto deadline = Deadline();
    DEEPNEX_RETURN_IF_ERROR(Exchange(h, local, deadline));
    const size_t bytes = h.count * DTypeSize(t.dtype);
    if (n == 1 || bytes == 0) return absl::OkStatus();
    char* base = static_cast<char*>(t.data);
    const size_t esize = DTypeSize(t.dtype);
    return RunStripes("broadcast", StripesFor(bytes), [&](Link& link, int k, int stripes) {
      auto [sb, sn] = Part(h.count, stripes, k);
      return RunBroadcast(link, n, o_.rank, root, base + sb * esize, sn * esize, deadline);
    });
  }

  const CommunicatorOptions o_;
  std::vector<std::unique_ptr<Link>> links_;
  std::vector<int> ctl_fds_;
  std::vector<std::unique_ptr<ShmSegment>> segments_;
  ShmSegment* my_seg_ = nullptr;  // in segments_, or null
  ShmSegment* left_seg_ = nullptr;
  ShmSegment* right_seg_ = nullptr;
  std::unique_ptr<StripePool> pool_;
  std::string transport_name_;
  std::vector<char> scratch_;
  std::vector<char> send_buf_, gathered_;  // Exchange's
  uint64_t seq_ = 0;

  std::atomic<bool> aborted_{false};
  std::atomic<bool> stop_{false};  // links are told to stop waiting
  std::mutex broken_mu_;
  absl::Status broken_;
  std::unique_ptr<Rendezvous> rendezvous_;  // kept, for Break
  std::future<std::string> blame_;  // Break's lookup: ends before rendezvous_ goes

  std::unique_ptr<SerialQueue> queue_;
};

// Init's steps, in order; a step that fails leaves the communicator unusable.
struct CpuCommunicator::Joining {
  std::unique_ptr<Rendezvous> rendezvous;
  RankInfo mine;
  int listen_fd = -1;
  std::unique_ptr<ShmSegment> own_segment;
  std::vector<RankInfo> infos;
  // The neighbours' segments, mapped by the shared-memory probe.
  std::unique_ptr<ShmSegment> right_probe, left_probe;
  bool shm_out = false, shm_in = false, all_shm = false;
  std::vector<int> out, in;  // connections to the right and from the left
  ~Joining() {
    if (listen_fd >= 0) close(listen_fd);
    for (int fd : out) if (fd >= 0) close(fd);
    for (int fd : in) if (fd >= 0) close(fd);
  }
};

absl::Status CpuCommunicator::Init(Transport transport) {
  if (o_.world_size == 1) {
    pool_ = std::make_unique<StripePool>(0);
    queue_ = std::make_unique<SerialQueue>();
    return absl::OkStatus();
  }
  const auto deadline = Deadline();
  Joining j;
  DEEPNEX_ASSIGN_OR_RETURN(j.rendezvous, Rendezvous::Join(o_, "c", "communicator"));
  DEEPNEX_RETURN_IF_ERROR(Publish(transport, j, deadline));
  DEEPNEX_RETURN_IF_ERROR(ProbeSharedMemory(transport, j, deadline));
  DEEPNEX_RETURN_IF_ERROR(Connect(j, deadline));
  DEEPNEX_RETURN_IF_ERROR(KeepSegments(j, deadline));
  j.rendezvous->Keep(/*blame=*/true);
  rendezvous_ = std::move(j.rendezvous);
  BuildLinks(j);
  pool_ = std::make_unique<StripePool>(static_cast<int>(links_.size()) - 1);
  queue_ = std::make_unique<SerialQueue>();
  return absl::OkStatus();
}

// Opens this rank's listener and shared-memory segment and learns every
// rank's.
absl::Status CpuCommunicator::Publish(Transport transport, Joining& j,
                                      SteadyClock::time_point deadline) {
  const int n = o_.world_size;
  std::string store_host = o_.store_address.substr(0, o_.store_address.rfind(':'));
  j.mine.host = !o_.host.empty() ? o_.host : LocalAddressFor(store_host);
  DEEPNEX_ASSIGN_OR_RETURN(j.listen_fd, ListenTcp(j.mine.host, &j.mine.port));
  j.mine.host_id = HostId();
  std::random_device rd;
  j.mine.nonce = (uint64_t{rd()} << 32) | rd();
  j.mine.shm = "-";
  j.mine.cpus = CpuMask();
  j.mine.world_size = n;
  if (transport != Transport::kTcp) {
    // As many rings as any stripe count can use: auto's most, or the
    // channels asked for; connections_per_peer for a ring half-TCP.
    const int channels = o_.shm_channels > 0 ? o_.shm_channels : kAutoShmChannels;
    auto seg = ShmSegment::Create(std::max(channels, o_.connections_per_peer),
                                  o_.shm_buffer_bytes);
    if (seg.ok()) {
      j.own_segment = std::move(*seg);
      j.mine.shm = j.own_segment->name();
    } else if (transport == Transport::kShm) {
      return absl::FailedPreconditionError(
          absl::StrCat("transport shm: cannot create a shared-memory segment: ",
                       seg.status().message()));
    }
  }
  DEEPNEX_ASSIGN_OR_RETURN(auto values, j.rendezvous->AllGather("rank", Encode(j.mine), deadline));
  for (int i = 0; i < n; ++i) {
    DEEPNEX_ASSIGN_OR_RETURN(RankInfo info, Decode(i, values[i]));
    if (info.world_size != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "world_size: this rank (", o_.rank, ") was given ", n, ", rank ", i, " ",
          info.world_size, "; every rank of communicator \"", o_.prefix, "\" must be given the "
          "same"));
    }
    j.infos.push_back(std::move(info));
  }
  return absl::OkStatus();
}

// Ranks a and b = a + 1 may share memory when they say they are on one
// host. Whether they can is found out by trying: a rank on the same host by
// hostname and boot id may still have a /dev/shm of its own (a container, a
// mount namespace), and then the pair uses TCP.
absl::Status CpuCommunicator::ProbeSharedMemory(Transport transport, Joining& j,
                                                SteadyClock::time_point deadline) {
  const int n = o_.world_size, r = o_.rank;
  const int left = (r - 1 + n) % n, right = (r + 1) % n;
  const auto& infos = j.infos;
  auto candidate = [&](int a, int b) {
    return transport != Transport::kTcp && infos[a].shm != "-" && infos[b].shm != "-" &&
           infos[a].host_id == infos[b].host_id;
  };
  bool any_candidate = false;
  for (int i = 0; i < n; ++i) any_candidate = any_candidate || candidate(i, (i + 1) % n);
  std::vector<std::string> probes(n, "--");
  if (any_candidate) {
    // Every rank takes part (the decision must be the same everywhere):
    // "RL", R and L '1' when this rank mapped its right and left
    // neighbour's segment, '0' when it could not, '-' when not a candidate.
    std::string mine_probe = "--";
    auto map_segment = [&](int peer, std::unique_ptr<ShmSegment>* seg) -> char {
      auto opened = ShmSegment::Open(infos[peer].shm);
      if (opened.ok()) {
        *seg = std::move(*opened);
        return '1';
      }
      std::fprintf(stderr,
                   "deepnex collective \"%s\": rank %d cannot map rank %d's shared memory "
                   "(%s); using TCP between them\n",
                   o_.prefix.c_str(), r, peer, std::string(opened.status().message()).c_str());
      return '0';
    };
    if (candidate(r, right)) mine_probe[0] = map_segment(right, &j.right_probe);
    if (candidate(left, r)) {
      mine_probe[1] = left == right && candidate(r, right) ? mine_probe[0]
                                                           : map_segment(left, &j.left_probe);
    }
    DEEPNEX_ASSIGN_OR_RETURN(probes, j.rendezvous->AllGather("probe", mine_probe, deadline));
    for (int i = 0; i < n; ++i) {
      if (probes[i].size() != 2) {
        return absl::InternalError(absl::StrCat("rank ", i, "'s shared-memory probe \"",
                                                probes[i], "\" is not two characters"));
      }
    }
  }
  // a writes into b's rings and b rings a's bells: both must have mapped.
  auto edge_shm = [&](int a, int b) {
    return candidate(a, b) && probes[a][0] == '1' && probes[b][1] == '1';
  };
  j.all_shm = true;
  for (int i = 0; i < n; ++i) j.all_shm = j.all_shm && edge_shm(i, (i + 1) % n);
  j.shm_out = edge_shm(r, right);
  j.shm_in = edge_shm(left, r);
  if (transport == Transport::kShm && (!j.shm_out || !j.shm_in)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "transport shm: rank ", r, "'s ring neighbours are not all on this host (or cannot "
        "share memory); use tcp or auto"));
  }
  transport_name_ =
      j.shm_out && j.shm_in ? "shm" : (!j.shm_out && !j.shm_in ? "tcp" : "shm+tcp");
  return absl::OkStatus();
}

// Links per neighbour: every rank computes the same count from what all of
// them published.
int CpuCommunicator::Stripes(const Joining& j) const {
  return j.all_shm ? ShmStripes(o_.shm_channels, j.infos) : o_.connections_per_peer;
}

// Connects to the right neighbour, then accepts the left one's connections:
// one per stripe over TCP, one (to watch the neighbour) over shared memory.
// Said when a neighbour found in the store does not connect or is not
// there: a probe's restarted ranks met the entry of a rank killed while
// starting, whose restart waited under the next generation.
constexpr char kStaleEntry[] =
    " (if that rank was killed while starting and started again, what the store holds of it "
    "is from before: start every rank with a new prefix)";

absl::Status CpuCommunicator::Connect(Joining& j, SteadyClock::time_point deadline) {
  const int n = o_.world_size, r = o_.rank;
  const int left = (r - 1 + n) % n, right = (r + 1) % n;
  const int stripes = Stripes(j);
  j.out.assign(j.shm_out ? 1 : stripes, -1);
  j.in.assign(j.shm_in ? 1 : stripes, -1);
  for (size_t i = 0; i < j.out.size(); ++i) {
    auto fd = ConnectTcp(j.infos[right].host, j.infos[right].port, deadline);
    if (!fd.ok()) {
      return absl::Status(fd.status().code(),
                          absl::StrCat("rank ", r, " connecting to rank ", right, ": ",
                                       fd.status().message(), kStaleEntry));
    }
    j.out[i] = *fd;
    Hello hello{kHelloMagic, r, static_cast<int32_t>(i), 0, j.infos[right].nonce};
    DEEPNEX_RETURN_IF_ERROR(WriteFully(j.out[i], &hello, sizeof(hello), deadline, RankName(right)));
  }
  // Connections wait for their hellos side by side, each read as its bytes
  // come: a silent connection, or one that sends part of a hello (a stray
  // client, a co-tenant), must not hold up the neighbour's behind it. The
  // oldest goes when too many wait.
  constexpr size_t kMaxWaiting = 64;
  struct Waiting {
    int fd;
    Hello hello{};
    size_t got = 0;  // bytes of `hello` read so far
  };
  std::deque<Waiting> waiting;
  absl::Cleanup close_waiting = [&waiting] {
    for (const Waiting& w : waiting) close(w.fd);
  };
  for (size_t got = 0; got < j.in.size();) {
    std::vector<pollfd> fds{{j.listen_fd, POLLIN, 0}};
    for (const Waiting& w : waiting) fds.push_back({w.fd, POLLIN, 0});
    if (SteadyClock::now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("rank ", r, ": rank ", left,
                                                      " did not connect within ",
                                                      o_.timeout.count(), " ms", kStaleEntry));
    }
    if (poll(fds.data(), fds.size(), MillisUntil(deadline, 1000)) < 0 && errno != EINTR) {
      return ErrnoUnavailable("poll");
    }
    for (size_t i = fds.size() - 1; i > 0; --i) {
      if (fds[i].revents == 0) continue;
      Waiting& w = waiting[i - 1];
      const ssize_t n = recv(w.fd, reinterpret_cast<char*>(&w.hello) + w.got,
                             sizeof(w.hello) - w.got, MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (n > 0) w.got += static_cast<size_t>(n);
      if (n > 0 && w.got < sizeof(w.hello)) continue;
      const Waiting done = w;
      waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(i - 1));
      const Hello& hello = done.hello;
      if (n <= 0 || hello.magic != kHelloMagic || hello.rank != left ||
          hello.nonce != j.mine.nonce || hello.index < 0 ||
          hello.index >= static_cast<int>(j.in.size()) || j.in[hello.index] >= 0) {
        close(done.fd);  // a stray or stale connection, or one that went
        continue;
      }
      j.in[hello.index] = done.fd;
      ++got;
    }
    if (fds[0].revents != 0) {
      auto fd = AcceptTcp(j.listen_fd, SteadyClock::now());
      if (!fd.ok() && !absl::IsDeadlineExceeded(fd.status())) return fd.status();
      if (fd.ok()) waiting.push_back(Waiting{*fd});
      if (waiting.size() > kMaxWaiting) {
        close(waiting.front().fd);
        waiting.pop_front();
      }
    }
  }
  return absl::OkStatus();
}

// Keeps the neighbours' segments the probe mapped, tells them so, then drops
// our segment's name: from here on nothing is left in /dev/shm even if a
// process dies.
absl::Status CpuCommunicator::KeepSegments(Joining& j, SteadyClock::time_point deadline) {
  const int n = o_.world_size, r = o_.rank;
  const int left = (r - 1 + n) % n, right = (r + 1) % n;
  absl::Status s;
  if (j.shm_out || j.shm_in) {
    if (j.own_segment == nullptr) s = absl::InternalError("shared memory without a segment");
    if (s.ok() && j.shm_out) right_seg_ = j.right_probe.get();
    if (s.ok() && j.shm_in) {
      if (left == right && right_seg_ != nullptr) {
        left_seg_ = right_seg_;
      } else if (j.left_probe != nullptr) {
        left_seg_ = j.left_probe.get();
      } else {
        s = absl::InternalError("shared memory from the left without its segment");
      }
    }
  }
  char ack = s.ok() ? 'M' : 'X';
  if (s.ok()) s = WriteFully(j.out[0], &ack, 1, deadline, RankName(right));
  if (s.ok()) s = WriteFully(j.in[0], &ack, 1, deadline, RankName(left));
  char a1 = 0, a2 = 0;
  if (s.ok()) s = ReadFully(j.out[0], &a1, 1, deadline, RankName(right));
  if (s.ok()) s = ReadFully(j.in[0], &a2, 1, deadline, RankName(left));
  if (s.ok() && (a1 != 'M' || a2 != 'M')) {
    s = absl::UnavailableError("a neighbour could not map the shared-memory segment");
  }
  if (j.own_segment != nullptr) j.own_segment->Unlink();
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("rank ", r, " joining: ", s.message()));
  }
  if (j.shm_out) segments_.push_back(std::move(j.right_probe));
  if (j.shm_in && j.left_probe != nullptr && left_seg_ == j.left_probe.get()) {
    segments_.push_back(std::move(j.left_probe));
  }
  my_seg_ = j.own_segment.get();
  if (j.own_segment != nullptr) segments_.push_back(std::move(j.own_segment));
  return absl::OkStatus();
}

// One Link per stripe; the Links own the TCP connections from here on.
void CpuCommunicator::BuildLinks(Joining& j) {
  const int n = o_.world_size, r = o_.rank;
  const int left = (r - 1 + n) % n, right = (r + 1) % n;
  const int stripes = Stripes(j);
  for (int k = 0; k < stripes; ++k) {
    LinkConfig c;
    c.left_name = RankName(left);
    c.right_name = RankName(right);
    c.left_rank = left;
    c.right_rank = right;
    if (j.shm_out) {
      c.send_ring = right_seg_->ring(k);
      c.right_bell = right_seg_->bell(k);
      c.send_ctl_fd = j.out[0];
    } else {
      c.send_fd = std::exchange(j.out[k], -1);
    }
    if (j.shm_in) {
      c.recv_ring = my_seg_->ring(k);
      c.left_bell = left_seg_->bell(k);
      c.recv_ctl_fd = j.in[0];
    } else {
      c.recv_fd = std::exchange(j.in[k], -1);
    }
    if (my_seg_ != nullptr) c.my_bell = my_seg_->bell(k);
    links_.push_back(std::make_unique<Link>(c, &stop_));
  }
  if (j.shm_out) ctl_fds_.push_back(std::exchange(j.out[0], -1));
  if (j.shm_in) ctl_fds_.push_back(std::exchange(j.in[0], -1));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateCpuCommunicator(
    const CommunicatorOptions& options) {
  Transport transport = options.transport;
  if (const char* env = std::getenv("DEEPNEX_COLLECTIVE_TRANSPORT"); env && *env) {
    auto t = ParseTransport(env);
    if (!t.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("DEEPNEX_COLLECTIVE_TRANSPORT=\"", env, "\": ", t.status().message()));
    }
    transport = *t;
  }
  auto comm = std::make_unique<CpuCommunicator>(options);
  DEEPNEX_RETURN_IF_ERROR(comm->Init(transport));
  return std::unique_ptr<Communicator>(std::move(comm));
}

#if !DEEPNEX_HAVE_NCCL
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(const CommunicatorOptions&) {
  return absl::FailedPreconditionError(
      "backend nccl: this build of deepnex has no NCCL (built without DEEPNEX_WITH_NCCL)");
}
#endif

}  // namespace deepnex::collective
