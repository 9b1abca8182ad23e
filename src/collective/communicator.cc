#include "deepnex/collective/communicator.h"

#include "absl/strings/str_cat.h"
#include "collective/backends.h"
#include "core/net.h"
#include "deepnex/units.h"

namespace deepnex::collective {

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMean: return "mean";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kProd: return "prod";
  }
  return "?";
}

absl::Status CheckReduceOp(const std::string& what, ReduceOp op) {
  if (ReduceOpName(op)[0] != '?') return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, ": op ", static_cast<int>(op),
                                                 " is not a ReduceOp (sum, mean, max, min, prod)"));
}

absl::StatusOr<ReduceOp> ParseReduceOp(const std::string& name) {
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin,
                      ReduceOp::kProd}) {
    if (name == ReduceOpName(op)) return op;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("op: unknown \"", name, "\" (one of sum, mean, max, min, prod)"));
}

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kAllReduce: return "allreduce";
    case Kind::kBroadcast: return "broadcast";
    case Kind::kAllGather: return "allgather";
    case Kind::kReduceScatter: return "reduce_scatter";
    case Kind::kBarrier: return "barrier";
  }
  return "?";
}

const char* BackendName(Backend backend) {
  switch (backend) {
    case Backend::kAuto: return "auto";
    case Backend::kCpu: return "cpu";
    case Backend::kNccl: return "nccl";
  }
  return "?";
}

absl::StatusOr<Backend> ParseBackend(const std::string& name) {
  for (Backend b : {Backend::kAuto, Backend::kCpu, Backend::kNccl}) {
    if (name == BackendName(b)) return b;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("backend: unknown \"", name, "\" (one of auto, cpu, nccl)"));
}

absl::Status CommunicatorOptions::Validate() const {
  if (world_size < 1 || world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size=", world_size, ": must be in 1..", kMaxWorldSize));
  }
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank=", rank, ": must be in 0..", world_size - 1));
  }
  if (store_address.empty() && world_size > 1) {
    return absl::InvalidArgumentError("store_address is empty");
  }
  // Cast integers (a C++ caller's) name no enumerator.
  if (BackendName(backend)[0] == '?') {
    return absl::InvalidArgumentError(absl::StrCat(
        "backend=", static_cast<int>(backend), ": not a Backend (auto, cpu, nccl)"));
  }
  if (TransportName(transport)[0] == '?') {
    return absl::InvalidArgumentError(absl::StrCat(
        "transport=", static_cast<int>(transport), ": not a Transport (auto, tcp, shm)"));
  }
  DEEPNEX_RETURN_IF_ERROR(CheckMillis(timeout, "timeout"));
  if (device < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device=", device, ": must be a device index, or -1 for the local rank's"));
  }
  if (connections_per_peer < 1 || connections_per_peer > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("connections_per_peer=", connections_per_peer, ": must be 1..16"));
  }
  if (shm_channels < 0 || shm_channels > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm_channels=", shm_channels, ": must be 0 (auto) or 1..16"));
  }
  // Bounded: each rank maps up to 16 of them, and a probe's 2^40 filled the
  // host's memory (/dev/shm) until the OOM killer came.
  if (shm_buffer_bytes < 4096 || shm_buffer_bytes > kMaxShmBufferBytes) {
    return absl::InvalidArgumentError(absl::StrCat("shm_buffer_bytes=", shm_buffer_bytes,
                                                   ": must be 4096..", kMaxShmBufferBytes,
                                                   " (256MiB)"));
  }
  // Told to the other ranks, who dial it.
  return ValidateAdvertiseHost("host", host);
}

CommunicatorOptions CommunicatorOptions::FromContext(const Context& context) {
  CommunicatorOptions o;
  o.rank = context.rank;
  o.world_size = context.world_size;
  o.store_address = context.store_addr;
  o.token = context.token;
  if (!context.job_id.empty()) o.prefix = context.job_id;
  o.device = context.local_rank;
  return o;
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::Create(
    const CommunicatorOptions& options) {
  DEEPNEX_RETURN_IF_ERROR(options.Validate());
  switch (options.backend) {
    case Backend::kAuto:
    case Backend::kCpu: return CreateCpuCommunicator(options);
    case Backend::kNccl: return CreateNcclCommunicator(options);
  }
  return absl::InvalidArgumentError("unknown backend");
}

}  // namespace deepnex::collective
