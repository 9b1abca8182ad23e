// Which workers a parameter server waits for: each holds a lease renewed by
// heartbeats; an expired lease shrinks the rounds or aborts them, by policy.
#ifndef DEEPNEX_PS_MEMBERSHIP_H_
#define DEEPNEX_PS_MEMBERSHIP_H_

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "deepnex/ps/server.h"
#include "deepnex/status.h"

namespace deepnex::ps {

// Thread-safe. Its lock is a leaf: partitions call it while holding theirs.
class Membership {
 public:
  using Clock = std::chrono::steady_clock;

  enum class State {
    kExpected,  // never registered: rounds wait for it (the job is starting)
    kLive,      // registered, lease current
    kDead,      // lease expired
    kLeft,      // left cleanly
  };

  Membership(int num_workers, std::chrono::milliseconds lease_timeout,
             LeasePolicy policy);

  // Starts (or restarts, with a new incarnation) worker `w`'s lease.
  // Returns true when this is a new incarnation.
  bool Register(int w, uint64_t incarnation);
  // Aborted when the lease already expired or another incarnation holds it.
  absl::Status Heartbeat(int w, uint64_t incarnation);
  // A worker leaves for good, unless `never_pushed` and it was still
  // expected when this incarnation registered: then it is expected again,
  // so that a client made only to look does not shrink the job's rounds.
  void Leave(int w, uint64_t incarnation, bool never_pushed);

  // The incarnation registered for `w` (0: none).
  uint64_t Incarnation(int w) const;
  // Whether rounds must wait for `w` (under kAbort a dead worker still
  // counts: its rounds cannot complete and fail instead).
  bool Required(int w) const;
  // Non-empty under kAbort while a required worker is dead: why rounds fail.
  std::string AbortReason() const;

  // Marks workers whose lease ran out; returns them.
  std::vector<int> Expire(Clock::time_point now);

  State state(int w) const;
  int LiveCount() const;
  int num_workers() const { return static_cast<int>(workers_.size()); }

 private:
  struct Worker {
    State state = State::kExpected;
    State before = State::kExpected;  // when `incarnation` registered
    uint64_t incarnation = 0;
    Clock::time_point last_heartbeat;
  };
  const std::chrono::milliseconds lease_timeout_;
  const LeasePolicy policy_;
  mutable std::mutex mu_;
  std::vector<Worker> workers_;
};

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_MEMBERSHIP_H_
