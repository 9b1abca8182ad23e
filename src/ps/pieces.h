// How the client cuts tensors into the slices the servers hold, and groups
// them into requests. Private to ps/client.cc.
#ifndef DEEPNEX_PS_PIECES_H_
#define DEEPNEX_PS_PIECES_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "deepnex/ps.pb.h"
#include "deepnex/ps/client.h"

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

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_PIECES_H_
