#include "ps/checkpoint.h"

#include <filesystem>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/checksum.h"
#include "core/file_util.h"
#include "core/text.h"
#include "ps/plan.h"

namespace deepnex::ps {
namespace {

constexpr char kCheckpointMagic[] = "DNXPSCK1";
constexpr uint32_t kCheckpointVersion = 1;

// What ends NotFound for `dir`/`name`.ckpt: the checkpoints of other names
// there (a server restored without its --name found nothing, and said only
// "No such file or directory").
std::string OtherCheckpoints(const std::string& dir) {
  std::error_code ec;
  std::set<std::string> names;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string();
    if (absl::EndsWith(file, ".ckpt")) names.insert(file.substr(0, file.size() - 5));
  }
  if (names.empty()) return "";
  std::vector<std::string> quoted;
  for (const std::string& n : names) {
    if (quoted.size() == 4) {
      quoted.push_back(absl::StrCat("and ", names.size() - 4, " more"));
      break;
    }
    quoted.push_back(Quoted(n));
  }
  return absl::StrCat("; the directory holds the checkpoints of servers named ",
                      absl::StrJoin(quoted, ", "), ": is this server's name one of them?");
}

}  // namespace

std::string CheckpointPath(const std::string& dir, const std::string& name) {
  return dir + "/" + name + ".ckpt";
}

void AddPartitionRecord(const std::string& key, uint32_t part, const Partition& partition,
                        PartitionState state, proto::CheckpointFile* file) {
  proto::PartitionRecord* r = file->add_parts();
  r->set_key(key);
  r->set_part(part);
  r->set_offset(partition.offset());
  r->set_count(partition.count());
  r->set_dtype(static_cast<int>(partition.dtype()));
  r->set_version(state.version);
  r->set_step(state.step);
  r->set_values(std::move(state.values));
  r->set_m(std::move(state.m));
  r->set_v(std::move(state.v));
  for (const auto& w : state.workers) {
    auto* rw = r->add_workers();
    rw->set_incarnation(w.incarnation);
    rw->set_first_round(w.first_round);
    rw->set_next_seq(w.next_seq);
  }
}

absl::Status WriteCheckpointFile(const std::string& dir, const proto::CheckpointFile& file) {
  std::string body;
  if (!file.SerializeToString(&body)) {
    return absl::ResourceExhaustedError(
        "checkpoint: the state does not fit one protobuf message (2 GiB)");
  }
  DEEPNEX_RETURN_IF_ERROR(MakeDirectories(dir));
  // The job's parameters and optimizer state: its owner's alone (they were
  // 0644, readable by every local user).
  return WriteFileAtomically(CheckpointPath(dir, file.name()),
                             EncodeChecksummed(kCheckpointMagic, kCheckpointVersion, body), 0600);
}

absl::StatusOr<proto::CheckpointFile> ReadCheckpointFile(const std::string& dir,
                                                         const std::string& name, Mode mode,
                                                         int num_workers,
                                                         OptimizerKind optimizer) {
  const std::string path = CheckpointPath(dir, name);
  // At most what WriteCheckpointFile writes: a body of one protobuf
  // message (2 GiB) and the checksummed header.
  constexpr uint64_t kMaxCheckpointBytes = (uint64_t{2} << 30) + 64;
  absl::StatusOr<std::string> read = ReadRegularFile(path, "checkpoint", kMaxCheckpointBytes);
  if (absl::IsNotFound(read.status())) {
    return absl::NotFoundError(absl::StrCat(read.status().message(), OtherCheckpoints(dir)));
  }
  DEEPNEX_ASSIGN_OR_RETURN(std::string bytes, std::move(read));
  DEEPNEX_ASSIGN_OR_RETURN(
      std::string body, DecodeChecksummed(kCheckpointMagic, kCheckpointVersion, bytes,
                                          absl::StrCat("checkpoint \"", path, "\"")));
  proto::CheckpointFile file;
  if (!file.ParseFromString(body)) {
    return absl::DataLossError(absl::StrCat("checkpoint \"", path, "\" does not parse"));
  }
  if (file.mode() != ModeName(mode) || file.num_workers() != num_workers) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "checkpoint \"%s\" is of a %s server with %d workers, this one is %s with %d", path,
        file.mode(), file.num_workers(), ModeName(mode), num_workers));
  }
  if (!file.optimizer().empty() && file.optimizer() != OptimizerKindName(optimizer)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "checkpoint \"%s\" is of a server whose optimizer is %s, this one's is %s; restore it "
        "with the same kind of optimizer",
        path, file.optimizer(), OptimizerKindName(optimizer)));
  }
  // What Init would refuse is refused here too: a client trusts what a
  // server describes.
  std::map<std::string, const proto::TensorMeta*> metas;
  std::vector<const proto::TensorMeta*> all;
  for (const auto& meta : file.metas()) all.push_back(&meta);
  for (const auto& meta : file.parts_metas()) all.push_back(&meta);
  for (const proto::TensorMeta* m : all) {
    const proto::TensorMeta& meta = *m;
    absl::Status s =
        CheckTensorMeta(absl::StrFormat("checkpoint \"%s\": tensor \"%s\"", path, meta.key()),
                        meta)
            .status();
    if (!s.ok()) return absl::DataLossError(s.message());
    if (!metas.emplace(meta.key(), &meta).second) {
      return absl::DataLossError(
          absl::StrFormat("checkpoint \"%s\": tensor \"%s\" twice", path, meta.key()));
    }
  }
  std::set<std::pair<std::string, uint32_t>> seen;
  for (const auto& r : file.parts()) {
    const std::string what =
        absl::StrFormat("checkpoint \"%s\": \"%s\" part %d", path, r.key(), r.part());
    auto meta = metas.find(r.key());
    if (meta == metas.end()) return absl::DataLossError(absl::StrCat(what, ": no such tensor"));
    absl::Status s =
        CheckPart(what, r.key(), r.part(), r.offset(), r.count(), r.dtype(), *meta->second)
            .status();
    if (!s.ok()) return absl::DataLossError(s.message());
    if (!seen.emplace(r.key(), r.part()).second) {
      return absl::DataLossError(absl::StrCat(what, " twice"));
    }
    size_t elem = static_cast<DType>(r.dtype()) == DType::kFloat64 ? 8 : 4;  // the compute type
    // Compared by division: a count from the file must not wrap a product.
    if (r.values().size() % elem != 0 || r.values().size() / elem != r.count() ||
        (!r.m().empty() && r.m().size() != r.values().size()) ||
        (!r.v().empty() && r.v().size() != r.values().size())) {
      return absl::DataLossError(absl::StrFormat(
          "checkpoint \"%s\": \"%s\" part %d has the wrong number of values", path, r.key(),
          r.part()));
    }
  }
  return file;
}

PartitionState StateOf(const proto::PartitionRecord& record) {
  PartitionState s;
  s.version = record.version();
  s.step = record.step();
  s.values = record.values();
  s.m = record.m();
  s.v = record.v();
  for (const auto& w : record.workers()) {
    s.workers.push_back({w.incarnation(), w.first_round(), w.next_seq()});
  }
  return s;
}

absl::StatusOr<std::string> CheckpointDirFor(const std::string& checkpoint_dir,
                                             const std::string& name) {
  bool plain = name.size() <= 255 && name != "." && name != "..";
  for (char c : name) {
    plain = plain && (absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' ||
                      c == '-' || c == '_');
  }
  if (!plain) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint: name ", Quoted(name, 300),
        " is not a plain name (letters, digits, '.', '-', '_'; not \".\" or "
        "\"..\"; at most 255): it names a directory inside the server's "
        "checkpoint_dir, never a path"));
  }
  return name.empty() ? checkpoint_dir : absl::StrCat(checkpoint_dir, "/", name);
}

}  // namespace deepnex::ps
