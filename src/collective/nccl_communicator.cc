// The nccl backend (built only with DEEPNEX_HAVE_NCCL): collectives on GPU
// memory through NCCL, on a CUDA stream of the communicator's own.
//
// Rank 0 makes the ncclUniqueId and publishes it through the store. Init is
// non-blocking (ncclConfig_t.blocking = 0) and polled with
// ncclCommGetAsyncError against the deadline; so is every collective, and one
// past its deadline ends with ncclCommAbort. Every NCCL or CUDA error becomes
// a Status naming the call. Without a device, Create is FailedPrecondition.
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "collective/backends.h"
#include "collective/cuda_api.h"
#include "collective/rendezvous.h"
#include "collective/work_queue.h"

namespace deepnex::collective {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr auto kSpin = std::chrono::microseconds(200);

// The loaded calls; CreateNcclCommunicator has loaded them before any use.
const CudaApi& Cu() { return **LoadCudaApi(); }

absl::Status CudaError(const char* call, cudaError_t e) {
  absl::StatusCode code = e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ||
                                  e == cudaErrorInvalidDevice
                              ? absl::StatusCode::kFailedPrecondition
                              : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(call, ": ", Cu().cudaGetErrorName(e), " (",
                                         Cu().cudaGetErrorString(e), ")"));
}

#define DEEPNEX_CUDA(call)                                      \
  do {                                                          \
    cudaError_t deepnex_cuda_e_ = Cu().call;                    \
    if (deepnex_cuda_e_ != cudaSuccess) return CudaError(#call, deepnex_cuda_e_); \
  } while (0)

absl::Status NcclError(const char* call, ncclResult_t r, ncclComm_t comm = nullptr) {
  absl::StatusCode code = absl::StatusCode::kInternal;
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) code = absl::StatusCode::kInvalidArgument;
  if (r == ncclRemoteError || r == ncclSystemError) code = absl::StatusCode::kUnavailable;
  const char* last = comm != nullptr ? Cu().ncclGetLastError(comm) : Cu().ncclGetLastError(nullptr);
  return absl::Status(code, absl::StrCat(call, ": ", Cu().ncclGetErrorString(r),
                                         last && *last ? absl::StrCat(" (", last, ")") : ""));
}

#define DEEPNEX_NCCL(call, comm)                                          \
  do {                                                                    \
    ncclResult_t deepnex_nccl_r_ = Cu().call;                             \
    if (deepnex_nccl_r_ != ncclSuccess && deepnex_nccl_r_ != ncclInProgress) \
      return NcclError(#call, deepnex_nccl_r_, comm);                     \
  } while (0)

absl::StatusOr<ncclDataType_t> NcclType(DType d) {
  switch (d) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat64: return ncclFloat64;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kInt32: return ncclInt32;
    case DType::kInt64: return ncclInt64;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "nccl: dtype ", DTypeName(d),
          " is not supported (float32, float64, float16, bfloat16, int32, int64)"));
  }
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kMean: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kProd: return ncclProd;
  }
  return ncclSum;
}

// The header every rank contributes before a collective (see the cpu
// backend): a mismatch fails every rank with InvalidArgument.
struct Header {
  int64_t kind, dtype, op, root, count, invalid;
};

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(const CommunicatorOptions& o) : o_(o) {}

  ~NcclCommunicator() override {
    if (queue_ != nullptr) queue_->Close();
    if (comm_ != nullptr) {
      if (broken_) {
        Cu().ncclCommAbort(comm_);
      } else {
        // Non-blocking communicators finalize asynchronously: wait (bounded)
        // before destroying, else abort.
        ncclResult_t r = Cu().ncclCommFinalize(comm_);
        ncclResult_t state = ncclInProgress;
        auto until = Clock::now() + std::chrono::seconds(10);
        while (r == ncclSuccess || r == ncclInProgress) {
          if (Cu().ncclCommGetAsyncError(comm_, &state) != ncclSuccess || state != ncclInProgress ||
              Clock::now() > until) {
            break;
          }
          std::this_thread::sleep_for(milliseconds(1));
        }
        if (state == ncclSuccess) {
          Cu().ncclCommDestroy(comm_);
        } else {
          Cu().ncclCommAbort(comm_);
        }
      }
    }
    if (header_dev_ != nullptr) Cu().cudaFree(header_dev_);
    if (stream_ != nullptr) Cu().cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
    int count = 0;
    cudaError_t e = Cu().cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "backend nccl: no device (cudaGetDeviceCount: ",
          e != cudaSuccess ? absl::StrCat(Cu().cudaGetErrorName(e), ", ", Cu().cudaGetErrorString(e))
                           : "0 devices",
          ")"));
    }
    device_ = o_.device;
    if (device_ < 0) {
      const char* local = std::getenv("DEEPNEX_LOCAL_RANK");
      device_ = (local && *local ? std::atoi(local) : 0) % count;
    }
    if (device_ >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat("device=", device_, ": only ", count, " visible devices"));
    }
    DEEPNEX_CUDA(cudaSetDevice(device_));
    DEEPNEX_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    DEEPNEX_CUDA(cudaMalloc(&header_dev_, sizeof(Header) * (o_.world_size + 1)));

    const auto deadline = Clock::now() + o_.timeout;
    ncclUniqueId id;
    if (o_.world_size == 1) {
      DEEPNEX_NCCL(ncclGetUniqueId(&id), nullptr);
    } else {
      // Every rank publishes; rank 0's value is the id.
      DEEPNEX_ASSIGN_OR_RETURN(auto rendezvous, Rendezvous::Join(o_, "nccl", "nccl communicator"));
      std::string mine = "-";
      if (o_.rank == 0) {
        DEEPNEX_NCCL(ncclGetUniqueId(&id), nullptr);
        mine.assign(reinterpret_cast<char*>(&id), sizeof(id));
      }
      DEEPNEX_ASSIGN_OR_RETURN(auto values, rendezvous->AllGather("rank", mine, deadline));
      rendezvous->Keep();  // every rank has the id: NCCL's init is its own
      const std::string& bytes = values[0];
      if (bytes.size() != sizeof(id)) return absl::InternalError("garbled ncclUniqueId in the store");
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    DEEPNEX_NCCL(ncclCommInitRankConfig(&comm_, o_.world_size, id, o_.rank, &config), nullptr);
    absl::Status s = Settle("ncclCommInitRankConfig", deadline);
    if (!s.ok()) return s;
    queue_ = std::make_unique<SerialQueue>();
    return absl::OkStatus();
  }

  std::shared_ptr<Work> AllReduceAsync(const TensorView& t, ReduceOp op) override {
    return Enqueue([=]() -> absl::Status {
      auto deadline = Clock::now() + o_.timeout;
      absl::Status local = CheckDevice("allreduce", t);
      if (local.ok()) local = CheckReduceOp("allreduce", op);
      DEEPNEX_RETURN_IF_ERROR(Check(Kind::kAllReduce, t, op, 0, t.NumElements(), local, deadline));
      if (t.NumElements() == 0) return absl::OkStatus();
      DEEPNEX_ASSIGN_OR_RETURN(ncclDataType_t dt, NcclType(t.dtype));
      DEEPNEX_NCCL(ncclAllReduce(t.data, t.data, t.NumElements(), dt, NcclOp(op), comm_, stream_), comm_);
      return Complete("ncclAllReduce", deadline);
    }, t.NumBytes());
  }

  std::shared_ptr<Work> BroadcastAsync(const TensorView& t, int root) override {
    return Enqueue([=]() -> absl::Status {
      auto deadline = Clock::now() + o_.timeout;
      absl::Status local = CheckDevice("broadcast", t);
      if (local.ok() && (root < 0 || root >= o_.world_size)) {
        local = absl::InvalidArgumentError(
            absl::StrCat("broadcast: root ", root, " is outside 0..", o_.world_size - 1));
      }
      DEEPNEX_RETURN_IF_ERROR(Check(Kind::kBroadcast, t, ReduceOp::kSum, root, t.NumElements(), local, deadline));
      if (t.NumElements() == 0) return absl::OkStatus();
      DEEPNEX_ASSIGN_OR_RETURN(ncclDataType_t dt, NcclType(t.dtype));
      DEEPNEX_NCCL(ncclBroadcast(t.data, t.data, t.NumElements(), dt, root, comm_, stream_), comm_);
      return Complete("ncclBroadcast", deadline);
    }, t.NumBytes());
  }

  std::shared_ptr<Work> AllGatherAsync(const TensorView& in, const TensorView& out) override {
    return Enqueue([=]() -> absl::Status {
      auto deadline = Clock::now() + o_.timeout;
      absl::Status local = CheckDevice("allgather", in);
      if (local.ok()) local = CheckDevice("allgather", out);
      if (local.ok() && (in.dtype != out.dtype ||
                         out.NumElements() != in.NumElements() * int64_t{o_.world_size})) {
        local = absl::InvalidArgumentError(
            "allgather: the output must hold world_size x the input's elements, same dtype");
      }
      DEEPNEX_RETURN_IF_ERROR(Check(Kind::kAllGather, in, ReduceOp::kSum, 0, in.NumElements(), local, deadline));
      if (in.NumElements() == 0) return absl::OkStatus();
      DEEPNEX_ASSIGN_OR_RETURN(ncclDataType_t dt, NcclType(in.dtype));
      DEEPNEX_NCCL(ncclAllGather(in.data, out.data, in.NumElements(), dt, comm_, stream_), comm_);
      return Complete("ncclAllGather", deadline);
    }, out.NumBytes());
  }

  std::shared_ptr<Work> ReduceScatterAsync(const TensorView& in, const TensorView& out,
                                           ReduceOp op) override {
    return Enqueue([=]() -> absl::Status {
      auto deadline = Clock::now() + o_.timeout;
      absl::Status local = CheckDevice("reduce_scatter", in);
      if (local.ok()) local = CheckDevice("reduce_scatter", out);
      if (local.ok()) local = CheckReduceOp("reduce_scatter", op);
      if (local.ok() && (in.dtype != out.dtype ||
                         in.NumElements() != out.NumElements() * int64_t{o_.world_size})) {
        local = absl::InvalidArgumentError(
            "reduce_scatter: the input must hold world_size x the output's elements, same dtype");
      }
      DEEPNEX_RETURN_IF_ERROR(Check(Kind::kReduceScatter, out, op, 0, out.NumElements(), local, deadline));
      if (out.NumElements() == 0) return absl::OkStatus();
      DEEPNEX_ASSIGN_OR_RETURN(ncclDataType_t dt, NcclType(out.dtype));
      DEEPNEX_NCCL(ncclReduceScatter(in.data, out.data, out.NumElements(), dt, NcclOp(op), comm_,
                                     stream_),
                   comm_);
      return Complete("ncclReduceScatter", deadline);
    }, in.NumBytes());
  }

  std::shared_ptr<Work> BarrierAsync() override {
    return Enqueue([this]() -> absl::Status {
      auto deadline = Clock::now() + o_.timeout;
      // The header exchange is itself a barrier.
      return Check(Kind::kBarrier, TensorView(), ReduceOp::kSum, 0, 0, absl::OkStatus(), deadline);
    }, 0);
  }

  void Abort() override {
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (aborted_) return;
    aborted_ = true;
    broken_ = true;
    if (comm_ != nullptr) Cu().ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  int rank() const override { return o_.rank; }
  int world_size() const override { return o_.world_size; }
  Backend backend() const override { return Backend::kNccl; }
  std::string transport() const override { return "nccl"; }

 private:
  // Collectives up to kLazyBytes are left for their waiter to issue, on its
  // own thread: each selects the communicator's device for its calls and
  // gives the thread back its own.
  std::shared_ptr<Work> Enqueue(std::function<absl::Status()> fn, size_t bytes) {
    return queue_->Enqueue(
        [this, fn = std::move(fn)]() -> absl::Status {
          if (broken_ || comm_ == nullptr) {
            return absl::AbortedError("the nccl communicator is broken by an earlier error or abort");
          }
          int caller_device = -1;
          Cu().cudaGetDevice(&caller_device);
          if (caller_device != device_) DEEPNEX_CUDA(cudaSetDevice(device_));
          absl::Status s = fn();
          if (caller_device >= 0 && caller_device != device_) Cu().cudaSetDevice(caller_device);
          if (!s.ok() && s.code() != absl::StatusCode::kInvalidArgument) broken_ = true;
          return s;
        },
        /*lazy=*/bytes <= kLazyBytes);
  }

  absl::Status CheckDevice(const char* what, const TensorView& t) {
    DEEPNEX_RETURN_IF_ERROR(t.CheckShape(what));
    DEEPNEX_RETURN_IF_ERROR(NcclType(t.dtype).status());
    if (t.NumElements() == 0) return absl::OkStatus();
    cudaPointerAttributes attr;
    cudaError_t e = Cu().cudaPointerGetAttributes(&attr, t.data);
    if (e != cudaSuccess) {
      Cu().cudaGetLastError();
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": the tensor is not CUDA memory (cudaPointerGetAttributes: ",
                       Cu().cudaGetErrorName(e), ")"));
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": the nccl backend takes GPU tensors; this one is in host memory"));
    }
    if (attr.type == cudaMemoryTypeDevice && attr.device != device_) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": the tensor is on device ",
                                                     attr.device, ", the communicator on ", device_));
    }
    return absl::OkStatus();
  }

  // Every rank contributes its header; all compare them.
  absl::Status Check(Kind kind, const TensorView& t, ReduceOp op, int root, int64_t count,
                     const absl::Status& local, Clock::time_point deadline) {
    Header mine{static_cast<int64_t>(kind), static_cast<int64_t>(t.dtype),
                static_cast<int64_t>(op), root, count, local.ok() ? 0 : 1};
    // Only the fields a kind uses take part in the comparison.
    if (kind == Kind::kAllGather || kind == Kind::kBroadcast || kind == Kind::kBarrier) mine.op = 0;
    if (kind == Kind::kBarrier) mine.dtype = 0;
    if (o_.world_size == 1) return local;
    char* dev = static_cast<char*>(header_dev_);
    DEEPNEX_CUDA(cudaMemcpyAsync(dev + sizeof(Header) * o_.world_size, &mine, sizeof(Header),
                                 cudaMemcpyHostToDevice, stream_));
    DEEPNEX_NCCL(ncclAllGather(dev + sizeof(Header) * o_.world_size, dev, sizeof(Header) / 8,
                               ncclInt64, comm_, stream_),
                 comm_);
    std::vector<Header> all(o_.world_size);
    DEEPNEX_CUDA(cudaMemcpyAsync(all.data(), dev, sizeof(Header) * o_.world_size,
                                 cudaMemcpyDeviceToHost, stream_));
    DEEPNEX_RETURN_IF_ERROR(Complete("ncclAllGather (collective header)", deadline));
    if (!local.ok()) return local;
    for (int i = 0; i < o_.world_size; ++i) {
      if (all[i].invalid) {
        return absl::InvalidArgumentError(
            absl::StrCat("invalid arguments on rank ", i, "; nothing was done"));
      }
      if (std::memcmp(&all[i], &all[0], sizeof(Header)) != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ranks disagree on the collective (rank 0: ", KindName(static_cast<Kind>(all[0].kind)),
            ", ", all[0].count, " elements of dtype ", all[0].dtype, "; rank ", i, ": ",
            KindName(static_cast<Kind>(all[i].kind)), ", ", all[i].count, " elements of dtype ",
            all[i].dtype, "); nothing was done"));
      }
    }
    return absl::OkStatus();
  }

  // Waits for the stream, polling NCCL's asynchronous errors; aborts the
  // communicator past the deadline. Polls back to back for the first
  // kSpin, as cudaStreamSynchronize spins: a small collective's kernels end
  // within microseconds, and one 50 us sleep would be most of its time.
  absl::Status Complete(const char* call, Clock::time_point deadline) {
    const auto spin_until = Clock::now() + kSpin;
    while (true) {
      cudaError_t e = Cu().cudaStreamQuery(stream_);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return CudaError(absl::StrCat("cudaStreamQuery after ", call).c_str(), e);
      DEEPNEX_RETURN_IF_ERROR(Settle(call, Clock::time_point::max(), /*once=*/true));
      const auto now = Clock::now();
      if (now < spin_until) continue;
      if (now >= deadline) {
        Abort();
        return absl::DeadlineExceededError(absl::StrCat(
            call, " did not complete within ", o_.timeout.count(),
            " ms (a rank stalled or died); the communicator was aborted"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // Polls ncclCommGetAsyncError until the communicator is not in progress.
  absl::Status Settle(const char* call, Clock::time_point deadline, bool once = false) {
    while (true) {
      ncclComm_t comm;
      {
        std::lock_guard<std::mutex> lock(abort_mu_);
        comm = comm_;
      }
      if (comm == nullptr) return absl::AbortedError("the nccl communicator was aborted");
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = Cu().ncclCommGetAsyncError(comm, &state);
      if (r != ncclSuccess) return NcclError("ncclCommGetAsyncError", r, comm);
      if (state == ncclSuccess || (once && state == ncclInProgress)) return absl::OkStatus();
      if (state != ncclInProgress) {
        absl::Status s = NcclError(call, state, comm);
        Abort();
        return s;
      }
      if (Clock::now() >= deadline) {
        Abort();
        return absl::DeadlineExceededError(absl::StrCat(
            call, " did not complete within ", o_.timeout.count(),
            " ms (did every rank start?); the communicator was aborted"));
      }
      std::this_thread::sleep_for(milliseconds(1));
    }
  }

  const CommunicatorOptions o_;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  void* header_dev_ = nullptr;
  std::mutex abort_mu_;
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
  std::atomic<bool> broken_{false};

  std::unique_ptr<SerialQueue> queue_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    const CommunicatorOptions& options) {
  DEEPNEX_RETURN_IF_ERROR(LoadCudaApi().status());
  auto comm = std::make_unique<NcclCommunicator>(options);
  DEEPNEX_RETURN_IF_ERROR(comm->Init());
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace deepnex::collective
