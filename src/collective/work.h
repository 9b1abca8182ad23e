// Shared pieces of the communicator backends. Private to libdeepnex.
#ifndef DEEPNEX_COLLECTIVE_WORK_H_
#define DEEPNEX_COLLECTIVE_WORK_H_

#include <condition_variable>
#include <memory>
#include <mutex>

#include "deepnex/collective/communicator.h"
#include "deepnex/collective/store.h"

namespace deepnex::collective {

// A collective's completion: finished once by the communicator's thread.
class WorkImpl final : public Work {
 public:
  void Finish(absl::Status status);
  absl::Status Wait(std::chrono::milliseconds timeout) override;
  absl::Status Wait() override;
  bool Done() const override;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  absl::Status status_;
};

std::shared_ptr<Work> FinishedWork(absl::Status status);

// The store client a communicator rendezvouses through.
absl::StatusOr<std::unique_ptr<StoreClient>> ConnectStore(const CommunicatorOptions& options);

absl::StatusOr<std::unique_ptr<Communicator>> CreateCpuCommunicator(
    const CommunicatorOptions& options);
// FailedPrecondition when built without NCCL or without a device.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    const CommunicatorOptions& options);

}  // namespace deepnex::collective

#endif  // DEEPNEX_COLLECTIVE_WORK_H_
