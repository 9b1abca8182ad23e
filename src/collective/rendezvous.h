// How a communicator's ranks find each other, for every backend: through the
// store, under the communicator's prefix. Private to libdeepnex.
#ifndef DEEPNEX_COLLECTIVE_RENDEZVOUS_H_
#define DEEPNEX_COLLECTIVE_RENDEZVOUS_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "deepnex/collective/communicator.h"
#include "deepnex/collective/store.h"

namespace deepnex::collective {

// One communicator's rendezvous. Each rank counts the communicators of a
// backend it joined under a prefix (its generation), so a reused prefix
// never reads an earlier communicator's keys. Used by one thread.
class Rendezvous {
 public:
  // Connects to the options' store. `backend` keeps the keys of backends
  // apart ("c", "nccl"); `label` names the communicator in errors.
  static absl::StatusOr<std::unique_ptr<Rendezvous>> Join(const CommunicatorOptions& options,
                                                          const std::string& backend,
                                                          const std::string& label);

  // Publishes `value` as this rank's `name` and waits until `deadline` for
  // every rank's, returned in rank order. DeadlineExceeded names the ranks
  // that did not publish.
  absl::StatusOr<std::vector<std::string>> AllGather(
      const std::string& name, const std::string& value,
      std::chrono::steady_clock::time_point deadline);

 private:
  Rendezvous(const CommunicatorOptions& options, std::unique_ptr<StoreClient> store,
             std::string base, std::string label)
      : o_(options), store_(std::move(store)), base_(std::move(base)), label_(std::move(label)) {}

  const CommunicatorOptions& o_;
  std::unique_ptr<StoreClient> store_;
  std::string base_;  // "<backend><generation>/"
  std::string label_;
};

}  // namespace deepnex::collective

#endif  // DEEPNEX_COLLECTIVE_RENDEZVOUS_H_
