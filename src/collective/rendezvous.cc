#include "collective/rendezvous.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace deepnex::collective {

absl::StatusOr<std::unique_ptr<Rendezvous>> Rendezvous::Join(const CommunicatorOptions& options,
                                                             const std::string& backend,
                                                             const std::string& label) {
  StoreClientOptions so;
  so.address = options.store_address;
  so.prefix = options.prefix;
  so.timeout = options.timeout;
  so.token = options.token;
  so.token_file = options.token_file;
  DEEPNEX_ASSIGN_OR_RETURN(auto store, StoreClient::Create(so));
  DEEPNEX_ASSIGN_OR_RETURN(int64_t generation,
                           store->Add(absl::StrCat(backend, "_gen/", options.rank), 1));
  return std::unique_ptr<Rendezvous>(new Rendezvous(
      options, std::move(store), absl::StrCat(backend, generation, "/"), label));
}

absl::StatusOr<std::vector<std::string>> Rendezvous::AllGather(
    const std::string& name, const std::string& value,
    std::chrono::steady_clock::time_point deadline) {
  const int n = o_.world_size;
  auto key = [&](int rank) { return absl::StrCat(base_, name, "/", rank); };
  DEEPNEX_RETURN_IF_ERROR(store_->Set(key(o_.rank), value));
  std::vector<std::string> keys;
  for (int i = 0; i < n; ++i) keys.push_back(key(i));
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  auto values = store_->MultiGet(keys, std::max(left, std::chrono::milliseconds(1)));
  if (values.ok() || values.status().code() != absl::StatusCode::kDeadlineExceeded) {
    return values;
  }
  // The first few missing ranks, and how many more.
  constexpr int kShown = 8;
  std::vector<std::string> missing;
  int more = 0;
  if (auto present = store_->Check(keys); present.ok()) {
    for (int i = 0; i < n; ++i) {
      if ((*present)[i]) continue;
      if (missing.size() < kShown) {
        missing.push_back(absl::StrCat(i));
      } else {
        ++more;
      }
    }
  }
  return absl::DeadlineExceededError(absl::StrCat(
      label_, " \"", o_.prefix, "\" of ", n, " ranks: rank ",
      missing.empty() ? "?" : absl::StrJoin(missing, ", "),
      more > 0 ? absl::StrCat(" and ", more, " more") : "", " did not arrive at the store ",
      o_.store_address, " within ", o_.timeout.count(), " ms"));
}

}  // namespace deepnex::collective
