#include "collective/rendezvous.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace deepnex::collective {

// How long a failed start spends on the store after its deadline: to say
// what was missing, and to take its join back.
constexpr std::chrono::milliseconds kTakeBack{1000};

// Where a rank counts the communicators of `backend` it joined under the
// prefix: its generation.
std::string CountKey(const std::string& backend, int rank) {
  return absl::StrCat(backend, "_gen/", rank);
}

// A counter every join and every give-up under the prefix takes a number
// from: what happened in which order, as the store saw it.
std::string TurnKey(const std::string& backend) { return absl::StrCat(backend, "_turn"); }

// Beside AllGather's names under a generation: a rank's mark of a try it
// took back (holding the turn it gave up at), and why its collectives
// failed (Blame).
constexpr char kLeft[] = "left";
constexpr char kFailed[] = "failed";

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
  DEEPNEX_ASSIGN_OR_RETURN(int64_t generation, store->Add(CountKey(backend, options.rank), 1));
  DEEPNEX_ASSIGN_OR_RETURN(int64_t joined, store->Add(TurnKey(backend), 1));
  std::unique_ptr<Rendezvous> r(
      new Rendezvous(options, std::move(store), backend, generation, label));
  r->joined_ = joined;
  return r;
}

Rendezvous::Rendezvous(const CommunicatorOptions& options, std::unique_ptr<StoreClient> store,
                       const std::string& backend, int64_t generation, std::string label)
    : o_(options),
      store_(std::move(store)),
      label_(std::move(label)),
      backend_(backend),
      generation_(generation) {}

absl::StatusOr<std::unique_ptr<StoreClient>> Rendezvous::QuickStore(
    std::chrono::milliseconds timeout) const {
  StoreClientOptions so;
  so.address = o_.store_address;
  so.prefix = o_.prefix;
  so.timeout = timeout;
  so.token = o_.token;
  so.token_file = o_.token_file;
  return StoreClient::Create(so);
}

Rendezvous::~Rendezvous() {
  if (kept_) return;
  absl::StatusOr<std::unique_ptr<StoreClient>> quick = QuickStore(kTakeBack);
  if (!quick.ok()) return;
  // Marked, with its turn, before its keys go: a rank still waiting, which
  // joined before that turn, names this one as having come and gone
  // rather than as never come.
  if (!published_.empty()) {
    absl::StatusOr<int64_t> turn = (*quick)->Add(TurnKey(backend_), 1);
    if (turn.ok()) {
      (*quick)->Set(KeyAt(generation_, kLeft, o_.rank), absl::StrCat(*turn)).IgnoreError();
    }
  }
  for (const std::string& key : published_) (*quick)->Delete(key).IgnoreError();
  // Only while no later join of this rank took a number after it.
  (*quick)->CompareSet(CountKey(backend_, o_.rank), absl::StrCat(generation_),
                       absl::StrCat(generation_ - 1))
      .IgnoreError();
}

absl::StatusOr<std::vector<std::string>> Rendezvous::AllGather(
    const std::string& name, const std::string& value,
    std::chrono::steady_clock::time_point deadline) {
  const int n = o_.world_size;
  auto key = [&](int rank) { return KeyAt(generation_, name, rank); };
  DEEPNEX_RETURN_IF_ERROR(store_->Set(key(o_.rank), value));
  published_.push_back(key(o_.rank));
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
  const std::string what = absl::StrCat(label_, " \"", o_.prefix, "\" of ", n, " ranks");
  // Past the deadline: a short look, which a store out of reach fails.
  absl::StatusOr<std::vector<bool>> present = store_->Check(keys, kTakeBack);
  if (!present.ok()) {
    kept_ = true;  // nothing to take back through a store out of reach
    return absl::DeadlineExceededError(absl::StrCat(what, ": ", values.status().message()));
  }
  // Of the absent, those that came and gave up while this rank waited (and
  // took their keys back) are not missing. A mark from before this rank
  // joined is of an earlier try.
  std::vector<int> absent;
  std::vector<std::string> left_keys;
  for (int i = 0; i < n; ++i) {
    if ((*present)[i]) continue;
    absent.push_back(i);
    left_keys.push_back(KeyAt(generation_, kLeft, i));
  }
  std::vector<bool> gave_up(absent.size(), false);
  absl::StatusOr<std::vector<bool>> marked =
      absent.empty() ? std::vector<bool>{} : store_->Check(left_keys, kTakeBack);
  for (size_t j = 0; marked.ok() && j < absent.size(); ++j) {
    if (!(*marked)[j]) continue;
    absl::StatusOr<std::string> turn = store_->Get(left_keys[j], kTakeBack);
    int64_t t;
    gave_up[j] = turn.ok() && absl::SimpleAtoi(*turn, &t) && t > joined_;
  }
  std::vector<std::string> gone;
  int first_missing = -1;
  for (size_t j = 0; j < absent.size(); ++j) {
    const int i = absent[j];
    if (gave_up[j]) {
      gone.push_back(absl::StrCat(i));
      continue;
    }
    if (first_missing < 0) first_missing = i;
    if (missing.size() < kShown) {
      missing.push_back(absl::StrCat(i));
    } else {
      ++more;
    }
  }
  // A rank that joined this prefix a different number of times never meets
  // this one: say so, as the cause, when it waits under its generation now
  // (its key is there: a rank killed while starting takes nothing back) or
  // came under another while this rank waited. One that took its join back
  // before this rank came waits nowhere.
  std::string apart;
  const std::string other = CountKey(backend_, first_missing);
  // Looked for first: Get waits for a key that is not there.
  absl::StatusOr<std::vector<bool>> joined =
      first_missing >= 0 ? store_->Check({other}, kTakeBack) : std::vector<bool>{false};
  absl::StatusOr<std::string> count =
      joined.ok() && (*joined)[0] ? store_->Get(other, kTakeBack) : "";
  int64_t theirs;
  if (count.ok() && absl::SimpleAtoi(*count, &theirs) && theirs != generation_) {
    // Waiting under its generation now, or it came under the next one
    // while this rank waited and took its join back (a probe's restarted
    // ranks, a generation behind a rank killed while starting, did so).
    const std::string came = KeyAt(theirs + 1, kLeft, first_missing);
    absl::StatusOr<std::vector<bool>> waiting =
        store_->Check({KeyAt(theirs, name, first_missing), came}, kTakeBack);
    bool apart_now = waiting.ok() && (*waiting)[0];
    if (!apart_now && waiting.ok() && (*waiting)[1] && theirs + 1 != generation_) {
      absl::StatusOr<std::string> turn = store_->Get(came, kTakeBack);
      int64_t t;
      apart_now = turn.ok() && absl::SimpleAtoi(*turn, &t) && t > joined_;
      ++theirs;  // the join it took back
    }
    if (apart_now) {
      apart = absl::StrCat(" (it has joined \"", o_.prefix, "\" ", theirs,
                           " time(s) and this rank ", generation_,
                           ": they wait under different generations, as after a rank was killed "
                           "while starting or a start that failed on some ranks only; start "
                           "every rank with a new prefix)");
    }
  }
  std::string gave_up_said;
  if (!gone.empty()) {
    if (gone.size() > kShown) {
      const size_t rest = gone.size() - kShown;
      gone.resize(kShown);
      gone.push_back(absl::StrCat("and ", rest, " more"));
    }
    gave_up_said = absl::StrCat("rank ", absl::StrJoin(gone, ", "),
                                " came and left again (its own start failed first)");
  }
  const std::string where =
      absl::StrCat(" at the store ", o_.store_address, " within ", o_.timeout.count(), " ms");
  if (missing.empty() && !gone.empty()) {
    return absl::DeadlineExceededError(
        absl::StrCat(what, ": not every rank was there together", where, "; ", gave_up_said));
  }
  return absl::DeadlineExceededError(absl::StrCat(
      what, ": rank ", missing.empty() ? "?" : absl::StrJoin(missing, ", "),
      more > 0 ? absl::StrCat(" and ", more, " more") : "", " did not arrive", where, apart,
      gave_up_said.empty() ? "" : "; ", gave_up_said));
}

std::string Rendezvous::KeyAt(int64_t generation, const std::string& name, int rank) const {
  return absl::StrCat(backend_, generation, "/", name, "/", rank);
}

void Rendezvous::Keep(bool blame) {
  kept_ = true;
  store_.reset();
  if (blame) {
    absl::StatusOr<std::unique_ptr<StoreClient>> quick = QuickStore(kBlameTimeout);
    if (quick.ok()) store_ = *std::move(quick);
  }
}

std::string Rendezvous::Blame(const std::string& why, std::optional<int> peer) {
  if (store_ == nullptr) return "";
  std::string began;
  if (peer) {
    // Looked for first: Get waits for a key that is not there.
    const std::string theirs = KeyAt(generation_, kFailed, *peer);
    absl::StatusOr<std::vector<bool>> present = store_->Check({theirs}, kBlameTimeout);
    if (!present.ok()) return "";  // out of reach: nothing to learn or to record
    if ((*present)[0]) {
      absl::StatusOr<std::string> recorded = store_->Get(theirs, kBlameTimeout);
      if (recorded.ok()) began = *recorded;
    }
  }
  store_->Set(KeyAt(generation_, kFailed, o_.rank), began.empty() ? why : began).IgnoreError();
  return began;
}

}  // namespace deepnex::collective
