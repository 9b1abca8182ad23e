#include "ps/pieces.h"

#include <cstring>

#include "absl/strings/str_format.h"
#include "core/grpc_util.h"
#include "ps/plan.h"

namespace deepnex::ps {

void CutIntoPieces(const NamedTensor& t, const proto::TensorMeta& meta, uint64_t seq,
                   std::vector<Piece>* pieces) {
  const uint64_t elem = DTypeSize(t.view.dtype);
  const uint64_t n = t.view.NumElements();
  for (uint32_t part = 0; part < meta.num_parts(); ++part) {
    PartRange r = PartOf(n, meta.num_parts(), part);
    Piece p;
    p.slice.set_key(t.key);
    p.slice.set_part(part);
    p.slice.set_offset(r.offset);
    p.slice.set_count(r.count);
    p.slice.set_dtype(meta.dtype());
    p.slice.set_seq(seq);
    p.data = static_cast<char*>(t.view.data) + r.offset * elem;
    p.bytes = r.count * elem;
    pieces->push_back(std::move(p));
  }
}

std::vector<std::pair<size_t, std::vector<const Piece*>>> Batch(
    const std::vector<Piece>& pieces, size_t num_servers, uint64_t request_bytes) {
  std::vector<std::vector<const Piece*>> per_server(num_servers);
  for (const Piece& p : pieces) {
    per_server[ServerOf(p.slice.key(), p.slice.part(),
                        static_cast<int>(num_servers))]
        .push_back(&p);
  }
  std::vector<std::pair<size_t, std::vector<const Piece*>>> batches;
  for (size_t s = 0; s < per_server.size(); ++s) {
    std::vector<const Piece*> batch;
    uint64_t bytes = 0;
    for (const Piece* p : per_server[s]) {
      if (!batch.empty() && bytes + p->bytes > request_bytes) {
        batches.push_back({s, std::move(batch)});
        batch.clear();
        bytes = 0;
      }
      batch.push_back(p);
      bytes += p->bytes;
    }
    if (!batch.empty()) batches.push_back({s, std::move(batch)});
  }
  return batches;
}

std::vector<grpc::Slice> PayloadOf(const std::vector<const Piece*>& batch) {
  std::vector<grpc::Slice> payload;
  for (const Piece* p : batch) {
    payload.emplace_back(p->data, p->bytes, grpc::Slice::STATIC_SLICE);
  }
  return payload;
}

std::optional<proto::ShmRegion> Stage(ShmRegions* shm, uint64_t bytes,
                                      const std::vector<const Piece*>* batch) {
  std::optional<uint64_t> at = shm->Take(bytes);
  if (!at) return std::nullopt;
  proto::ShmRegion region;
  region.set_offset(*at);
  region.set_bytes(bytes);
  if (batch != nullptr) {
    char* to = shm->At(*at);
    for (const Piece* p : *batch) {
      std::memcpy(to, p->data, p->bytes);
      to += p->bytes;
    }
  }
  return region;
}

std::function<absl::Status(const grpc::ByteBuffer&)> ReplyReader(
    const char* what, std::vector<std::pair<char*, uint64_t>> dst,
    std::shared_ptr<ShmRegions> shm, std::optional<proto::ShmRegion> region) {
  return [what, dst = std::move(dst), shm = std::move(shm),
          region = std::move(region)](const grpc::ByteBuffer& reply) {
    // The server has answered: it is done with the region either way.
    auto release = [&] {
      if (region) shm->Give(region->offset());
    };
    proto::PullHeader header;
    PayloadReader payload;
    absl::Status s = DecodeFramed(reply, &header, &payload);
    if (s.ok() && header.shm() && !region) {
      s = absl::InternalError(absl::StrFormat("%s: the reply names a shm region never sent", what));
    }
    if (s.ok() && header.shm()) payload = shm->Reader(region->offset(), region->bytes());
    uint64_t need = 0;
    for (const auto& d : dst) need += d.second;
    if (s.ok() && payload.remaining() != need) {
      s = absl::InternalError(absl::StrFormat("%s: the reply holds %d bytes, expected %d", what,
                                              payload.remaining(), need));
    }
    if (s.ok()) {
      // A bulk reply may have been read straight into `dst` already.
      for (auto [ptr, n] : dst) {
        payload.Visit(n, [&ptr](const char* data, size_t size) {
          if (data != ptr) std::memcpy(ptr, data, size);
          ptr += size;
        });
      }
    }
    release();
    return s;
  };
}

std::function<grpc::ByteBuffer()> PushOverTcp(proto::PushHeader header,
                                              std::shared_ptr<ShmRegions> shm,
                                              proto::ShmRegion region) {
  header.clear_shm();
  return [header = std::move(header), shm = std::move(shm), region] {
    std::vector<grpc::Slice> payload;
    payload.emplace_back(shm->At(region.offset()), region.bytes(), grpc::Slice::STATIC_SLICE);
    return EncodeFramed(header, std::move(payload));
  };
}

std::function<grpc::ByteBuffer()> PullOverTcp(proto::PullRequest req) {
  req.clear_shm();
  return [bytes = req.SerializeAsString()] {
    grpc::Slice slice(bytes);
    return grpc::ByteBuffer(&slice, 1);
  };
}

std::function<absl::Status(const grpc::ByteBuffer&)> RegionReleaser(
    std::shared_ptr<ShmRegions> shm, std::optional<proto::ShmRegion> region) {
  return [shm = std::move(shm), region = std::move(region)](const grpc::ByteBuffer&) {
    if (region) shm->Give(region->offset());
    return absl::OkStatus();
  };
}

}  // namespace deepnex::ps
