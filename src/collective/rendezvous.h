// How a communicator's ranks find each other, for every backend: through the
// store, under the communicator's prefix. Private to libdeepnex.
#ifndef DEEPNEX_COLLECTIVE_RENDEZVOUS_H_
#define DEEPNEX_COLLECTIVE_RENDEZVOUS_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "deepnex/collective/communicator.h"
#include "deepnex/collective/store.h"

namespace deepnex::collective {

// One communicator's rendezvous. Each rank counts the communicators of a
// backend it joined under a prefix (its generation), so a reused prefix
// never reads an earlier communicator's keys. A join that does not end in
// Keep() is taken back when the Rendezvous goes (this rank's keys deleted,
// its count lowered): ranks that retry together after a failed start meet
// again rather than one attempt apart. Used by one thread at a time.
class Rendezvous {
 public:
  ~Rendezvous();
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

  // The communicator is up: its join stands. With `blame`, a client of the
  // store with a short timeout stays connected for Blame (a failure is no
  // time to dial: with the store gone, each rank round the ring waited for
  // it in turn); else the store is let go.
  void Keep(bool blame = false);
  // After Keep(true), as the communicator's collectives fail with `why`,
  // before its links go: its neighbours see only that it broke off. When
  // `why` is neighbour `peer`'s breaking off, returns where the failure
  // began as `peer` recorded it (empty when it recorded nothing: a rank
  // that died records nothing), and records that rather than `why`. Each
  // call to a store out of reach ends within kBlameTimeout.
  std::string Blame(const std::string& why, std::optional<int> peer);
  static constexpr std::chrono::milliseconds kBlameTimeout{200};

 private:
  Rendezvous(const CommunicatorOptions& options, std::unique_ptr<StoreClient> store,
             const std::string& backend, int64_t generation, std::string label);
  // The key of `rank`'s `name` under `generation`: "<backend><gen>/<name>/<rank>".
  std::string KeyAt(int64_t generation, const std::string& name, int rank) const;
  // A client of the store whose calls wait at most `timeout`: for a start
  // or a communicator that has failed already, perhaps because the store
  // is out of reach.
  absl::StatusOr<std::unique_ptr<StoreClient>> QuickStore(
      std::chrono::milliseconds timeout) const;

  const CommunicatorOptions& o_;
  std::unique_ptr<StoreClient> store_;
  std::string label_;
  std::string backend_;
  int64_t generation_ = 0;
  int64_t joined_ = 0;  // this join's turn (TurnKey)
  std::vector<std::string> published_;  // this rank's keys under generation_
  bool kept_ = false;  // or the store is out of reach
};

}  // namespace deepnex::collective

#endif  // DEEPNEX_COLLECTIVE_RENDEZVOUS_H_
