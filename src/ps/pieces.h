// How the client cuts tensors into the slices the servers hold, and groups
// them into requests. Private to ps/client.cc.
#ifndef DEEPNEX_PS_PIECES_H_
#define DEEPNEX_PS_PIECES_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "deepnex/ps.pb.h"
#include "deepnex/ps/client.h"
#include "ps/shm_channel.h"

namespace deepnex::ps {

// One slice of a tensor travelling to or from a server.
struct Piece {
  proto::Slice slice;
  char* data;  // the slice's bytes in the caller's tensor
  uint64_t bytes;
};

// Appends the pieces of `t`, one per part of `meta`, numbered `seq`.
void CutIntoPieces(const NamedTensor& t, const proto::TensorMeta& meta, uint64_t seq,
                   std::vector<Piece>* pieces);

// Groups pieces by server (of `num_servers`), then into batches of about
// `request_bytes`.
std::vector<std::pair<size_t, std::vector<const Piece*>>> Batch(
    const std::vector<Piece>& pieces, size_t num_servers, uint64_t request_bytes);

// The payload points at the caller's memory, which the op's contract keeps
// alive and unchanged until the op is done.
std::vector<grpc::Slice> PayloadOf(const std::vector<const Piece*>& batch);

// A region of `shm` for `bytes` of values, with the batch's values copied
// in when `batch` is given; none when the segment has no room (the request
// then goes over TCP).
std::optional<proto::ShmRegion> Stage(ShmRegions* shm, uint64_t bytes,
                                      const std::vector<const Piece*>* batch);

// Reads a pull's reply (values of the slices in order, from the payload or
// from `region` of `shm`) into `dst`, then returns the region to `shm`.
// Payload slices that already point at `dst` are left as they are.
// A request that fails keeps its region: the server may still write it.
std::function<absl::Status(const grpc::ByteBuffer&)> ReplyReader(
    const char* what, std::vector<std::pair<char*, uint64_t>> dst,
    std::shared_ptr<ShmRegions> shm, std::optional<proto::ShmRegion> region);

// The request again with its values in the payload, for a server that has
// no segment for this client (restarted): the push's values are read from
// `region` of `shm`, which the request keeps until its reply.
std::function<grpc::ByteBuffer()> PushOverTcp(proto::PushHeader header,
                                              std::shared_ptr<ShmRegions> shm,
                                              proto::ShmRegion region);
std::function<grpc::ByteBuffer()> PullOverTcp(proto::PullRequest req);

// Returns `region` to `shm` once a push without a reply of values is done.
std::function<absl::Status(const grpc::ByteBuffer&)> RegionReleaser(
    std::shared_ptr<ShmRegions> shm, std::optional<proto::ShmRegion> region);

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_PIECES_H_
