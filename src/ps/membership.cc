#include "ps/membership.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace deepnex::ps {

Membership::Membership(int num_workers, std::chrono::milliseconds lease_timeout,
                       LeasePolicy policy)
    : lease_timeout_(lease_timeout), policy_(policy), workers_(num_workers) {}

bool Membership::Register(int w, uint64_t incarnation) {
  std::lock_guard<std::mutex> lock(mu_);
  Worker& k = workers_[w];
  bool fresh = k.incarnation != incarnation;
  if (fresh) k.before = k.state;
  k.incarnation = incarnation;
  k.state = State::kLive;
  k.last_heartbeat = Clock::now();
  return fresh;
}

absl::Status Membership::Heartbeat(int w, uint64_t incarnation) {
  std::lock_guard<std::mutex> lock(mu_);
  Worker& k = workers_[w];
  if (k.incarnation != incarnation) {
    return absl::AbortedError(absl::StrFormat(
        "worker %d was registered again by another process; this client is stale", w));
  }
  if (k.state != State::kLive) {
    return absl::AbortedError(absl::StrFormat(
        "worker %d's lease expired (no heartbeat for %d ms); register again to rejoin",
        w, lease_timeout_.count()));
  }
  k.last_heartbeat = Clock::now();
  return absl::OkStatus();
}

void Membership::Leave(int w, uint64_t incarnation, bool never_pushed) {
  std::lock_guard<std::mutex> lock(mu_);
  Worker& k = workers_[w];
  if (k.incarnation != incarnation) return;
  k.state = never_pushed && k.before == State::kExpected ? State::kExpected : State::kLeft;
}

uint64_t Membership::Incarnation(int w) const {
  std::lock_guard<std::mutex> lock(mu_);
  return workers_[w].incarnation;
}

bool Membership::Required(int w) const {
  std::lock_guard<std::mutex> lock(mu_);
  State s = workers_[w].state;
  return s == State::kExpected || s == State::kLive ||
         (s == State::kDead && policy_ == LeasePolicy::kAbort);
}

std::string Membership::AbortReason() const {
  if (policy_ != LeasePolicy::kAbort) return "";
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t w = 0; w < workers_.size(); ++w) {
    if (workers_[w].state == State::kDead) {
      return absl::StrFormat(
          "worker %d's lease expired (no heartbeat for %d ms); the round is aborted",
          w, lease_timeout_.count());
    }
  }
  return "";
}

std::vector<int> Membership::Expire(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> expired;
  for (size_t w = 0; w < workers_.size(); ++w) {
    Worker& k = workers_[w];
    if (k.state == State::kLive && now - k.last_heartbeat > lease_timeout_) {
      k.state = State::kDead;
      expired.push_back(static_cast<int>(w));
    }
  }
  return expired;
}

Membership::State Membership::state(int w) const {
  std::lock_guard<std::mutex> lock(mu_);
  return workers_[w].state;
}

int Membership::LiveCount() const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (const auto& k : workers_) n += k.state == State::kLive;
  return n;
}

}  // namespace deepnex::ps
