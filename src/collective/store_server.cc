// The rendezvous store's server: a map of keys to bytes, guarded by one
// mutex, and waiting reads parked as callback-API reactors (no thread held
// per waiter) until their keys are set, their deadline passes or the client
// goes away.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/grpc_util.h"
#include "core/net.h"
#include "core/text.h"
#include "core/timer.h"
#include "deepnex/auth.h"
#include "deepnex/collective/store.h"
#include "deepnex/store.grpc.pb.h"
#include "deepnex/units.h"

namespace deepnex::collective {
namespace {

namespace pb = ::deepnex::collective::proto;
using Clock = std::chrono::steady_clock;

// A Get that waits for keys. Finished exactly once, by whichever of
// completion, expiry or cancellation claims it first.
struct Waiter {
  grpc::ServerUnaryReactor* reactor = nullptr;
  pb::GetReply* reply = nullptr;
  std::vector<std::string> keys;
  // keys[0..next) were there when last looked at; keys[next] is the one
  // watched. One key at a time, so that a rendezvous of n ranks (each
  // waiting for all n keys) costs O(n) per waiter, not O(n) per key set.
  size_t next = 0;
  bool values = true;
  int64_t wait_ms = 0;
  std::atomic<bool> finished{false};
  bool Claim() { return !finished.exchange(true); }
};

class WaiterReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit WaiterReactor(std::shared_ptr<Waiter> waiter) : waiter_(std::move(waiter)) {
    waiter_->reactor = this;
  }
  void OnCancel() override {
    if (waiter_->Claim()) Finish(grpc::Status(grpc::StatusCode::CANCELLED, "call cancelled"));
  }
  void OnDone() override { delete this; }

 private:
  std::shared_ptr<Waiter> waiter_;
};

// The first few keys, quoted, and how many more: an error names what is
// missing without outgrowing gRPC's limit on a status message.
std::string QuoteKeys(const std::vector<std::string>& keys) {
  constexpr size_t kShown = 8;
  std::vector<std::string> shown(keys.begin(), keys.begin() + std::min(keys.size(), kShown));
  std::string text = absl::StrCat("\"", absl::StrJoin(shown, "\", \""), "\"");
  if (keys.size() > kShown) absl::StrAppend(&text, " and ", keys.size() - kShown, " more");
  return text;
}

// The map and its handlers. Thread-safe: `mu_` guards the map and the
// watcher lists; reactors are finished outside it.
class Service final : public pb::Store::CallbackService {
 public:
  Service(const StoreServerOptions& options, TokenTable tokens)
      : options_(options),
        tokens_(std::move(tokens)) {}

  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return kv_.size();
  }

  size_t waiting() const {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = 0;
    // Each waiter is on the list of the one key it watches; a finished one
    // (cancelled by its client) until that key is set or it expires.
    for (const auto& [key, list] : watchers_) {
      for (const auto& w : list) n += !w->finished.load();
    }
    return n;
  }

  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* ctx, const pb::SetRequest* req,
                                pb::SetReply*) override {
    absl::Status s = CheckKeys(*ctx, {req->key()});
    if (s.ok()) s = CheckValue(req->key(), req->value());
    if (!s.ok()) return Reply(ctx, s);
    Finishes done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      s = PutLocked(req->key(), req->value());
      if (s.ok()) Notify(req->key(), &done);
    }
    RunFinishes(done);
    return Reply(ctx, s);
  }

  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* ctx, const pb::GetRequest* req,
                                pb::GetReply* reply) override {
    std::vector<std::string> keys(req->keys().begin(), req->keys().end());
    absl::Status s = CheckKeys(*ctx, keys);
    if (!s.ok()) return Reply(ctx, s);
    std::unique_lock<std::mutex> lock(mu_);
    std::vector<std::string> missing = Missing(keys);
    if (missing.empty()) {
      if (req->values()) {
        for (const std::string& k : keys) reply->add_values(kv_[k]);
      }
      lock.unlock();
      return Reply(ctx, absl::OkStatus());
    }
    if (req->wait_ms() <= 0) {
      lock.unlock();
      return Reply(ctx, absl::NotFoundError(absl::StrCat("no key ", QuoteKeys(missing))));
    }
    auto waiter = std::make_shared<Waiter>();
    waiter->reply = reply;
    waiter->keys = std::move(keys);
    waiter->values = req->values();
    waiter->wait_ms = req->wait_ms();
    auto* reactor = new WaiterReactor(waiter);
    WatchNext(waiter);
    lock.unlock();
    // Capped: a client's 2^62 ms overflowed into a deadline already past.
    expiry_.At(Clock::now() + CappedWait(std::chrono::milliseconds(req->wait_ms())),
               [this, weak = std::weak_ptr<Waiter>(waiter)] {
                 if (auto w = weak.lock()) Expire(w);
               });
    return reactor;
  }

  grpc::ServerUnaryReactor* Add(grpc::CallbackServerContext* ctx, const pb::AddRequest* req,
                                pb::AddReply* reply) override {
    absl::Status s = CheckKeys(*ctx, {req->key()});
    if (!s.ok()) return Reply(ctx, s);
    Finishes done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      int64_t value = 0, sum = 0;
      auto it = kv_.find(req->key());
      if (it != kv_.end() && !absl::SimpleAtoi(it->second, &value)) {
        s = absl::InvalidArgumentError(absl::StrCat(
            "add to \"", req->key(), "\": its value is not a decimal integer"));
      } else if (__builtin_add_overflow(value, req->delta(), &sum)) {
        s = absl::OutOfRangeError(absl::StrCat("add to \"", req->key(), "\": ", value, " + ",
                                               req->delta(),
                                               " is past the int64 range; the value stays ",
                                               value));
      } else if (s = PutLocked(req->key(), absl::StrCat(sum)); s.ok()) {
        reply->set_value(sum);
        Notify(req->key(), &done);
      }
    }
    RunFinishes(done);
    return Reply(ctx, s);
  }

  grpc::ServerUnaryReactor* CompareSet(grpc::CallbackServerContext* ctx,
                                       const pb::CompareSetRequest* req,
                                       pb::CompareSetReply* reply) override {
    absl::Status s = CheckKeys(*ctx, {req->key()});
    if (s.ok()) s = CheckValue(req->key(), req->desired());
    if (!s.ok()) return Reply(ctx, s);
    Finishes done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = kv_.find(req->key());
      bool swap = it == kv_.end() ? req->expected().empty() : it->second == req->expected();
      if (swap) {
        s = PutLocked(req->key(), req->desired());
        if (s.ok()) {
          Notify(req->key(), &done);
          reply->set_value(req->desired());
        }
      } else if (it != kv_.end()) {
        reply->set_value(it->second);
      }
      reply->set_swapped(swap && s.ok());
    }
    RunFinishes(done);
    return Reply(ctx, s);
  }

  grpc::ServerUnaryReactor* Delete(grpc::CallbackServerContext* ctx,
                                   const pb::DeleteRequest* req,
                                   pb::DeleteReply* reply) override {
    absl::Status s = CheckKeys(*ctx, {req->key()});
    if (s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = kv_.find(req->key());
      reply->set_deleted(it != kv_.end());
      if (it != kv_.end()) {
        bytes_ -= it->first.size() + it->second.size();
        kv_.erase(it);
      }
    }
    return Reply(ctx, s);
  }

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx, const pb::CheckRequest* req,
                                  pb::CheckReply* reply) override {
    std::vector<std::string> keys(req->keys().begin(), req->keys().end());
    absl::Status s = CheckKeys(*ctx, keys);
    if (s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      for (const std::string& k : keys) reply->add_present(kv_.count(k) > 0);
    }
    return Reply(ctx, s);
  }

 private:
  using Finishes = std::vector<std::pair<grpc::ServerUnaryReactor*, grpc::Status>>;

  static void RunFinishes(const Finishes& done) {
    for (const auto& [reactor, status] : done) reactor->Finish(status);
  }

  absl::Status CheckKeys(const grpc::ServerContextBase& ctx,
                         const std::vector<std::string>& keys) const {
    DEEPNEX_ASSIGN_OR_RETURN(Identity who, AuthenticateCall(tokens_, ctx));
    if (keys.empty()) return absl::InvalidArgumentError("no keys given");
    for (const std::string& k : keys) {
      if (k.empty()) return absl::InvalidArgumentError("empty key");
      if (k.size() > StoreServerOptions::kMaxKeyBytes) {
        return absl::InvalidArgumentError(absl::StrCat("key ", Quoted(k), " is ", k.size(),
                                                       " bytes; a key is at most ",
                                                       StoreServerOptions::kMaxKeyBytes));
      }
      if (!who.job.empty() && k.rfind(who.job + "/", 0) != 0) {
        return absl::PermissionDeniedError(absl::StrCat(
            "key \"", k, "\" is outside job \"", who.job, "\" (keys must start with \"",
            who.job, "/\")"));
      }
    }
    return absl::OkStatus();
  }

  absl::Status CheckValue(const std::string& key, const std::string& value) const {
    if (value.size() > options_.max_value_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("value of \"", key, "\": ", value.size(), " bytes, the store takes at most ",
                       options_.max_value_bytes));
    }
    return absl::OkStatus();
  }

  // kv_[key] = value, within options_.max_bytes. REQUIRES: mu_ held.
  absl::Status PutLocked(const std::string& key, std::string value) {
    auto it = kv_.find(key);
    const uint64_t before = it == kv_.end() ? 0 : key.size() + it->second.size();
    const uint64_t after = key.size() + value.size();
    if (after > before && bytes_ - before + after > options_.max_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "key ", Quoted(key), ": the store holds ", bytes_, " bytes of keys and values, at most ",
          options_.max_bytes, ", and this would add ", after - before,
          " (delete keys, or raise its max_bytes)"));
    }
    bytes_ = bytes_ - before + after;
    if (it == kv_.end()) {
      kv_.emplace(key, std::move(value));
    } else {
      it->second = std::move(value);
    }
    return absl::OkStatus();
  }

  // REQUIRES: mu_ held.
  std::vector<std::string> Missing(const std::vector<std::string>& keys) const {
    std::vector<std::string> missing;
    for (const std::string& k : keys) {
      if (kv_.count(k) == 0) missing.push_back(k);
    }
    return missing;
  }

  // Watches the first of `waiter`'s keys from its `next` on that is not
  // there; false when none is missing (a key passed earlier and deleted
  // since counts as missing). REQUIRES: mu_ held.
  bool WatchNext(const std::shared_ptr<Waiter>& waiter) {
    std::vector<std::string>& keys = waiter->keys;
    while (waiter->next < keys.size() && kv_.count(keys[waiter->next]) != 0) ++waiter->next;
    if (waiter->next == keys.size()) {
      waiter->next = 0;
      while (waiter->next < keys.size() && kv_.count(keys[waiter->next]) != 0) ++waiter->next;
      if (waiter->next == keys.size()) return false;
    }
    auto& list = watchers_[keys[waiter->next]];
    if (std::find(list.begin(), list.end(), waiter) == list.end()) list.push_back(waiter);
    return true;
  }

  // `key` was written: waiters watching it complete if nothing else is
  // missing, else watch what is. REQUIRES: mu_ held.
  void Notify(const std::string& key, Finishes* done) {
    auto it = watchers_.find(key);
    if (it == watchers_.end()) return;
    std::vector<std::shared_ptr<Waiter>> list = std::move(it->second);
    watchers_.erase(it);
    for (auto& w : list) {
      if (w->finished.load() || WatchNext(w)) continue;
      if (!w->Claim()) continue;
      if (w->values) {
        for (const std::string& k : w->keys) w->reply->add_values(kv_[k]);
      }
      done->push_back({w->reactor, grpc::Status::OK});
    }
  }

  void Expire(const std::shared_ptr<Waiter>& w) {
    grpc::Status status;
    bool finish = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (w->next < w->keys.size()) {  // the one key it watches
        auto it = watchers_.find(w->keys[w->next]);
        if (it != watchers_.end()) {
          auto& list = it->second;
          list.erase(std::remove(list.begin(), list.end(), w), list.end());
          if (list.empty()) watchers_.erase(it);
        }
      }
      if (w->Claim()) {
        finish = true;
        status = grpc::Status(
            grpc::StatusCode::DEADLINE_EXCEEDED,
            absl::StrCat("waited ", w->wait_ms, " ms; still missing: ", QuoteKeys(Missing(w->keys))));
      }
    }
    if (finish) w->reactor->Finish(status);
  }

  const StoreServerOptions options_;
  const TokenTable tokens_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::string> kv_;
  uint64_t bytes_ = 0;  // of kv_'s keys and values
  std::unordered_map<std::string, std::vector<std::shared_ptr<Waiter>>> watchers_;
  Timer expiry_;  // last: its thread calls Expire, so it stops first
};

class StoreServerImpl final : public StoreServer {
 public:
  StoreServerImpl(const StoreServerOptions& options, TokenTable tokens)
      : service_(options, std::move(tokens)) {}
  ~StoreServerImpl() override { Stop(); }

  absl::Status Start(const StoreServerOptions& options) {
    ServerHostOptions host;
    host.what = "store server";
    host.address = options.address;
    host.advertise = options.advertise;
    host.tls_cert_file = options.tls_cert_file;
    host.tls_key_file = options.tls_key_file;
    host.max_receive_bytes = options.max_value_bytes + (1 << 20);
    DEEPNEX_ASSIGN_OR_RETURN(host_, ServerHost::Start(host, {&service_}));
    return absl::OkStatus();
  }

  std::string address() const override { return host_->address(); }
  int port() const override { return host_->port(); }
  size_t size() const override { return service_.size(); }
  size_t waiting() const override { return service_.waiting(); }
  void Stop() override {
    if (host_) host_->Stop();
  }
  void Wait() override { host_->Wait(); }

 private:
  Service service_;
  std::unique_ptr<ServerHost> host_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StoreServer>> StoreServer::Create(
    const StoreServerOptions& options) {
  if (options.address.empty()) return absl::InvalidArgumentError("address is empty");
  if (options.max_bytes == 0) return absl::InvalidArgumentError("max_bytes: 0 holds nothing");
  DEEPNEX_RETURN_IF_ERROR(ValidateAdvertiseHost("advertise", options.advertise));
  DEEPNEX_ASSIGN_OR_RETURN(TokenTable tokens,
                           TokenTable::FromOptions(options.token, options.token_file));
  auto server = std::make_unique<StoreServerImpl>(options, std::move(tokens));
  DEEPNEX_RETURN_IF_ERROR(server->Start(options));
  return std::unique_ptr<StoreServer>(std::move(server));
}

}  // namespace deepnex::collective
