#include "job/elastic.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace deepnex::job {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

bool Ended(const launch::ContainerStatus& st) {
  return st.state == launch::State::kExited || st.state == launch::State::kStopped;
}

}  // namespace

absl::Status ValidateElastic(const JobOptions& o) {
  if (o.min_workers < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_workers: ", o.min_workers, " is below 1"));
  }
  if (o.min_workers > o.workers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "min_workers: ", o.min_workers, " is more than workers (the most): ", o.workers));
  }
  if (IsElastic(o) && o.nodes > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nodes: ", o.nodes, " with an elastic job (min_workers ", o.min_workers,
        "): its workers go where capacity frees, one at a time"));
  }
  return absl::OkStatus();
}

bool IsElastic(const JobOptions& o) { return o.min_workers > 0 && o.min_workers < o.workers; }

absl::StatusOr<std::unique_ptr<Elastic>> Elastic::Start(ElasticOptions options,
                                                        std::vector<gpu::Allocation> first) {
  auto e = std::unique_ptr<Elastic>(new Elastic(std::move(options)));
  DEEPNEX_ASSIGN_OR_RETURN(e->store_, collective::StoreClient::Create(e->o_.store));
  std::vector<Member> members;
  for (const gpu::Allocation& a : first) members.push_back({e->next_id_++, nullptr, a});
  // Published before any starts: each worker finds its generation there.
  DEEPNEX_RETURN_IF_ERROR(e->Publish(members));
  for (size_t rank = 0; rank < members.size(); ++rank) {
    WorkerStart w;
    w.id = members[rank].id;
    w.rank = static_cast<int>(rank);
    w.generation = e->generation_;
    for (const Member& m : members) w.nodes.push_back(m.allocation.node);
    w.allocation = members[rank].allocation;
    DEEPNEX_ASSIGN_OR_RETURN(members[rank].handle, e->o_.start(w));
    std::lock_guard<std::mutex> lock(e->mu_);
    e->all_.push_back(members[rank].handle);
  }
  {
    std::lock_guard<std::mutex> lock(e->mu_);
    e->members_ = std::move(members);
  }
  e->thread_ = std::thread([p = e.get()] { p->Loop(); });
  return e;
}

Elastic::~Elastic() { Stop(); }

void Elastic::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

absl::Status Elastic::Publish(const std::vector<Member>& members) {
  std::vector<std::string> ids;
  for (const Member& m : members) ids.push_back(absl::StrCat("w", m.id));
  const int next = generation_ + 1;
  DEEPNEX_RETURN_IF_ERROR(
      store_->Set(absl::StrCat(kElasticMembersPrefix, next), absl::StrJoin(ids, ",")));
  DEEPNEX_RETURN_IF_ERROR(store_->Set(kElasticGenerationKey, absl::StrCat(next)));
  std::lock_guard<std::mutex> lock(mu_);
  generation_ = next;
  formed_ = Clock::now();
  first_report_.reset();
  return absl::OkStatus();
}

bool Elastic::Republish(const std::vector<Member>& members) {
  absl::Status published = Publish(members);
  if (!published.ok()) {
    o_.on_event(absl::StrCat("elastic: publishing the members failed: ", published.ToString()));
  }
  return published.ok();
}

milliseconds Elastic::BackoffLocked(bool healthy) {
  if (healthy) backoff_step_ = 0;
  const milliseconds delay = launch::RestartBackoff(o_.restart, o_.launcher, ++backoff_step_);
  next_start_ = Clock::now() + delay;
  return delay;
}

void Elastic::Loop() {
  for (;;) {
    Watch();
    bool grow;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      grow = !done_ && !failure_.has_value() &&
             static_cast<int>(members_.size()) < o_.max_workers && Clock::now() >= next_start_;
    }
    // Growth waits in the allocator's queue for a while (central), so it
    // also paces the loop; without it, the loop sleeps.
    if (grow) Grow();
    std::unique_lock<std::mutex> lock(mu_);
    if (cv_.wait_for(lock, o_.poll, [this] { return stopping_; })) return;
  }
}

std::string Elastic::Gone(const Member& m, const launch::ContainerStatus& st,
                          std::map<std::string, bool>* ready_now) {
  if (Ended(st)) {
    if (st.last_exit.has_value() && st.last_exit->ok()) return "";
    return absl::StrCat("worker w", m.id, " ",
                        st.last_exit.has_value() ? st.last_exit->ToString() : "stopped");
  }
  auto node = ready_now->find(m.allocation.node);
  if (node == ready_now->end()) return "";
  if (node->second) {
    not_ready_since_.erase(m.allocation.node);
    return "";
  }
  auto since = not_ready_since_.emplace(m.allocation.node, Clock::now()).first->second;
  if (Clock::now() - since < o_.not_ready_after) return "";
  return absl::StrCat("worker w", m.id, "'s node \"", m.allocation.node, "\" was NotReady for ",
                      o_.not_ready_after.count() / 1000.0, " s");
}

void Elastic::Watch() {
  std::map<std::string, bool> ready_now;
  if (o_.nodes) {
    absl::StatusOr<std::vector<gpu::NodeInfo>> nodes = o_.nodes();
    // Central unreachable: no node is judged until it answers again.
    if (nodes.ok()) {
      for (const gpu::NodeInfo& n : *nodes) ready_now[n.node.name] = n.ready;
    }
  }
  std::vector<Member> members;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.has_value()) return;
    members = members_;
  }
  bool all_done = true;
  for (size_t i = 0; i < members.size(); ++i) {
    const Member& m = members[i];
    const launch::ContainerStatus st = m.handle->Status();
    const std::string why = Gone(m, st, &ready_now);
    if (why.empty()) {
      const bool exited_ok = Ended(st) && st.last_exit.has_value() && st.last_exit->ok();
      if (exited_ok) {
        std::lock_guard<std::mutex> lock(mu_);
        done_ = true;
      }
      all_done = all_done && exited_ok;
      continue;
    }
    Drop(members, {i}, why,
         st.last_exit.value_or(launch::ExitStatus{launch::ExitReason::kLost}));
    return;  // the next look starts from the new members
  }
  if (!all_done && Reported(members)) return;
  std::lock_guard<std::mutex> lock(mu_);
  // None left (all replaced under the policy, the new ones still to come)
  // is not done.
  completed_ = all_done && !members.empty();
}

void Elastic::Drop(const std::vector<Member>& members, const std::vector<size_t>& gone,
                   const std::string& why, const launch::ExitStatus& exit) {
  std::vector<Member> left;
  bool ran_long = false;
  for (size_t i = 0; i < members.size(); ++i) {
    if (std::find(gone.begin(), gone.end(), i) == gone.end()) {
      left.push_back(members[i]);
      continue;
    }
    // As kubelet's: a worker that ran long enough was healthy, and its
    // failure starts the doubling over.
    ran_long = ran_long || Clock::now() - members[i].started >= o_.launcher.restart_backoff_reset;
  }
  const bool restart = o_.restart.kind != launch::RestartPolicy::Kind::kNever &&
                       (o_.restart.max_restarts < 0 || restarts_ < o_.restart.max_restarts);
  if (static_cast<int>(left.size()) < o_.min_workers && !restart) {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = exit;
    return;
  }
  // Reachable or not, they must not come back as members (a healed
  // partition, a stopped worker continued): stopped, and their allocations
  // go back.
  for (size_t i : gone) {
    if (!Ended(members[i].handle->Status())) members[i].handle->Stop(milliseconds(2000)).IgnoreError();
    o_.release(members[i].allocation);
  }
  // Below MIN the job does not train (as Horovod's min_np): the members
  // are left waiting for the next generation, which comes with the
  // replacement (Grow), and their reports wait for it too (Reported).
  const bool replace = static_cast<int>(left.size()) < o_.min_workers;
  if (!replace) Republish(left);
  milliseconds delay;
  int step;
  {
    std::lock_guard<std::mutex> lock(mu_);
    members_ = left;
    if (replace) ++restarts_;
    delay = BackoffLocked(ran_long);
    step = backoff_step_;
  }
  const std::string in = absl::StrCat(delay.count() / 1000.0, " s");
  if (replace) {
    o_.on_event(absl::StrCat(why, "; restarting (", restarts_, "/",
                             o_.restart.max_restarts < 0 ? std::string("unlimited")
                                                         : absl::StrCat(o_.restart.max_restarts),
                             ") in ", in, ": a new worker is asked for"));
  } else if (step > 1) {
    o_.on_event(absl::StrCat(why, "; ", step,
                             " workers in a row failed soon after their start: the job grows "
                             "again in ", in, " at the earliest (crash-loop backoff)"));
  }
  Resized(static_cast<int>(members.size()), static_cast<int>(left.size()), why, !replace);
}

bool Elastic::Reported(const std::vector<Member>& members) {
  int generation;
  {
    // Over: the members still running finish, or fail as such.
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return false;
    generation = generation_;
  }
  std::vector<std::string> keys;
  for (const Member& m : members) {
    keys.push_back(absl::StrCat(kElasticWaitingPrefix, generation, "/w", m.id));
  }
  keys.push_back(kElasticDoneKey);
  absl::StatusOr<std::vector<bool>> reported = store_->Check(keys);
  if (!reported.ok()) return false;  // the store is the runner's: a blip
  if (reported->back()) {
    // A joiner now would wait for peers that never form its generation.
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    return false;
  }
  // Below MIN: the members wait for the replacement's generation.
  if (static_cast<int>(members.size()) < o_.min_workers) return false;
  std::vector<size_t> silent;
  std::vector<std::string> reporters;
  for (size_t i = 0; i < members.size(); ++i) {
    if ((*reported)[i]) {
      reporters.push_back(absl::StrCat("w", members[i].id));
    } else {
      silent.push_back(i);
    }
  }
  if (reporters.empty()) return false;
  const Clock::time_point now = Clock::now();
  if (!first_report_.has_value()) first_report_ = now;
  if (silent.empty()) {
    // A failure that reached every member (the network between them): the
    // same members again, paced as failures are, so that one that keeps
    // recurring ends when the workers' wait for it does.
    if (now < next_start_) return false;
    bool healthy;
    {
      // Read before Publish forms the next generation.
      std::lock_guard<std::mutex> lock(mu_);
      healthy = now - formed_ >= o_.launcher.restart_backoff_reset;
    }
    const bool published = Republish(members);
    milliseconds delay;
    int step, formed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      delay = BackoffLocked(healthy);
      step = backoff_step_;
      formed = generation_;
    }
    if (published) {
      o_.on_event(absl::StrCat(
          "elastic: every member reported a failed collective in generation ", generation,
          "; they form generation ", formed, " again",
          step > 1 ? absl::StrCat("; ", step,
                                  " failures in a row soon after forming: the next re-form in ",
                                  delay.count() / 1000.0, " s at the earliest (crash-loop backoff)")
                   : ""));
    }
    return true;
  }
  if (now - *first_report_ < o_.stalled_after) return false;
  std::vector<std::string> names;
  for (size_t i : silent) names.push_back(absl::StrCat("w", members[i].id));
  Drop(members, silent,
       absl::StrCat("worker", names.size() > 1 ? "s " : " ", absl::StrJoin(names, ", "),
                    " stalled: no failed collective reported within ",
                    o_.stalled_after.count() / 1000.0, " s of ", absl::StrJoin(reporters, ", "),
                    "'s in generation ", generation),
       launch::ExitStatus{launch::ExitReason::kLost});
  return true;
}

void Elastic::Grow() {
  int size;
  {
    std::lock_guard<std::mutex> lock(mu_);
    size = static_cast<int>(members_.size());
  }
  // Below min_workers (a restart) the job cannot go on: normal priority.
  // Above, growth must not hold up anyone's normal work.
  absl::StatusOr<gpu::Allocation> a = o_.grant(size < o_.min_workers ? 0 : -1);
  if (!a.ok()) return;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, o_.settle, [this] { return stopping_; });
  }
  Watch();
  std::vector<Member> members;
  bool over;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Stopped, ended or failed while it waited in the queue; or a member
    // failed meanwhile, and its backoff comes first (probe: the start came
    // 0.2 s after "restarting (1/1) in 1 s").
    over = stopping_ || done_ || failure_.has_value() ||
           static_cast<int>(members_.size()) >= o_.max_workers || Clock::now() < next_start_;
    members = members_;
    size = static_cast<int>(members.size());
  }
  if (over) {
    o_.release(*a);
    return;
  }
  Member m{next_id_++, nullptr, *a};
  members.push_back(m);
  WorkerStart w;
  w.id = m.id;
  w.rank = static_cast<int>(members.size()) - 1;
  w.generation = generation_ + 1;
  for (const Member& x : members) w.nodes.push_back(x.allocation.node);
  w.allocation = *a;
  absl::StatusOr<std::shared_ptr<launch::Handle>> h = o_.start(w);
  if (!h.ok()) {
    o_.on_event(absl::StrCat("elastic: worker w", m.id, " did not start on node \"", a->node,
                             "\": ", h.status().ToString()));
    o_.release(*a);
    return;
  }
  members.back().handle = *h;
  {
    // A member before the workers can learn of it: one that prints its rank
    // is among the job's allocations (CI saw 1 of 2 just after w1's line).
    std::lock_guard<std::mutex> lock(mu_);
    all_.push_back(*h);
    members_ = members;
  }
  Republish(members);
  Resized(size, size + 1, absl::StrCat("worker w", m.id, " joined on node \"", a->node, "\""),
          true);
}

void Elastic::Resized(int from, int to, const std::string& why, bool published) {
  const std::string text = absl::StrCat("resized from ", from, " to ", to, ": ", why);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++resizes_;
    last_resize_ = text;
  }
  o_.on_event(absl::StrCat("job resized from ", from, " to ", to, " workers (",
                           published ? absl::StrCat("generation ", generation())
                                     : absl::StrCat("below MIN ", o_.min_workers,
                                                    ": the members wait for a replacement"),
                           "): ", why));
  if (o_.on_resize) o_.on_resize();
}

Elastic::Outcome Elastic::outcome() const {
  std::lock_guard<std::mutex> lock(mu_);
  Outcome out;
  out.failure = failure_;
  out.ended = completed_ || failure_.has_value();
  return out;
}

std::vector<std::shared_ptr<launch::Handle>> Elastic::Workers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return all_;
}

std::vector<gpu::Allocation> Elastic::Allocations() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<gpu::Allocation> out;
  for (const Member& m : members_) {
    if (!taken_) out.push_back(m.allocation);
  }
  return out;
}

std::vector<gpu::Allocation> Elastic::TakeAllocations() {
  Stop();
  std::vector<gpu::Allocation> out = Allocations();
  std::lock_guard<std::mutex> lock(mu_);
  taken_ = true;
  return out;
}

int Elastic::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(members_.size());
}

int Elastic::generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  return generation_;
}

int Elastic::resizes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return resizes_;
}

std::string Elastic::last_resize() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_resize_;
}

int Elastic::restarts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return restarts_;
}

}  // namespace deepnex::job
