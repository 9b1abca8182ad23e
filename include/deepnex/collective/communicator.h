// Communicators: the collectives of synchronous data-parallel training
// (allreduce, broadcast, allgather, reduce-scatter, barrier) among the
// `world_size` ranks of a job, who meet through a rendezvous store.
//
// Backends: `cpu` (a pipelined ring over TCP between hosts and over shared
// memory between ranks on one host) and `nccl` (GPU memory, when built with
// NCCL). Every rank must issue the same collectives in the same order; a
// collective whose size, dtype, op or root differs across ranks fails with
// InvalidArgument on every rank instead of hanging or mixing data.
#ifndef DEEPNEX_COLLECTIVE_COMMUNICATOR_H_
#define DEEPNEX_COLLECTIVE_COMMUNICATOR_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "deepnex/env.h"
#include "deepnex/status.h"
#include "deepnex/tensor.h"
#include "deepnex/transport.h"

namespace deepnex::collective {

enum class ReduceOp { kSum, kMean, kMax, kMin, kProd };
// "sum", "mean", "max", "min", "prod".
const char* ReduceOpName(ReduceOp op);
// InvalidArgument naming `what` and the value for an op that is none of the
// above (a cast integer); communicators check each op they are given.
absl::Status CheckReduceOp(const std::string& what, ReduceOp op);
absl::StatusOr<ReduceOp> ParseReduceOp(const std::string& name);

enum class Backend {
  kAuto,  // cpu (nccl must be asked for: tensors of a cpu communicator are host memory)
  kCpu,
  kNccl,
};
const char* BackendName(Backend backend);
absl::StatusOr<Backend> ParseBackend(const std::string& name);

// How the cpu backend moves bytes between ring neighbours. kAuto: shared
// memory between ranks on one host that can map each other's segments
// (tried at init; a pair that cannot, e.g. one with its own /dev/shm, says
// so on stderr), TCP otherwise; kShm: FailedPrecondition if a neighbour is on
// another host.
using ::deepnex::ParseTransport;
using ::deepnex::Transport;
using ::deepnex::TransportName;

struct CommunicatorOptions {
  // The most ranks a communicator forms: its rendezvous gathers every rank's
  // address in one store call, and a typo'd world size must not take the
  // host's memory.
  static constexpr int kMaxWorldSize = 1 << 16;
  // This process's rank, 0 <= rank < world_size.
  int rank = 0;
  int world_size = 1;  // 1..kMaxWorldSize
  // host:port of the rendezvous store (deepnex-store or a StoreServer).
  std::string store_address;
  // Namespace of this communicator's keys in the store. Communicators that
  // share a store at the same time need different prefixes; the same prefix
  // may be reused once the previous communicator is gone. Default: "deepnex"
  std::string prefix = "deepnex";
  // Bearer token for the store, or a file holding it. Default: none
  std::string token;
  std::string token_file;
  // Default: kAuto
  Backend backend = Backend::kAuto;
  // Deadline of init (every rank must arrive within it) and of each
  // collective. Default: 30 s
  std::chrono::milliseconds timeout{30000};
  // cpu backend. The environment variable DEEPNEX_COLLECTIVE_TRANSPORT
  // (auto|tcp|shm), when set, overrides this. Default: kAuto
  Transport transport = Transport::kAuto;
  // cpu backend: parallel TCP connections (each with its own thread) to each
  // ring neighbour; a large tensor is striped across them. Default: 2
  int connections_per_peer = 2;
  // cpu backend: parallel shared-memory channels per neighbour, each with its
  // own thread. 0: 2, or fewer where the host's ranks have fewer CPUs than
  // 2 each (with one CPU per rank, more threads only take turns). Default: 0
  int shm_channels = 0;
  // cpu backend: bytes of each shared-memory ring buffer: room for a whole
  // two-rank allreduce of up to 1 MiB, and small enough to stay in cache.
  // At most kMaxShmBufferBytes. Default: 1 MiB + 64 KiB
  uint64_t shm_buffer_bytes = (1ull << 20) + (64 << 10);
  static constexpr uint64_t kMaxShmBufferBytes = 256ull << 20;
  // cpu backend: the address other ranks reach this one at. Empty: the
  // local address of the route to the store's host. Default: ""
  std::string host;
  // nccl backend: the CUDA device. -1: DEEPNEX_LOCAL_RANK (default 0)
  // modulo the visible devices. Default: -1
  int device = -1;

  // InvalidArgument naming the field for a bad value.
  absl::Status Validate() const;

  // The options of a communicator of the job's workers, from the job
  // environment (deepnex::Context::FromEnv()): rank, world size, the store
  // address and token, the job id as prefix and the local rank's device.
  static CommunicatorOptions FromContext(const Context& context);
};

// A collective in flight. Wait may be called from any thread, repeatedly.
class Work {
 public:
  virtual ~Work() = default;
  // Waits up to `timeout`; DeadlineExceeded if the collective is still
  // running then (it keeps running, bounded by the communicator's timeout),
  // else its status.
  virtual absl::Status Wait(std::chrono::milliseconds timeout) = 0;
  // Waits for the collective, whose own deadline bounds the wait.
  virtual absl::Status Wait() = 0;
  virtual bool Done() const = 0;
};

// One rank's member of a communicator.
//
// Thread-safe: collectives may be issued from any thread; they run one at a
// time, in the order issued, on the communicator's own thread. The caller
// keeps the tensors alive and untouched until the collective is done.
//
// dtypes: float32, float64, float16 and bfloat16 (each step reduced in
// float32), int32, int64. Mean of integers truncates toward zero.
// After a transport failure or a timeout (a rank died or stalled) the
// communicator is broken: that collective fails with Unavailable,
// Aborted or DeadlineExceeded, and later ones fail with Aborted.
class Communicator {
 public:
  // Joins the communicator: waits, up to options.timeout, for every rank to
  // arrive at the store and connect. DeadlineExceeded names missing ranks.
  // nccl without a device (or a build without NCCL) is FailedPrecondition.
  static absl::StatusOr<std::unique_ptr<Communicator>> Create(
      const CommunicatorOptions& options);
  virtual ~Communicator() = default;

  // In place: every rank ends with op over all ranks' `tensor`.
  absl::Status AllReduce(const TensorView& tensor, ReduceOp op = ReduceOp::kSum) {
    return AllReduceAsync(tensor, op)->Wait();
  }
  // In place: every rank ends with `root`'s `tensor`.
  absl::Status Broadcast(const TensorView& tensor, int root) {
    return BroadcastAsync(tensor, root)->Wait();
  }
  // `output` (world_size x input elements, same dtype) gets every rank's
  // `input` in rank order.
  absl::Status AllGather(const TensorView& input, const TensorView& output) {
    return AllGatherAsync(input, output)->Wait();
  }
  // `input` holds world_size blocks of output's element count; rank r's
  // `output` gets op over all ranks' block r. `input` is not modified.
  absl::Status ReduceScatter(const TensorView& input, const TensorView& output,
                             ReduceOp op = ReduceOp::kSum) {
    return ReduceScatterAsync(input, output, op)->Wait();
  }
  // Returns once every rank has entered the barrier.
  absl::Status Barrier() { return BarrierAsync()->Wait(); }

  virtual std::shared_ptr<Work> AllReduceAsync(const TensorView& tensor, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> BroadcastAsync(const TensorView& tensor, int root) = 0;
  virtual std::shared_ptr<Work> AllGatherAsync(const TensorView& input,
                                               const TensorView& output) = 0;
  virtual std::shared_ptr<Work> ReduceScatterAsync(const TensorView& input,
                                                   const TensorView& output, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> BarrierAsync() = 0;

  // Breaks the communicator now: collectives in flight here fail with
  // Aborted, and the other ranks see this rank leave. Idempotent.
  virtual void Abort() = 0;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual Backend backend() const = 0;
  // cpu: "tcp", "shm" or "shm+tcp" (per neighbour); "" for a single rank.
  virtual std::string transport() const = 0;
};

}  // namespace deepnex::collective

#endif  // DEEPNEX_COLLECTIVE_COMMUNICATOR_H_
