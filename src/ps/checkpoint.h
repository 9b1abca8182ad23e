// The parameter server's checkpoint file, NAME.ckpt: the tensors' metas and
// every partition's state at one round, one checksummed CheckpointFile
// message replaced by atomic rename; and where a Checkpoint call may write.
// Private to libdeepnex. Functions only; safe from any thread.
#ifndef DEEPNEX_PS_CHECKPOINT_H_
#define DEEPNEX_PS_CHECKPOINT_H_

#include <cstdint>
#include <string>

#include "deepnex/ps.pb.h"
#include "deepnex/ps/server.h"
#include "deepnex/status.h"
#include "ps/partition.h"

namespace deepnex::ps {

// <dir>/<name>.ckpt
std::string CheckpointPath(const std::string& dir, const std::string& name);

// Appends the record of part `part` of tensor `key`, held by `partition`
// and in `state` (whose arrays it takes).
void AddPartitionRecord(const std::string& key, uint32_t part, const Partition& partition,
                        PartitionState state, proto::CheckpointFile* file);

// Writes `file` to CheckpointPath(dir, file.name()), making `dir` first if
// needed. Readers see the previous file or this one, never a part of one.
absl::Status WriteCheckpointFile(const std::string& dir, const proto::CheckpointFile& file);

// Reads CheckpointPath(dir, name) for a server of `mode` with `num_workers`
// and an `optimizer` of that kind: NotFound naming the checkpoints of other
// names in `dir`; FailedPrecondition for a FIFO, device or directory in its
// place (ReadRegularFile); DataLoss for a file that is damaged,
// does not parse, or holds a tensor or a record that Init would refuse (a
// meta that CheckTensorMeta refuses, a record of no tensor, of another
// dtype or range than its meta's partitioning gives, or twice) or a record
// with the wrong number of values; FailedPrecondition for one of another
// mode, number of workers or optimizer kind (whose state, Adam's moments or
// SGD's momentum, would be read as the other's).
absl::StatusOr<proto::CheckpointFile> ReadCheckpointFile(const std::string& dir,
                                                         const std::string& name, Mode mode,
                                                         int num_workers,
                                                         OptimizerKind optimizer);

// A record's state, as Partition::Restore takes it.
PartitionState StateOf(const proto::PartitionRecord& record);

// Where a Checkpoint call naming `name` writes: `checkpoint_dir` for an
// empty name, else the directory `name` inside it. A name is never a path:
// InvalidArgument unless it is letters, digits, '.', '-' and '_', at most
// 255 of them, and not "." or "..".
absl::StatusOr<std::string> CheckpointDirFor(const std::string& checkpoint_dir,
                                             const std::string& name);

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_CHECKPOINT_H_
