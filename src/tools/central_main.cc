// deepnex-central: the GPU allocator as a service for many users, as a daemon.
#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/file_util.h"
#include "deepnex/gpu/central.h"
#include "deepnex/gpu/discovery.h"
#include "deepnex/launch/central.h"
#include "deepnex/units.h"
#include "notify/notifier.h"
#include "tools/daemon.h"

namespace {

constexpr char kUsage[] = R"(usage: deepnex-central [flags]

Serves a GPU allocator (exclusive and shared nodes, quotas, queue, gangs,
leases) and a launcher (users start, list, stop and read the logs of their
own containers on their allocations; an allocation is released when the
last container on it ends for good) over gRPC. Prints "deepnex-central
listening on HOST:PORT" once it serves; stops on SIGINT/SIGTERM, stopping
every container it runs.

flags:
  --listen HOST:PORT      address to listen on; port 0 picks a free one
                          (default 127.0.0.1:0)
  --advertise HOST        the host peers dial, printed in "listening on"
                          (default: the --listen host; for 0.0.0.0 or [::],
                          this host's primary address)
  --state-dir D           keep the allocator's crash-safe ledger in D; without
                          it, state lives in memory only
  --no-fsync              do not fsync the ledger (survives a process crash,
                          not a machine crash)
  --reservation-after SECS  how long the head of the queue waits before the
                          capacity it needs is reserved and requests behind
                          it no longer backfill it; 0 reserves at once
                          (default 300)
  --nodes F               add the nodes declared in the JSON file F that the
                          allocator does not have yet
  --local                 add this machine (GPUs found through NVML) as a node
  --token T               the administrator's bearer token
  --token-file F          lines "TOKEN NAME ROLE [JOB]" (ROLE user|admin|node);
                          a token with a JOB reaches only that job's
                          allocations and containers; a node token is a
                          deepnex-agent's and acts only as node NAME
  --tls-cert F --tls-key F   serve TLS with this PEM certificate and key
  --metrics-listen HOST:PORT  serve Prometheus text at GET /metrics (plain HTTP;
                          with tokens, to an admin's: "Authorization: Bearer
                          TOKEN"; a user reads their own with `deepnex metrics`)
  --backend B             the launcher's backend: process (default), oci,
                          docker, slurm or kubernetes (engine options as the
                          launcher's defaults)
  --launch-backend B      the same as --backend (its former name)
  --launch-state-dir D    the launcher's logs and records (for `deepnex ps
                          --state-dir D`); default: a temporary directory.
                          Containers that a crashed deepnex-central left
                          there are stopped, and their allocations released,
                          at start
  --allow-mount DIR       users may mount host paths under DIR into their
                          containers (repeatable; symlinks are resolved before
                          the check); without it, no mounts at all
  --user NAME=UID:GID     run NAME's containers as UID:GID, with no
                          capabilities (repeatable; never 0). A user with no
                          mapping can allocate but not start containers
  --users-file F          the same from F: lines "NAME UID GID" or
                          "NAME UID:GID", # comments
  --image NAME=DIR        users may run image NAME: DIR is a rootfs directory
                          or an OCI image layout, or "host" for the host's
                          /usr and /opt (repeatable); users give only these
                          names, never a path. The process backend always
                          takes "host"
  --registry HOST:PORT     the site's OCI registry (plain HTTP, e.g. Debian's
                          docker-registry): OCI image layouts registered as
                          images (`deepnex image register`) are pushed there,
                          and each node pulls them on first use
  --ended-containers N    ended containers kept per user, with their logs,
                          for ps and logs; older ones are removed (default 100)
  --allow-host-network USER  USER's oci containers may use the host's network
                          (repeatable; "*": everyone's); otherwise each gets a
                          private network with only its own loopback
  --node-timeout S        a node whose deepnex-agent has not been heard from
                          for S seconds is NotReady: no new grants on it
                          (default 10)
  --node-lost-after S     after S seconds of silence its containers count as
                          lost and their allocations are released
                          (default 300)
  --notify USER=URL       POST USER's job events (queued, started,
                          worker_restarted, resized, completed, failed,
                          cancelled) to URL as JSON, besides each job's own
                          `deepnex run --notify URL` (repeatable)
  --notify-file F         the same from F: lines "USER URL", # comments
  --notify-admin URL      POST node events (node.not_ready, node.lost,
                          node.ready) to URL (repeatable)
  --notify-secret-file F  lines "USER SECRET": each POST of USER's events
                          carries X-Deepnex-Signature: sha256=<hex HMAC-SHA256
                          of the body> under USER's secret; node events are
                          signed with the secret of user "admin"
  --notify-allow-private  a job's own `deepnex run --notify URL` may reach
                          loopback, private and link-local addresses too
                          (default: public addresses only, so that users
                          cannot make central POST to the services around
                          it; the URLs above, an admin's, go anywhere)
  --notify-max-age S      drop an event that no receiver took within S
                          seconds (default 0: retry forever, backing off from
                          0.5s to 30s). Undelivered events wait in
                          D/notify of --state-dir across restarts
  --job-history-age S     keep ended jobs' records (`deepnex jobs --all`) for S
                          seconds (default 2592000: 30 days)
  --job-history-count N   and at most N of them (default 10000)
  --job-history-bytes SIZE
                          and at most SIZE of them (default 256MiB); past
                          either, the user who holds the most loses their
                          oldest first
  --job-runner-timeout S  a job whose `deepnex run` has not reported for S
                          seconds fails as lost (default 60)
  --job-lost-release-after S
                          a lost job's allocations are held S seconds for its
                          runner (one cut off comes back); then it is
                          cancelled and they are released (default 600; 0:
                          held until `deepnex job cancel`)
  --help                  show this text
)";

// Central's node and job events on their way to the notifier; node events
// that come before its outbox is open wait here. A job event's caller waits
// for the outbox instead: the job store records the event as sent when
// Publish returns, so it must be durable by then.
//
// A node event goes out only when it changes what the admins were last told
// of that node, kept in `nodes_file` across restarts: a restarted central's
// hub starts its agents' nodes Ready (a node still down turns NotReady
// again) and says "ready" at each registration.
class EventSink {
 public:
  // `nodes_file` empty: what the admins were told is kept in memory only.
  explicit EventSink(std::string nodes_file) : nodes_file_(std::move(nodes_file)) {}

  // A node's event is reported here when it fails; a job's failure is the
  // answer, so that the job store keeps the event to tell again.
  absl::Status Publish(deepnex::notify::Event event, bool wait_open) {
    std::unique_lock<std::mutex> lock(mu_);
    if (wait_open) opened_cv_.wait(lock, [this] { return opened_; });
    if (!opened_) {
      held_.push_back(std::move(event));
      return absl::OkStatus();
    }
    if (notifier_ == nullptr) {
      return absl::UnavailableError("deepnex-central is exiting: it failed to start");
    }
    lock.unlock();
    if (!event.node.empty()) {
      PublishNode(std::move(event));
      return absl::OkStatus();
    }
    return notifier_->Publish(std::move(event));
  }

  // The notifier's series ("" until it is open, or when it failed to).
  std::string MetricsText() {
    std::lock_guard<std::mutex> lock(mu_);
    return notifier_ != nullptr ? notifier_->MetricsText() : "";
  }

  // `notifier` null: central failed to start; events are dropped.
  void Open(deepnex::notify::Notifier* notifier) {
    std::lock_guard<std::mutex> lock(mu_);
    notifier_ = notifier;
    if (notifier != nullptr) {
      LoadNodes();
      for (auto& e : held_) PublishNode(std::move(e));
    }
    held_.clear();
    opened_ = true;
    opened_cv_.notify_all();
  }

 private:
  static void Report(const absl::Status& s) {
    if (!s.ok()) std::cerr << "deepnex-central: " << s.message() << "\n";
  }

  // What the admins were last told of a node, and how many events.
  struct Told {
    std::string state;  // "ready", "not_ready", "lost"; "": nothing yet
    uint64_t seq = 0;
  };

  void PublishNode(deepnex::notify::Event event) {
    std::lock_guard<std::mutex> lock(nodes_mu_);
    Told& told = nodes_[event.node];
    const std::string state = event.kind.substr(sizeof("node.") - 1);
    // "ready" is news only after a not_ready or lost; not_ready after lost
    // is none either.
    if (state == told.state || (state == "ready" && told.state.empty()) ||
        (state == "not_ready" && told.state == "lost")) {
      return;
    }
    // The same id if central dies before recording it and tells it again.
    event.id = absl::StrCat("node/", event.node, "/", told.seq + 1);
    absl::Status published = notifier_->Publish(std::move(event));
    // Not saved (the outbox's disk full): never sent, so not told either;
    // recorded as told, the node's next change was judged against it (a
    // "ready" went out after a "not_ready" nobody got).
    if (!published.ok()) return Report(published);
    told = {state, told.seq + 1};
    if (nodes_file_.empty()) return;
    std::string text;
    for (const auto& [node, t] : nodes_) {
      if (!t.state.empty()) absl::StrAppend(&text, node, " ", t.state, " ", t.seq, "\n");
    }
    Report(deepnex::WriteFileAtomically(nodes_file_, text));
  }

  void LoadNodes() {
    if (nodes_file_.empty() || !std::filesystem::exists(nodes_file_)) return;
    auto text = deepnex::ReadWholeFile(nodes_file_, "notified node states");
    if (!text.ok()) return Report(text.status());
    std::lock_guard<std::mutex> lock(nodes_mu_);
    for (absl::string_view line : absl::StrSplit(*text, '\n', absl::SkipEmpty())) {
      std::vector<std::string> f = absl::StrSplit(line, ' ');
      uint64_t seq = 0;
      if (f.size() != 3 || !absl::SimpleAtoi(f[2], &seq)) {
        Report(absl::DataLossError(absl::StrCat(nodes_file_, ": bad line \"", line, "\"")));
        continue;
      }
      nodes_[f[0]] = {f[1], seq};
    }
  }

  std::mutex mu_;
  std::condition_variable opened_cv_;
  bool opened_ = false;
  deepnex::notify::Notifier* notifier_ = nullptr;  // set once, with opened_
  std::vector<deepnex::notify::Event> held_;
  const std::string nodes_file_;
  std::mutex nodes_mu_;  // publishes node events one at a time, in order
  std::map<std::string, Told> nodes_;
};

}  // namespace

int main(int argc, char** argv) {
  deepnex::gpu::CentralServerOptions options;
  deepnex::launch::LauncherOptions launcher;
  deepnex::launch::ContainerPolicy policy;
  std::vector<std::string> users_files;
  std::string nodes_file;
  bool local = false;
  deepnex::notify::NotifierOptions notify;
  deepnex::tools::Flags flags("deepnex-central", kUsage, argc, argv);
  while (flags.Next()) {
    if (flags.Is("--listen")) options.address = flags.Value();
    else if (flags.Is("--advertise")) options.advertise = flags.Value();
    else if (flags.Is("--state-dir")) options.allocator.state_dir = flags.Value();
    else if (flags.Is("--no-fsync")) options.allocator.fsync = false;
    else if (flags.Is("--reservation-after")) {
      options.allocator.reservation_after =
          flags.OrDie(deepnex::SecondsToMillis(flags.Number(), flags.flag(), /*zero_ok=*/true));
    }    else if (flags.Is("--nodes")) nodes_file = flags.Value();
    else if (flags.Is("--local")) local = true;
    else if (flags.Is("--token")) options.token = flags.Value();
    else if (flags.Is("--token-file")) options.token_file = flags.Value();
    else if (flags.Is("--tls-cert")) options.tls_cert_file = flags.Value();
    else if (flags.Is("--tls-key")) options.tls_key_file = flags.Value();
    else if (flags.Is("--metrics-listen")) options.metrics_address = flags.Value();
    else if (flags.Is("--backend") || flags.Is("--launch-backend"))
      launcher.backend = flags.Value();
    else if (flags.Is("--launch-state-dir")) launcher.state_dir = flags.Value();
    else if (flags.Is("--allow-mount")) launcher.allowed_mount_roots.push_back(flags.Value());
    else if (flags.Is("--user")) {
      absl::Status added = deepnex::launch::AddUserMapping(flags.Value(), &policy.users);
      if (!added.ok()) flags.Die("--user: " + std::string(added.message()));
    } else if (flags.Is("--users-file")) {
      users_files.push_back(flags.Value());
    } else if (flags.Is("--image")) {
      absl::Status added =
          deepnex::launch::AddImageMapping("--image", flags.Value(), &launcher.images);
      if (!added.ok()) flags.Die(std::string(added.message()));
    } else if (flags.Is("--registry")) {
      policy.registry = flags.Value();
      const size_t colon = policy.registry.rfind(':');
      if (colon == std::string::npos || colon == 0 ||
          policy.registry.find('/') != std::string::npos) {
        flags.Die("--registry \"" + policy.registry + "\": expected HOST:PORT");
      }
    } else if (flags.Is("--allow-host-network")) {
      policy.host_network_users.insert(flags.Value());
    } else if (flags.Is("--node-timeout")) {
      options.node_timeout = flags.Seconds();
    } else if (flags.Is("--node-lost-after")) {
      options.node_lost_after = flags.Seconds();
    } else if (flags.Is("--notify")) {
      absl::Status added = deepnex::notify::AddUserUrl(flags.Value(), &notify);
      if (!added.ok()) flags.Die("--notify " + std::string(added.message()));
    } else if (flags.Is("--notify-file")) {
      absl::Status added = deepnex::notify::LoadUrlsFile(flags.Value(), &notify);
      if (!added.ok()) flags.Die("--notify-file: " + std::string(added.message()));
    } else if (flags.Is("--notify-admin")) {
      const std::string url = flags.Value();
      absl::Status ok = deepnex::notify::CheckUrl(url);
      if (!ok.ok()) flags.Die("--notify-admin " + std::string(ok.message()));
      notify.admin_urls.push_back(url);
    } else if (flags.Is("--notify-secret-file")) {
      absl::Status added = deepnex::notify::LoadSecretsFile(flags.Value(), &notify);
      if (!added.ok()) flags.Die("--notify-secret-file: " + std::string(added.message()));
    } else if (flags.Is("--notify-allow-private")) {
      notify.allow_private_job_urls = true;
    } else if (flags.Is("--notify-max-age")) {
      notify.max_age = flags.Seconds();
    } else if (flags.Is("--job-history-age")) {
      options.job_history.max_age = flags.Seconds();
    } else if (flags.Is("--job-runner-timeout")) {
      options.job_history.runner_timeout = flags.Seconds();
    } else if (flags.Is("--job-lost-release-after")) {
      options.job_history.lost_release_after = flags.Seconds();
    } else if (flags.Is("--ended-containers")) {
      const std::string flag = flags.flag();
      const int n = flags.Int();
      if (n < 1) flags.Die(absl::StrCat(flag, ": ", n, " is below 1"));
      policy.ended_kept_per_user = static_cast<size_t>(n);
    } else if (flags.Is("--job-history-count")) {
      const std::string flag = flags.flag();
      const int n = flags.Int();
      if (n < 0) flags.Die(absl::StrCat(flag, ": ", n, " is below 0"));
      options.job_history.max_count = n;
    } else if (flags.Is("--job-history-bytes")) {
      options.job_history.max_bytes = flags.Bytes();
    } else {
      flags.Unknown();
    }
  }
  for (const std::string& file : users_files) {
    auto users = deepnex::launch::LoadUsersFile(file);
    if (!users.ok()) flags.Die(std::string(users.status().message()));
    for (auto& [name, r] : *users) {
      if (!policy.users.emplace(name, r).second) {
        flags.Die("--users-file " + file + ": user " + name + " is mapped twice");
      }
    }
  }
  if (options.address.empty()) flags.Die("--listen is empty");
  for (std::string& dir : launcher.allowed_mount_roots) {
    // Fixed now: a relative one would follow the cwd; a typo would allow nothing.
    char real[PATH_MAX];
    if (realpath(dir.c_str(), real) == nullptr || !std::filesystem::is_directory(real)) {
      flags.Die("--allow-mount \"" + dir + "\": not a directory");
    }
    dir = real;
  }
  std::vector<deepnex::gpu::Node> nodes;
  if (!nodes_file.empty()) {
    auto parsed = deepnex::gpu::LoadNodesFile(nodes_file);
    if (!parsed.ok()) {
      std::cerr << "deepnex-central: " << parsed.status().message() << "\n";
      return 1;
    }
    nodes = std::move(*parsed);
  }
  if (local) {
    std::cerr << "deepnex-central: local GPUs: " << deepnex::gpu::DiscoverLocalGpus().summary
              << "\n";
    auto node = deepnex::gpu::LocalNode();
    if (!node.ok()) {
      std::cerr << "deepnex-central: " << node.status().message() << "\n";
      return 1;
    }
    nodes.push_back(std::move(*node));
  }

  // The notifier's outbox opens after the server has locked the allocator's
  // state directory (a second central on it is refused naming that
  // directory, not the outbox inside it); events before then wait in `sink`.
  if (!options.allocator.state_dir.empty()) {
    notify.state_dir = options.allocator.state_dir + "/notify";
    notify.fsync = options.allocator.fsync;
  }
  EventSink sink(options.allocator.state_dir.empty()
                     ? ""
                     : options.allocator.state_dir + "/notify-nodes");
  options.on_node_state = [&sink](const std::string& node, const std::string& state,
                                  const std::string& why) {
    deepnex::notify::Event event;
    event.kind = "node." + state;
    event.node = node;
    event.data = {{"reason", why}};
    sink.Publish(std::move(event), /*wait_open=*/false).IgnoreError();
  };
  options.check_job_notify_url = [notify](const std::string& user, const std::string& url) {
    return deepnex::notify::CheckJobUrl(notify, user, url);
  };
  options.more_metrics = [&sink] { return sink.MetricsText(); };
  options.on_job_event = [&sink](const deepnex::gpu::JobEvent& e) {
    deepnex::notify::Event event;
    event.id = e.id;
    event.kind = "job." + e.kind;  // "worker restarted": job.worker_restarted
    std::replace(event.kind.begin(), event.kind.end(), ' ', '_');
    event.user = e.job.user;
    event.job = e.job.name;
    event.urls = e.job.notify;
    event.data = {{"state", deepnex::gpu::JobStateName(e.job.state)},
                  {"nodes", e.job.nodes},
                  {"workers", e.job.workers},
                  {"restarts", e.job.restarts},
                  {"exit_code", e.job.exit_code},
                  {"message", e.job.message},
                  {"cancelled_by", e.job.cancelled_by}};
    if (e.kind == "resized") {
      event.data["from"] = e.resized_from;
      event.data["why"] = e.reason;
    }
    if (e.kind == "progress") {
      event.data["reason"] = e.reason;  // "every" or "when"
      event.data["report"] = {
          {"step", e.job.report.step},
          {"metrics", e.job.report.metrics},
          {"time_ms", std::chrono::duration_cast<std::chrono::milliseconds>(
                          e.job.report.time.time_since_epoch()).count()}};
      if (e.reason == "when") event.data["when"] = e.job.notify_when;
    }
    return sink.Publish(std::move(event), /*wait_open=*/true);
  };

  // Declared before the server, which publishes to it until it is gone.
  std::unique_ptr<deepnex::notify::Notifier> notifier;
  deepnex::tools::SignalStop signals;
  std::vector<std::string> swept;
  // As root it runs other users' containers: never without their limits.
  // Otherwise they all run as this user, who may lack cgroups.
  launcher.require_cgroups = geteuid() == 0;
  auto server = deepnex::launch::CreateCentralServer(options, launcher, policy, &swept);
  if (!server.ok()) {
    std::cerr << "deepnex-central: " << server.status().message() << "\n";
    return 1;
  }
  for (const auto& line : swept) std::cerr << "deepnex-central: " << line << "\n";
  auto created = deepnex::notify::Notifier::Create(notify);
  if (!created.ok()) {
    std::cerr << "deepnex-central: " << created.status().message() << "\n";
    sink.Open(nullptr);  // lets the job store's threads end
    return 1;
  }
  notifier = std::move(*created);
  sink.Open(notifier.get());
  for (const auto& n : nodes) {
    if ((*server)->allocator().GetNode(n.name).ok()) continue;  // kept in the ledger
    absl::Status s = (*server)->allocator().AddNode(n);
    if (!s.ok()) {
      std::cerr << "deepnex-central: " << s.message() << "\n";
      return 1;
    }
  }
  if ((*server)->metrics_port() != 0) {
    std::cerr << "deepnex-central: metrics at http://"
              << options.metrics_address.substr(0, options.metrics_address.rfind(':')) << ":"
              << (*server)->metrics_port() << "/metrics\n";
  }
  std::printf("deepnex-central listening on %s\n", (*server)->address().c_str());
  std::fflush(stdout);
  signals.Serve(**server);
  notifier->Shutdown();
  return 0;
}
