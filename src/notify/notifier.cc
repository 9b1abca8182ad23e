#include "notify/notifier.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <netdb.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <filesystem>
#include <iostream>
#include <optional>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/file_util.h"
#include "core/net.h"
#include "deepnex/metrics.h"
#include "gpu/ledger.h"
#include "launch/http.h"

namespace deepnex::notify {
namespace {

using Clock = std::chrono::steady_clock;

// Outbox records grow to this many before they are compacted into a
// snapshot of the deliveries still pending.
constexpr uint64_t kCompactAfter = 1024;

// What is read of a receiver's answer: its status decides, and its start
// names the reason in a log line.
constexpr uint64_t kMaxAnswerBytes = 64 << 10;

const std::set<std::string>& Kinds() {
  static const auto* const kinds = new std::set<std::string>{
      kJobQueued, kJobStarted, kJobWorkerRestarted, kJobResized, kJobCompleted, kJobFailed,
      kJobCancelled, kJobProgress, kNodeNotReady, kNodeLost, kNodeReady};
  return *kinds;
}

std::string Hex(const unsigned char* data, size_t n) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out += kHex[data[i] >> 4];
    out += kHex[data[i] & 15];
  }
  return out;
}

std::string NewId() {
  unsigned char bytes[16];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) {
    // No entropy: the time and a counter still make ids unique here.
    static std::atomic<uint64_t> counter{0};
    return absl::StrCat(absl::ToUnixNanos(absl::Now()), "-", counter++);
  }
  return Hex(bytes, sizeof(bytes));
}

// A retry is due for these; any other answer drops the event.
bool Retryable(int http_status) {
  return http_status >= 500 || http_status == 408 || http_status == 429;
}

// `url` as a log line shows it: its scheme, host and port. A webhook's path
// is often its secret (Slack's, Discord's, Teams'), and central's log has
// more readers than the user who gave it.
std::string Shown(const std::string& url) {
  const size_t authority = url.find("://") + 3;  // CheckUrl passed it
  const size_t path = url.find_first_of("/?#", authority);
  std::string shown = url.substr(0, path);
  if (const size_t at = shown.find('@', authority); at != std::string::npos) {
    shown.erase(authority, at + 1 - authority);  // user:password@
  }
  return path == std::string::npos ? shown : shown + "/...";
}

// `message`, an HTTP client's or PublicOnly's that names `url`, with `url`
// Shown (the client names it without its trailing slashes).
std::string ShownIn(const std::string& message, const std::string& url) {
  const size_t end = url.find_last_not_of('/');
  return absl::StrReplaceAll(message, {{url.substr(0, end + 1), Shown(url)}});
}

std::string AddRecord(uint64_t seq, const std::string& group, const std::string& url,
                      const std::string& signer, const std::string& id, int64_t time_ms,
                      const std::string& body) {
  return nlohmann::json{{"op", "add"},     {"seq", seq},         {"group", group},
                        {"url", url},      {"signer", signer},   {"id", id},
                        {"time_ms", time_ms}, {"body", body}}
      .dump();
}

}  // namespace

nlohmann::json Event::ToJson() const {
  return nlohmann::json{
      {"id", id},
      {"kind", kind},
      {"user", user},
      {"job", job},
      {"node", node},
      {"time", absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::FromUnixMillis(time_ms),
                                absl::UTCTimeZone())},
      {"time_ms", time_ms},
      {"data", data},
  };
}

std::string Sign(const std::string& secret, const std::string& body) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(body.data()), body.size(), mac, &length);
  return "sha256=" + Hex(mac, length);
}

absl::Status CheckUrl(const std::string& url) {
  if (!absl::StartsWith(url, "http://") && !absl::StartsWith(url, "https://")) {
    return absl::InvalidArgumentError(
        absl::StrCat("URL \"", url, "\" is not http://HOST[:PORT][/PATH] or https://..."));
  }
  launch::HttpClientOptions o;
  o.endpoint = url;
  absl::StatusOr<std::unique_ptr<launch::HttpClient>> client = launch::HttpClient::Create(o);
  if (!client.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("URL \"", url, "\": ", client.status().message()));
  }
  return absl::OkStatus();
}

namespace {

// An admin gave `url` to every event of `user`'s jobs. Only that user's
// jobs may name it as their own to reach a private address: another user's
// default, or the node events' URL, took that user's events to the service
// behind it.
bool AdminGiven(const NotifierOptions& options, const std::string& user, const std::string& url) {
  auto it = options.user_urls.find(user);
  return it != options.user_urls.end() &&
         std::find(it->second.begin(), it->second.end(), url) != it->second.end();
}

// OK for a public address; else PermissionDenied naming `url` and `addr`.
absl::Status PublicOnly(const std::string& url, const sockaddr* addr) {
  const std::string why = NonPublicAddress(addr);
  if (why.empty()) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "notify URL \"", url, "\": ", AddressText(addr), " is ", why,
      "; deepnex-central posts a job's own webhooks only to public addresses (its "
      "--notify-allow-private lets them reach others)"));
}

}  // namespace

absl::Status CheckJobUrl(const NotifierOptions& options, const std::string& user,
                         const std::string& url) {
  DEEPNEX_RETURN_IF_ERROR(CheckUrl(url));
  if (options.allow_private_job_urls || AdminGiven(options, user, url)) return absl::OkStatus();
  launch::HttpClientOptions o;
  o.endpoint = url;
  DEEPNEX_ASSIGN_OR_RETURN(std::unique_ptr<launch::HttpClient> client,
                           launch::HttpClient::Create(o));
  std::string host = client->host();
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), nullptr, &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("notify URL \"", url, "\": host \"", host, "\": ", gai_strerror(rc)));
  }
  absl::Status allowed;
  for (addrinfo* a = found; a != nullptr && allowed.ok(); a = a->ai_next) {
    allowed = PublicOnly(url, a->ai_addr);
  }
  freeaddrinfo(found);
  return allowed;
}

absl::Status AddUserUrl(const std::string& spec, NotifierOptions* options) {
  const size_t eq = spec.find('=');
  const std::string user = spec.substr(0, eq);
  if (eq == std::string::npos || user.empty() ||
      user.find_first_of(" \t") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("\"", spec, "\" is not USER=URL"));
  }
  const std::string url = spec.substr(eq + 1);
  absl::Status ok = CheckUrl(url);
  if (!ok.ok()) return absl::InvalidArgumentError(absl::StrCat("\"", spec, "\": ", ok.message()));
  options->user_urls[user].push_back(url);
  return absl::OkStatus();
}

namespace {

// Calls `line` with the fields of each line of `path` that is not blank or
// a comment, and its number.
absl::Status ForEachLine(
    const std::string& path, const std::string& what,
    const std::function<absl::Status(const std::vector<std::string>&, int)>& line) {
  DEEPNEX_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path, what));
  int number = 0;
  for (absl::string_view l : absl::StrSplit(text, '\n')) {
    ++number;
    l = absl::StripAsciiWhitespace(l.substr(0, l.find('#')));
    if (l.empty()) continue;
    DEEPNEX_RETURN_IF_ERROR(
        line(absl::StrSplit(l, absl::ByAnyChar(" \t"), absl::SkipEmpty()), number));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LoadUrlsFile(const std::string& path, NotifierOptions* options) {
  return ForEachLine(path, "notify file",
                     [&](const std::vector<std::string>& f, int number) -> absl::Status {
                       absl::Status ok = f.size() == 2 ? CheckUrl(f[1])
                                                       : absl::InvalidArgumentError(absl::StrCat(
                                                             f.size(), " fields"));
                       if (!ok.ok()) {
                         return absl::InvalidArgumentError(absl::StrCat(
                             "notify file ", path, " line ", number,
                             ": expected \"USER URL\": ", ok.message()));
                       }
                       options->user_urls[f[0]].push_back(f[1]);
                       return absl::OkStatus();
                     });
}

absl::Status LoadSecretsFile(const std::string& path, NotifierOptions* options) {
  std::map<std::string, int> seen;
  // The secret itself never appears in a message.
  return ForEachLine(path, "notify secret file",
                     [&](const std::vector<std::string>& f, int number) -> absl::Status {
                       const std::string where =
                           absl::StrCat("notify secret file ", path, " line ", number);
                       if (f.size() != 2) {
                         return absl::InvalidArgumentError(absl::StrCat(
                             where, ": expected \"USER SECRET\", got ", f.size(), " fields"));
                       }
                       if (auto [it, fresh] = seen.emplace(f[0], number); !fresh) {
                         return absl::InvalidArgumentError(absl::StrCat(
                             where, ": user ", f[0], " has a secret on line ", it->second));
                       }
                       options->secrets[f[0]] = f[1];
                       return absl::OkStatus();
                     });
}

Notifier::Notifier(const NotifierOptions& options)
    : options_(options), cancel_(std::make_unique<launch::HttpCancel>()) {}

absl::StatusOr<std::unique_ptr<Notifier>> Notifier::Create(const NotifierOptions& options) {
  for (const auto& [user, urls] : options.user_urls) {
    for (const std::string& url : urls) {
      absl::Status ok = CheckUrl(url);
      if (!ok.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("notify URL of ", user, ": ", ok.message()));
      }
    }
  }
  for (const std::string& url : options.admin_urls) {
    absl::Status ok = CheckUrl(url);
    if (!ok.ok()) return absl::InvalidArgumentError(absl::StrCat("admin notify ", ok.message()));
  }
  if (options.threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("notifier threads: ", options.threads, " is not at least 1"));
  }
  std::unique_ptr<Notifier> n(new Notifier(options));
  DEEPNEX_RETURN_IF_ERROR(n->Open());
  for (int i = 0; i < options.threads; ++i) n->workers_.emplace_back([p = n.get()] { p->Work(); });
  return n;
}

absl::Status Notifier::Open() {
  if (options_.state_dir.empty()) return absl::OkStatus();
  std::error_code ec;
  std::filesystem::create_directories(options_.state_dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("notify outbox ", options_.state_dir, ": ", ec.message()));
  }
  gpu::LedgerOptions lo;
  lo.fsync = options_.fsync;
  std::map<uint64_t, Delivery> pending;
  auto apply = [&](const std::string& record) -> absl::Status {
    nlohmann::json j = nlohmann::json::parse(record, nullptr, /*allow_exceptions=*/false);
    const std::string op = launch::JsonValue<std::string>(j, "op", "");
    const uint64_t seq = launch::JsonValue<uint64_t>(j, "seq", 0);
    if (seq == 0 || (op != "add" && op != "done")) {
      return absl::DataLossError(absl::StrCat("notify outbox ", options_.state_dir,
                                              ": not an outbox record: ", record.substr(0, 200)));
    }
    next_seq_ = std::max(next_seq_, seq + 1);
    if (op == "done") {
      pending.erase(seq);
      return absl::OkStatus();
    }
    Delivery& d = pending[seq];
    d.seq = seq;
    d.group = launch::JsonValue<std::string>(j, "group", "");
    d.url = launch::JsonValue<std::string>(j, "url", "");
    d.signer = launch::JsonValue<std::string>(j, "signer", "");
    d.event_id = launch::JsonValue<std::string>(j, "id", "");
    d.time_ms = launch::JsonValue<int64_t>(j, "time_ms", 0);
    d.body = launch::JsonValue<std::string>(j, "body", "");
    return absl::OkStatus();
  };
  DEEPNEX_ASSIGN_OR_RETURN(outbox_, gpu::Ledger::Open(options_.state_dir, lo, apply));
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = pending.begin(); it != pending.end();) {
    Delivery& d = it->second;
    absl::Status ok = CheckUrl(d.url);
    if (ok.ok()) {
      ++it;
      continue;
    }
    // A URL a stricter check refuses now (one libcurl never took): the
    // event could never go, and central must still start.
    std::cerr << "notify: event " << d.event_id << " to " << Shown(d.url)
              << " in the outbox is dropped: " << ShownIn(std::string(ok.message()), d.url)
              << "\n";
    outbox_->Append(nlohmann::json{{"op", "done"}, {"seq", d.seq}}.dump());
    ++stats_.dropped;
    it = pending.erase(it);
  }
  for (auto& [seq, d] : pending) EnqueueLocked(std::move(d));
  stats_.recovered = pending.size();
  if (!pending.empty()) {
    std::cerr << "notify: " << pending.size() << " undelivered event(s) in the outbox "
              << options_.state_dir << " are sent again\n";
  }
  return absl::OkStatus();
}

Notifier::~Notifier() { Shutdown(); }

void Notifier::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cancel_->Cancel();
  cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

NotifierStats Notifier::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  NotifierStats s = stats_;
  s.pending = 0;
  for (const auto& [key, q] : queues_) s.pending += q.items.size();
  return s;
}

std::string Notifier::MetricsText() const {
  const NotifierStats s = stats();
  MetricsRegistry r;
  const char* help = "Webhook deliveries (an event to a URL) by outcome.";
  for (const auto& [outcome, n] : {std::pair<const char*, uint64_t>{"published", s.published},
                                   {"delivered", s.delivered},
                                   {"retried", s.retried},
                                   {"dropped", s.dropped}}) {
    r.GetCounter("deepnex_notify_deliveries_total", help, {{"outcome", outcome}})->Add(n);
  }
  r.GetGauge("deepnex_notify_pending", "Webhook deliveries waiting in the outbox.")
      ->Set(static_cast<double>(s.pending));
  return r.PrometheusText();
}

void Notifier::EnqueueLocked(Delivery d) {
  waiting_bytes_[d.signer] += d.body.size();
  Queue& q = queues_[d.url + "\n" + d.group];
  q.items.push_back(std::move(d));
  cv_.notify_all();
}

absl::Status Notifier::Publish(Event event) {
  if (Kinds().count(event.kind) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("notify: event kind \"", event.kind, "\" is not one of ",
                     absl::StrJoin(Kinds(), ", ")));
  }
  const bool node_event = absl::StartsWith(event.kind, "node.");
  if (node_event ? event.node.empty() : (event.user.empty() || event.job.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "notify: a ", event.kind, " event needs ", node_event ? "a node" : "a user and a job"));
  }
  if (!event.data.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("notify: the data of a ", event.kind, " event is not a JSON object"));
  }
  for (const std::string& url : event.urls) {
    absl::Status ok = CheckUrl(url);
    if (!ok.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("notify URL of job ", event.job, ": ", ok.message()));
    }
  }
  if (event.id.empty()) event.id = NewId();
  if (event.time_ms == 0) event.time_ms = absl::ToUnixMillis(absl::Now());

  // Each URL once, the job's own first.
  std::vector<std::string> urls;
  auto add = [&urls](const std::vector<std::string>& more) {
    for (const std::string& u : more) {
      if (std::find(urls.begin(), urls.end(), u) == urls.end()) urls.push_back(u);
    }
  };
  if (node_event) {
    add(options_.admin_urls);
  } else {
    add(event.urls);
    if (auto it = options_.user_urls.find(event.user); it != options_.user_urls.end()) {
      add(it->second);
    }
  }
  if (urls.empty()) return absl::OkStatus();

  const std::string body = event.ToJson().dump();
  const std::string group =
      node_event ? "node:" + event.node : absl::StrCat("job:", event.user, "/", event.job);
  const std::string signer = node_event ? options_.admin_user : event.user;
  std::vector<uint64_t> seqs;
  uint64_t ticket = 0;
  {
    // Queued at once, in publishing order, but sent only once durable:
    // another Publish of the same job may reach the disk first.
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("notify: the notifier is shut down");
    for (const std::string& url : urls) {
      auto waiting = waiting_bytes_.find(signer);
      if (waiting != waiting_bytes_.end() &&
          waiting->second + body.size() > options_.max_waiting_bytes_per_user) {
        ++stats_.dropped;
        std::cerr << "notify: event " << event.id << " to " << Shown(url)
                  << " dropped: the events of "
                  << signer << " waiting for their receivers hold " << waiting->second
                  << " bytes; at most " << options_.max_waiting_bytes_per_user << "\n";
        continue;
      }
      Delivery d;
      d.seq = next_seq_++;
      d.group = group;
      d.url = url;
      d.signer = signer;
      d.event_id = event.id;
      d.time_ms = event.time_ms;
      d.body = body;
      if (outbox_ != nullptr) {
        d.ticket = outbox_->Append(
            AddRecord(d.seq, group, url, signer, event.id, event.time_ms, body));
        ticket = d.ticket;
      }
      seqs.push_back(d.seq);
      EnqueueLocked(std::move(d));
      ++stats_.published;
    }
  }
  if (outbox_ == nullptr || seqs.empty()) return absl::OkStatus();
  absl::Status synced = outbox_->Sync(ticket);
  std::lock_guard<std::mutex> lock(mu_);
  if (!synced.ok()) {
    // Lost with the write: never sent, and the caller hears of it.
    for (auto& [key, q] : queues_) {
      q.items.erase(std::remove_if(q.items.begin(), q.items.end(),
                                   [&](const Delivery& d) {
                                     if (std::find(seqs.begin(), seqs.end(), d.seq) ==
                                         seqs.end()) {
                                       return false;
                                     }
                                     ForgetLocked(d);
                                     return true;
                                   }),
                    q.items.end());
    }
    stats_.published -= seqs.size();
    // What is queued now was all made durable, so nothing is replayed; the
    // outbox only takes records again. Without this, one full disk failed
    // every later event, after it had room again, until a restart.
    if (outbox_->failed()) {
      absl::Status recovered = outbox_->Recover([](const std::string&) { return absl::OkStatus(); });
      if (!recovered.ok()) std::cerr << "notify outbox: " << recovered.message() << "\n";
    }
    return absl::Status(synced.code(),
                        absl::StrCat("notify outbox: event ", event.id, ": ", synced.message()));
  }
  cv_.notify_all();
  return absl::OkStatus();
}

void Notifier::ForgetLocked(const Delivery& d) {
  auto it = waiting_bytes_.find(d.signer);
  it->second -= d.body.size();
  if (it->second == 0) waiting_bytes_.erase(it);
}

void Notifier::FinishLocked(Queue& q) {
  const uint64_t seq = q.items.front().seq;
  ForgetLocked(q.items.front());
  q.items.pop_front();
  q.failures = 0;
  if (outbox_ == nullptr) return;
  // Not waited for: a "done" lost to a crash only sends the event again.
  outbox_->WhenDurable(outbox_->Append(nlohmann::json{{"op", "done"}, {"seq", seq}}.dump()),
                       [](absl::Status) {});
  if (outbox_->records_since_snapshot() < kCompactAfter) return;
  std::vector<std::pair<uint64_t, std::string>> records;
  for (const auto& [key, other] : queues_) {
    for (const Delivery& d : other.items) {
      records.emplace_back(
          d.seq, AddRecord(d.seq, d.group, d.url, d.signer, d.event_id, d.time_ms, d.body));
    }
  }
  // In publishing order, so that a restart queues each job's events as
  // they were.
  std::sort(records.begin(), records.end());
  std::vector<std::string> snapshot;
  for (auto& [seq, r] : records) snapshot.push_back(std::move(r));
  absl::Status s = outbox_->Snapshot(snapshot);
  if (!s.ok()) std::cerr << "notify: compacting the outbox: " << s.message() << "\n";
}

absl::StatusOr<std::unique_ptr<launch::HttpClient>> Notifier::Client(const Delivery& d) const {
  launch::HttpClientOptions o;
  o.endpoint = d.url;
  o.connect_timeout = options_.timeout;
  o.read_timeout = options_.timeout;
  o.total_timeout = options_.timeout;
  o.max_body_bytes = kMaxAnswerBytes;
  // A job event's signer is its user.
  if (absl::StartsWith(d.group, "job:") && !options_.allow_private_job_urls &&
      !AdminGiven(options_, d.signer, d.url)) {
    o.allow_address = [url = d.url](const sockaddr* addr) { return PublicOnly(url, addr); };
  }
  return launch::HttpClient::Create(o);
}

void Notifier::Work() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    // Of the queues whose head may go now, one of the user (signer) with the
    // fewest POSTs in flight; else the earliest retry. The first in key
    // order gave a user whose URLs hang (or are many) every thread that
    // came free, as long as one of theirs was due, and other users' events
    // waited on them.
    const auto now = Clock::now();
    auto ready = queues_.end();
    int ready_busy = 0;  // its user's POSTs in flight
    std::optional<Clock::time_point> next;
    for (auto it = queues_.begin(); it != queues_.end(); ++it) {
      const Queue& q = it->second;
      if (q.in_flight || q.items.empty()) continue;
      const Delivery& head = q.items.front();
      if (head.ticket != 0 && !outbox_->durable(head.ticket)) continue;
      if (q.next_try <= now) {
        auto b = busy_.find(head.signer);
        const int busy = b == busy_.end() ? 0 : b->second;
        if (ready == queues_.end() || busy < ready_busy) {
          ready = it;
          ready_busy = busy;
        }
        continue;
      }
      if (!next || q.next_try < *next) next = q.next_try;
    }
    if (ready == queues_.end()) {
      if (next) {
        cv_.wait_until(lock, *next);
      } else {
        cv_.wait(lock);
      }
      continue;
    }
    // No one else erases or sends from a queue in flight.
    Queue& q = ready->second;
    q.in_flight = true;
    const Delivery d = q.items.front();
    ++busy_[d.signer];
    std::vector<std::string> headers = {"X-Deepnex-Event-Id: " + d.event_id};
    if (auto it = options_.secrets.find(d.signer); it != options_.secrets.end()) {
      headers.push_back("X-Deepnex-Signature: " + Sign(it->second, d.body));
    }
    lock.unlock();
    absl::StatusOr<std::unique_ptr<launch::HttpClient>> client = Client(d);
    const int64_t age_ms = absl::ToUnixMillis(absl::Now()) - d.time_ms;
    std::string drop;  // why it is dropped
    absl::Status failed;
    if (options_.max_age.count() > 0 && age_ms > options_.max_age.count()) {
      drop = absl::StrFormat("it is %.1fs old, over the limit of %.1fs", age_ms / 1000.0,
                             options_.max_age.count() / 1000.0);
    } else if (!client.ok()) {
      drop = std::string(client.status().message());
    } else {
      absl::StatusOr<launch::HttpResponse> r =
          (*client)->Send("POST", "", d.body, headers, cancel_.get());
      if (absl::IsPermissionDenied(r.status())) {
        drop = std::string(r.status().message());  // an address a job may not reach
      } else if (!r.ok()) {
        failed = r.status();
      } else if (Retryable(r->status)) {
        failed = (*client)->ErrorFor("POST", "", *r);
      } else if (r->status < 200 || r->status >= 300) {
        drop = std::string((*client)->ErrorFor("POST", "", *r).message());
      }
    }
    lock.lock();
    q.in_flight = false;
    if (--busy_[d.signer] == 0) busy_.erase(d.signer);
    // Shutting down: what was in flight stays in the outbox for the next
    // notifier.
    if (stopping_) break;
    if (!failed.ok()) {
      ++q.failures;
      ++stats_.retried;
      auto wait = options_.retry_initial;
      for (int i = 1; i < q.failures && wait < options_.retry_max; ++i) wait *= 2;
      wait = std::min(wait, options_.retry_max);
      q.next_try = Clock::now() + wait;
      std::cerr << "notify: event " << d.event_id << " to " << Shown(d.url) << ": "
                << ShownIn(std::string(failed.message()), d.url) << "; retry " << q.failures << " in " << wait.count() << " ms\n";
      continue;
    }
    if (!drop.empty()) {
      ++stats_.dropped;
      std::cerr << "notify: event " << d.event_id << " to " << Shown(d.url)
                << " dropped: " << ShownIn(drop, d.url) << "\n";
    } else {
      ++stats_.delivered;
    }
    FinishLocked(q);
    if (q.items.empty()) queues_.erase(ready);
  }
}

}  // namespace deepnex::notify
