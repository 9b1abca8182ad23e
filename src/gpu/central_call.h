// How the clients of deepnex-central's services beside the allocator's (the
// launcher's Containers, the Jobs) reach it: one channel, and every call with
// the client's token and deadline, riding out a reconnect to a restarted
// central. Private to libdeepnex.
#ifndef DEEPNEX_GPU_CENTRAL_CALL_H_
#define DEEPNEX_GPU_CENTRAL_CALL_H_

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/grpc_util.h"
#include "deepnex/auth.h"
#include "deepnex/gpu/central.h"

namespace deepnex::gpu {

// Thread-safe once made.
class CentralCaller {
 public:
  // Resolves the token and connects (Dial).
  static absl::StatusOr<CentralCaller> Connect(const CentralClientOptions& options) {
    DEEPNEX_ASSIGN_OR_RETURN(std::string token,
                             ResolveClientToken(options.token, options.token_file));
    DEEPNEX_ASSIGN_OR_RETURN(auto credentials, MakeChannelCredentials(options.tls_ca_file));
    DEEPNEX_ASSIGN_OR_RETURN(auto channel, Dial("central", options.address, credentials,
                                                std::min(options.timeout, kConnectTimeout)));
    return CentralCaller(options, std::move(token), std::move(channel));
  }

  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  const std::string& token() const { return token_; }

  // fn(&ctx) -> grpc::Status, sending `request`, with the deadline
  // options.timeout + `extra`; a deadline gRPC gives up on is Unavailable
  // naming the address.
  template <class Fn>
  absl::Status Call(const google::protobuf::Message& request, Fn fn,
                    std::chrono::milliseconds extra = std::chrono::milliseconds(0)) const {
    DEEPNEX_RETURN_IF_ERROR(CheckForkSafe("central client"));
    DEEPNEX_RETURN_IF_ERROR(CheckUtf8Fields(request));
    const std::chrono::milliseconds timeout = options_.timeout + extra;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    ctx.set_wait_for_ready(true);
    if (!token_.empty()) ctx.AddMetadata(kAuthorizationKey, BearerValue(token_));
    grpc::Status s = fn(&ctx);
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
        s.error_message() == "Deadline Exceeded") {
      return absl::UnavailableError(absl::StrCat("deepnex-central at ", options_.address,
                                                 " did not answer within ", timeout.count(), "ms"));
    }
    return ToAbslStatus(s);
  }

 private:
  CentralCaller(CentralClientOptions options, std::string token,
                std::shared_ptr<grpc::Channel> channel)
      : options_(std::move(options)), token_(std::move(token)), channel_(std::move(channel)) {}

  CentralClientOptions options_;
  std::string token_;
  std::shared_ptr<grpc::Channel> channel_;
};

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_CENTRAL_CALL_H_
