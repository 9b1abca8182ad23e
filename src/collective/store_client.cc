// The rendezvous store's client: blocking unary calls with a deadline each.
// Create connects first, retrying for up to kConnectTimeout, so ranks may
// start a little before the store does while a wrong address fails fast;
// later calls wait for a lost connection (wait_for_ready) within their
// deadline.
#include "absl/strings/str_cat.h"
#include "core/grpc_util.h"
#include "core/text.h"
#include "deepnex/collective/store.h"
#include "deepnex/store.grpc.pb.h"
#include "deepnex/units.h"

namespace deepnex::collective {
namespace {

namespace pb = ::deepnex::collective::proto;
using Clock = std::chrono::system_clock;

// gRPC's own deadline trails a server-side wait by this much, so that the
// store's answer (naming the missing keys) arrives first.
constexpr std::chrono::milliseconds kWaitGrace{1000};

class StoreClientImpl final : public StoreClient {
 public:
  StoreClientImpl(const StoreClientOptions& options, std::string token)
      : options_(options), token_(std::move(token)) {}

  absl::Status Connect() {
    DEEPNEX_ASSIGN_OR_RETURN(auto credentials, MakeChannelCredentials(options_.tls_ca_file));
    DEEPNEX_ASSIGN_OR_RETURN(auto channel, Dial("store", options_.address, credentials,
                                                std::min(options_.timeout, kConnectTimeout)));
    stub_ = pb::Store::NewStub(channel);
    return absl::OkStatus();
  }

  absl::Status Set(const std::string& key, const std::string& value) override {
    DEEPNEX_RETURN_IF_ERROR(CheckKeys("set", {key}));
    pb::SetRequest req;
    req.set_key(Full(key));
    req.set_value(value);
    pb::SetReply reply;
    return Call("set", options_.timeout, [&](grpc::ClientContext* ctx) {
      return stub_->Set(ctx, req, &reply);
    });
  }

  absl::StatusOr<std::string> Get(const std::string& key) override {
    return Get(key, options_.timeout);
  }

  absl::StatusOr<std::string> Get(const std::string& key,
                                  std::chrono::milliseconds timeout) override {
    DEEPNEX_ASSIGN_OR_RETURN(auto values, MultiGet({key}, timeout));
    return std::move(values[0]);
  }

  absl::StatusOr<std::vector<std::string>> MultiGet(const std::vector<std::string>& keys,
                                                    std::chrono::milliseconds timeout) override {
    pb::GetReply reply;
    DEEPNEX_RETURN_IF_ERROR(DoGet("get", keys, timeout, true, &reply));
    if (reply.values_size() != static_cast<int>(keys.size())) {
      return absl::InternalError(absl::StrCat("get: the store sent ", reply.values_size(),
                                              " values for ", keys.size(), " keys"));
    }
    return std::vector<std::string>(reply.values().begin(), reply.values().end());
  }

  absl::Status Wait(const std::vector<std::string>& keys,
                    std::chrono::milliseconds timeout) override {
    pb::GetReply reply;
    return DoGet("wait", keys, timeout, false, &reply);
  }

  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    DEEPNEX_RETURN_IF_ERROR(CheckKeys("add", {key}));
    pb::AddRequest req;
    req.set_key(Full(key));
    req.set_delta(delta);
    pb::AddReply reply;
    DEEPNEX_RETURN_IF_ERROR(Call("add", options_.timeout, [&](grpc::ClientContext* ctx) {
      return stub_->Add(ctx, req, &reply);
    }));
    return reply.value();
  }

  absl::StatusOr<std::string> CompareSet(const std::string& key, const std::string& expected,
                                         const std::string& desired) override {
    DEEPNEX_RETURN_IF_ERROR(CheckKeys("compare_set", {key}));
    pb::CompareSetRequest req;
    req.set_key(Full(key));
    req.set_expected(expected);
    req.set_desired(desired);
    pb::CompareSetReply reply;
    DEEPNEX_RETURN_IF_ERROR(Call("compare_set", options_.timeout, [&](grpc::ClientContext* ctx) {
      return stub_->CompareSet(ctx, req, &reply);
    }));
    return reply.value();
  }

  absl::StatusOr<bool> Delete(const std::string& key) override {
    DEEPNEX_RETURN_IF_ERROR(CheckKeys("delete", {key}));
    pb::DeleteRequest req;
    req.set_key(Full(key));
    pb::DeleteReply reply;
    DEEPNEX_RETURN_IF_ERROR(Call("delete", options_.timeout, [&](grpc::ClientContext* ctx) {
      return stub_->Delete(ctx, req, &reply);
    }));
    return reply.deleted();
  }

  absl::StatusOr<std::vector<bool>> Check(const std::vector<std::string>& keys) override {
    return Check(keys, options_.timeout);
  }

  absl::StatusOr<std::vector<bool>> Check(const std::vector<std::string>& keys,
                                          std::chrono::milliseconds timeout) override {
    DEEPNEX_RETURN_IF_ERROR(CheckKeys("check", keys));
    pb::CheckRequest req;
    for (const std::string& k : keys) req.add_keys(Full(k));
    pb::CheckReply reply;
    DEEPNEX_RETURN_IF_ERROR(Call("check", timeout, [&](grpc::ClientContext* ctx) {
      return stub_->Check(ctx, req, &reply);
    }));
    return std::vector<bool>(reply.present().begin(), reply.present().end());
  }

  const std::string& address() const override { return options_.address; }
  const std::string& prefix() const override { return options_.prefix; }

 private:
  // Keys travel as proto strings, which must be UTF-8: one that was not
  // came back UNIMPLEMENTED with no message, after libprotobuf's log line
  // (probe).
  static absl::Status CheckKeys(const char* what, const std::vector<std::string>& keys) {
    for (const std::string& k : keys) {
      if (!IsUtf8(k)) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": key ", Quoted(k), " is not UTF-8 text"));
      }
    }
    return absl::OkStatus();
  }

  std::string Full(const std::string& key) const {
    return options_.prefix.empty() ? key : absl::StrCat(options_.prefix, "/", key);
  }

  absl::Status DoGet(const char* what, const std::vector<std::string>& keys,
                     std::chrono::milliseconds timeout, bool values, pb::GetReply* reply) {
    if (keys.empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": no keys given"));
    DEEPNEX_RETURN_IF_ERROR(CheckKeys(what, keys));
    timeout = CappedWait(timeout);
    pb::GetRequest req;
    for (const std::string& k : keys) req.add_keys(Full(k));
    req.set_wait_ms(std::max<int64_t>(timeout.count(), 1));
    req.set_values(values);
    return Call(what, timeout + kWaitGrace, [&](grpc::ClientContext* ctx) {
      return stub_->Get(ctx, req, reply);
    });
  }

  template <typename Fn>
  absl::Status Call(const char* what, std::chrono::milliseconds timeout, Fn&& fn) {
    DEEPNEX_RETURN_IF_ERROR(CheckForkSafe("store client"));
    grpc::ClientContext ctx;
    ctx.set_deadline(Clock::now() + CappedWait(timeout));
    ctx.set_wait_for_ready(true);
    if (!token_.empty()) ctx.AddMetadata(kAuthorizationKey, BearerValue(token_));
    grpc::Status s = fn(&ctx);
    if (s.ok()) return absl::OkStatus();
    absl::Status status = ToAbslStatus(s);
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
        (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
         s.error_message() == "Deadline Exceeded")) {
      return absl::Status(status.code(),
                          absl::StrCat("store ", what, " at ", options_.address,
                                       ": no answer within ", timeout.count(), " ms (",
                                       status.message(), ")"));
    }
    return absl::Status(status.code(), absl::StrCat("store ", what, ": ", status.message()));
  }

  const StoreClientOptions options_;
  const std::string token_;
  std::unique_ptr<pb::Store::Stub> stub_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StoreClient>> StoreClient::Create(
    const StoreClientOptions& options) {
  DEEPNEX_RETURN_IF_ERROR(CheckMillis(options.timeout, "timeout"));
  if (!IsUtf8(options.prefix)) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix ", Quoted(options.prefix), " is not UTF-8 text"));
  }
  DEEPNEX_ASSIGN_OR_RETURN(std::string token,
                           ResolveClientToken(options.token, options.token_file));
  auto client = std::make_unique<StoreClientImpl>(options, std::move(token));
  DEEPNEX_RETURN_IF_ERROR(client->Connect());
  return std::unique_ptr<StoreClient>(std::move(client));
}

}  // namespace deepnex::collective
