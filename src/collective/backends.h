// The communicator backends' factories, chosen by Communicator::Create.
// Private to libdeepnex.
#ifndef DEEPNEX_COLLECTIVE_BACKENDS_H_
#define DEEPNEX_COLLECTIVE_BACKENDS_H_

#include <cstdint>
#include <memory>

#include "deepnex/collective/communicator.h"

namespace deepnex::collective {

// The collectives, as both backends name them in the header every rank
// contributes before one (ranks that disagree fail with InvalidArgument).
enum class Kind : uint8_t { kAllReduce = 1, kBroadcast, kAllGather, kReduceScatter, kBarrier };
const char* KindName(Kind kind);

absl::StatusOr<std::unique_ptr<Communicator>> CreateCpuCommunicator(
    const CommunicatorOptions& options);
// FailedPrecondition when built without NCCL or without a device.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    const CommunicatorOptions& options);

}  // namespace deepnex::collective

#endif  // DEEPNEX_COLLECTIVE_BACKENDS_H_
