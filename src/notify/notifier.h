// deepnex-central's webhook notifications: job and node events POSTed as
// JSON to the URLs that users and admins gave, signed, retried, and kept in
// a crash-safe outbox until a receiver takes them. Private to libdeepnex.
//
// Who gets an event:
//   job.*   the job's own URLs (Event::urls, from `deepnex run --notify URL`)
//           and its user's defaults (NotifierOptions::user_urls)
//   node.*  the admins' URLs (NotifierOptions::admin_urls)
//
// Each POST carries the event as JSON (Event::ToJson) and the headers
//   X-Deepnex-Event-Id: <id>        the same on every retry: deduplicate by it
//   X-Deepnex-Signature: sha256=<hex HMAC-SHA256 of the body>
// signed with the secret of the event's user (node events: of
// NotifierOptions::admin_user); a user without a secret gets no signature.
//
// Delivery is at-least-once: Publish returns once the event is fsync'd in
// the outbox (a gpu::Ledger in state_dir), and it leaves the outbox only
// after a 2xx. A connection error, a timeout, a 5xx, 408 or 429 is retried
// with exponential backoff (retry_initial doubling to retry_max), forever or
// until the event is max_age old; any other answer drops it with a log
// line, as Publish does an event of a user who has
// max_waiting_bytes_per_user waiting already. Events of one job (of one
// node) reach one URL in the order they were published: one is in flight
// per job and URL, and a failed one is retried before the next is sent.
#ifndef DEEPNEX_NOTIFY_NOTIFIER_H_
#define DEEPNEX_NOTIFY_NOTIFIER_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "deepnex/status.h"

namespace deepnex::gpu {
class Ledger;
}
namespace deepnex::launch {
class HttpCancel;
class HttpClient;
}

namespace deepnex::notify {

// The kinds Publish takes.
inline constexpr const char* kJobQueued = "job.queued";
inline constexpr const char* kJobStarted = "job.started";
inline constexpr const char* kJobWorkerRestarted = "job.worker_restarted";
// An elastic job grew or shrank: data "from", "workers" (now) and "why".
inline constexpr const char* kJobResized = "job.resized";
inline constexpr const char* kJobCompleted = "job.completed";
inline constexpr const char* kJobFailed = "job.failed";
inline constexpr const char* kJobCancelled = "job.cancelled";
// The job's last deepnex.report(): every `deepnex run --notify-every`
// minutes, and once when `--notify-when` first holds.
inline constexpr const char* kJobProgress = "job.progress";
inline constexpr const char* kNodeNotReady = "node.not_ready";
inline constexpr const char* kNodeLost = "node.lost";
inline constexpr const char* kNodeReady = "node.ready";

struct Event {
  // Unique: receivers deduplicate by it. Empty: Publish makes one.
  std::string id;
  // One of the kinds above.
  std::string kind;
  // The job's user (job events); empty for node events.
  std::string user;
  // The job's name (job events).
  std::string job;
  // The node (node events).
  std::string node;
  // Milliseconds since the epoch. 0: Publish's time.
  int64_t time_ms = 0;
  // What else the event says (exit code, worker, reason, ...): an object.
  nlohmann::json data = nlohmann::json::object();
  // The job's own URLs (`deepnex run --notify URL`), besides its user's
  // defaults. Not part of the body.
  std::vector<std::string> urls;

  // The body POSTed: {"id", "kind", "user", "job", "node", "time" (RFC 3339,
  // UTC, ms), "time_ms", "data"}.
  nlohmann::json ToJson() const;
};

struct NotifierOptions {
  // The outbox's directory (a gpu::Ledger). Empty: in memory only, so
  // events not yet delivered are lost with the process.
  std::string state_dir;
  // fsync the outbox before Publish returns.
  bool fsync = true;
  // Per user: the URLs that get every event of that user's jobs.
  std::map<std::string, std::vector<std::string>> user_urls;
  // The URLs that get node events.
  std::vector<std::string> admin_urls;
  // Per user: the HMAC-SHA256 key of the signature header.
  std::map<std::string, std::string> secrets;
  // Whose secret signs node events. Default: "admin"
  std::string admin_user = "admin";
  // Backoff of retries: the first wait, doubling up to the longest.
  // Defaults: 0.5s, 30s
  std::chrono::milliseconds retry_initial{500};
  std::chrono::milliseconds retry_max{30000};
  // An event older than this is dropped instead of retried (with a log
  // line). 0: retried forever. Default: 0
  std::chrono::milliseconds max_age{0};
  // The longest each POST may take, connecting and reading the answer
  // included (of which the first 64 KiB are read). Default: 10s
  std::chrono::milliseconds timeout{10000};
  // Bytes of event bodies of one user (node events: admin_user's) that may
  // wait for their receivers; Publish drops an event to a URL past it, with
  // a log line (NotifierStats::dropped). Without it a URL that never took
  // an event (retried forever) kept every later event of its user's jobs,
  // in memory and in the outbox, for as long as central ran. Default: 64 MiB
  uint64_t max_waiting_bytes_per_user = 64 << 20;
  // POSTs in flight at once (to different jobs or URLs); one that comes
  // free goes to the user with the fewest in flight. Default: 4
  int threads = 4;
  // A job's own URLs (Event::urls, which any user may give) reach only
  // public addresses: a loopback, private, link-local (cloud metadata) or
  // other non-public address (NonPublicAddress) is refused at connect time
  // and the event dropped with a log line, so that no user can make central
  // POST to the services beside it. The admins' URLs (user_urls,
  // admin_urls) go anywhere. True: job URLs too (deepnex-central
  // --notify-allow-private). Default: false
  bool allow_private_job_urls = false;
};

// What a Notifier has done since it was created.
// As deepnex_notify_* Prometheus series (MetricsText).
struct NotifierStats {
  uint64_t published = 0;  // deliveries (event x URL) added
  uint64_t delivered = 0;  // 2xx
  uint64_t retried = 0;    // attempts that failed and will be retried
  uint64_t dropped = 0;    // refused by the receiver or too old
  uint64_t pending = 0;    // in the outbox now
  uint64_t recovered = 0;  // found in the outbox at Create
};

// Thread-safe: Publish may be called from any thread, also while the
// caller holds its own locks (it takes only the notifier's and the
// outbox's).
class Notifier {
 public:
  // Opens the outbox (its undelivered events are sent again) and starts the
  // delivery threads. InvalidArgument naming the URL for a bad one,
  // FailedPrecondition when another process holds the outbox.
  static absl::StatusOr<std::unique_ptr<Notifier>> Create(const NotifierOptions& options);
  ~Notifier();
  Notifier(const Notifier&) = delete;
  Notifier& operator=(const Notifier&) = delete;

  // Adds `event` to the outbox for each of its URLs and returns once that is
  // durable; OK and nothing sent when it has no URL. InvalidArgument for an
  // unknown kind, a job event without user or job, a node event without
  // node, or a bad URL in event.urls (naming it).
  absl::Status Publish(Event event);
  // Stops the delivery threads (POSTs in flight are abandoned, to be sent
  // again by the next Notifier on this outbox). Idempotent.
  void Shutdown();
  NotifierStats stats() const;
  // stats() as Prometheus text: deepnex_notify_deliveries_total{outcome=
  // published|delivered|retried|dropped} and deepnex_notify_pending, for
  // an admin's alert on receivers that fail.
  std::string MetricsText() const;

 private:
  // One event to one URL.
  struct Delivery {
    uint64_t seq = 0;     // in the outbox, in publishing order
    uint64_t ticket = 0;  // the outbox's for its record; 0: durable already
    std::string group;    // "job:USER/JOB" or "node:NODE": ordered within
    std::string url;
    std::string signer;  // whose secret signs it: a job event's user, else admin_user
    std::string event_id;
    int64_t time_ms = 0;
    std::string body;
  };
  // The deliveries to one URL for one job (or node), oldest first.
  struct Queue {
    std::deque<Delivery> items;
    bool in_flight = false;
    int failures = 0;  // of the head, in a row
    std::chrono::steady_clock::time_point next_try;
  };

  explicit Notifier(const NotifierOptions& options);
  // Opens the outbox and queues what it holds.
  absl::Status Open();
  void EnqueueLocked(Delivery d);
  // Under mu_: `d`, queued, leaves the queues.
  void ForgetLocked(const Delivery& d);
  // Under mu_: takes the head off `q`, records it done in the outbox and
  // compacts the outbox when it has grown.
  void FinishLocked(Queue& q);
  // The client that POSTs `d`: a job event's to a URL its user's admin did
  // not give reaches only public addresses, unless allow_private_job_urls.
  absl::StatusOr<std::unique_ptr<launch::HttpClient>> Client(const Delivery& d) const;
  // A delivery thread.
  void Work();

  const NotifierOptions options_;
  std::unique_ptr<gpu::Ledger> outbox_;
  std::unique_ptr<launch::HttpCancel> cancel_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Queue> queues_;  // by URL and job/node
  std::map<std::string, int> busy_;      // POSTs in flight, by Delivery::signer
  std::map<std::string, uint64_t> waiting_bytes_;  // of queued bodies, by Delivery::signer
  uint64_t next_seq_ = 1;
  NotifierStats stats_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

// "sha256=" and the hex HMAC-SHA256 of `body` under `secret`.
std::string Sign(const std::string& secret, const std::string& body);

// InvalidArgument, naming `url`, unless it is http:// or https:// with a
// host.
absl::Status CheckUrl(const std::string& url);

// OK when a job may give `url` as its own (Event::urls): CheckUrl, then,
// unless `options` allow private job URLs or an admin gave this URL to
// `user`'s events (NotifierOptions::user_urls; not another user's, nor the
// node events' admin_urls), every
// address its host resolves to now is public. PermissionDenied naming the
// URL, the address and what it is otherwise (InvalidArgument when the host
// does not resolve). What deepnex-central checks as a job registers;
// deliveries check again, the address they connect to.
absl::Status CheckJobUrl(const NotifierOptions& options, const std::string& user,
                         const std::string& url);

// Flags and files of deepnex-central. Each error names the flag or the
// file and line, and the value:
//   AddUserUrl: "USER=URL" (--notify)
//   LoadUrlsFile: lines "USER URL" (--notify-file)
//   LoadSecretsFile: lines "USER SECRET", one per user (--notify-secret-file)
// '#' starts a comment; blank lines are skipped.
absl::Status AddUserUrl(const std::string& spec, NotifierOptions* options);
absl::Status LoadUrlsFile(const std::string& path, NotifierOptions* options);
absl::Status LoadSecretsFile(const std::string& path, NotifierOptions* options);

}  // namespace deepnex::notify

#endif  // DEEPNEX_NOTIFY_NOTIFIER_H_
