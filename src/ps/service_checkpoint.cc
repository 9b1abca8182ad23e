// Service's checkpoints: periodic snapshots collected from the partitions,
// checkpoints written on request, and the restore at start (the file
// format is ps/checkpoint.h's).
#include <condition_variable>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ps/checkpoint.h"
#include "ps/service.h"

namespace deepnex::ps {

namespace pb = ::deepnex::ps::proto;

void Service::Periodic(const Partition* partition, PartitionState state) {
  std::lock_guard<std::mutex> lock(periodic_mu_);
  uint64_t version = state.version;
  if (version <= last_periodic_) return;
  periodic_[version][partition] = std::move(state);
}

absl::Status Service::WritePeriodic() {
  std::vector<std::pair<std::string, uint32_t>> names;
  std::vector<Partition*> parts;
  pb::CheckpointFile file = Directory(&names, &parts);
  std::map<const Partition*, PartitionState> states;
  uint64_t round = 0;
  {
    std::lock_guard<std::mutex> lock(periodic_mu_);
    for (auto it = periodic_.rbegin(); it != periodic_.rend(); ++it) {
      if (it->second.size() == parts.size()) {
        round = it->first;
        states = std::move(it->second);
        break;
      }
    }
    if (round == 0) return absl::OkStatus();
    last_periodic_ = round;
    periodic_.erase(periodic_.begin(), periodic_.upper_bound(round));
  }
  std::vector<PartitionState> ordered;
  for (Partition* p : parts) {
    auto it = states.find(p);
    if (it == states.end()) return absl::OkStatus();  // the set of partitions changed
    ordered.push_back(std::move(it->second));
  }
  return Write(options_.checkpoint_dir, round, std::move(file), names, parts, std::move(ordered));
}

absl::StatusOr<uint64_t> Service::WriteCheckpoint(const std::string& dir,
                                                  std::chrono::milliseconds timeout) {
  std::vector<std::pair<std::string, uint32_t>> names;
  std::vector<Partition*> parts;
  pb::CheckpointFile file = Directory(&names, &parts);
  uint64_t round = 0;
  for (Partition* p : parts) round = std::max(round, p->version());

  struct Collector {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<std::optional<PartitionState>> states;
    size_t remaining;
  };
  auto c = std::make_shared<Collector>();
  c->states.resize(parts.size());
  c->remaining = parts.size();
  Completions done;
  for (size_t i = 0; i < parts.size(); ++i) {
    parts[i]->SnapshotAt(
        round,
        [c, i](PartitionState s) {
          std::lock_guard<std::mutex> lock(c->mu);
          c->states[i] = std::move(s);
          if (--c->remaining == 0) c->cv.notify_all();
        },
        &done);
  }
  RunAll(done);
  std::vector<PartitionState> states;
  {
    std::unique_lock<std::mutex> lock(c->mu);
    if (!c->cv.wait_for(lock, timeout, [&] { return c->remaining == 0; })) {
      for (size_t i = 0; i < parts.size(); ++i) {
        if (!c->states[i]) {
          return absl::DeadlineExceededError(
              absl::StrFormat("checkpoint: \"%s\" part %d did not reach round %d within %d ms",
                              names[i].first, names[i].second, round, timeout.count()));
        }
      }
    }
    for (auto& st : c->states) states.push_back(std::move(*st));
  }
  DEEPNEX_RETURN_IF_ERROR(Write(dir, round, std::move(file), names, parts, std::move(states)));
  return round;
}

absl::Status Service::Restore(const std::string& dir) {
  DEEPNEX_ASSIGN_OR_RETURN(
      pb::CheckpointFile file,
      ReadCheckpointFile(dir, options_.name, options_.mode, options_.num_workers,
                         options_.optimizer.kind));
  std::unordered_map<std::string, Tensor> tensors;
  for (const auto& meta : file.metas()) {
    tensors[meta.key()].meta = std::make_unique<pb::TensorMeta>(meta);
  }
  for (const auto& meta : file.parts_metas()) {
    tensors[meta.key()].parts_meta = std::make_unique<pb::TensorMeta>(meta);
  }
  for (const auto& r : file.parts()) {
    auto part = Partition::Create(config_, static_cast<DType>(r.dtype()), r.offset(), r.count());
    part->Restore(StateOf(r));
    tensors[r.key()].parts[r.part()] = std::move(part);
  }
  // Clients that were connected keep their leases (fresh ones), so that a
  // push retried across the restart is recognised and applied once.
  for (int w = 0; w < file.incarnations_size() && w < options_.num_workers; ++w) {
    if (file.incarnations(w) != 0) membership_.Register(w, file.incarnations(w));
  }
  std::lock_guard<std::mutex> lock(mu_);
  tensors_ = std::move(tensors);
  return absl::OkStatus();
}

pb::CheckpointFile Service::Directory(std::vector<std::pair<std::string, uint32_t>>* names,
                                      std::vector<Partition*>* parts) {
  pb::CheckpointFile file;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [key, t] : tensors_) {
    if (t.meta) {
      *file.add_metas() = *t.meta;
    } else if (t.parts_meta) {
      *file.add_parts_metas() = *t.parts_meta;
    }
    for (auto& [part, p] : t.parts) {
      names->push_back({key, part});
      parts->push_back(p.get());
    }
  }
  return file;
}

absl::Status Service::Write(const std::string& dir, uint64_t round, pb::CheckpointFile file,
                            const std::vector<std::pair<std::string, uint32_t>>& names,
                            const std::vector<Partition*>& parts,
                            std::vector<PartitionState> states) {
  std::lock_guard<std::mutex> one_at_a_time(checkpoint_mu_);
  file.set_name(options_.name);
  file.set_mode(ModeName(options_.mode));
  file.set_optimizer(OptimizerKindName(options_.optimizer.kind));
  file.set_num_workers(options_.num_workers);
  file.set_round(round);
  for (int w = 0; w < options_.num_workers; ++w) {
    file.add_incarnations(membership_.Incarnation(w));
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    AddPartitionRecord(names[i].first, names[i].second, *parts[i], std::move(states[i]), &file);
  }
  if (absl::Status s = WriteCheckpointFile(dir, file); !s.ok()) {
    metrics_.checkpoint_failures->Add();
    return s;
  }
  metrics_.checkpoints->Add();
  metrics_.checkpoint_round->Set(static_cast<double>(round));
  return absl::OkStatus();
}

absl::StatusOr<std::string> Service::CheckpointTarget(const grpc::ServerContextBase& ctx,
                                                      const pb::CheckpointRequest& req) {
  DEEPNEX_ASSIGN_OR_RETURN(Identity who, Caller(ctx));
  if (who.role != AuthRole::kAdmin && who.job.empty() && !job_token_) {
    return absl::PermissionDeniedError(
        absl::StrCat("checkpoint: \"", who.name,
                     "\" is neither an admin nor this job's token; checkpoints need one of them"));
  }
  if (options_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError(
        "checkpoint: this server has no checkpoint_dir (--checkpoint-dir), the "
        "only place it writes checkpoints to when asked over the wire");
  }
  DEEPNEX_ASSIGN_OR_RETURN(std::string dir, CheckpointDirFor(options_.checkpoint_dir, req.name()));
  constexpr uint64_t kMaxTimeoutMs = 3600 * 1000;
  if (req.timeout_ms() > kMaxTimeoutMs) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "checkpoint: timeout_ms %d is over an hour (%d)", req.timeout_ms(), kMaxTimeoutMs));
  }
  // Each call waits on a thread of its own.
  constexpr int kMaxCheckpointCalls = 4;
  if (checkpoint_calls_.fetch_add(1) >= kMaxCheckpointCalls) {
    checkpoint_calls_.fetch_sub(1);
    return absl::ResourceExhaustedError(absl::StrFormat(
        "checkpoint: %d checkpoint calls are already in progress", kMaxCheckpointCalls));
  }
  return dir;
}

}  // namespace deepnex::ps
