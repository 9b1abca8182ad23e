// The server's end of bulk connections (ps/bulk_channel.h): each frame is
// a push or pull that goes through Service::StartPush / StartPull as a gRPC
// call does, and its reply goes back on the same connection.
#include <unordered_map>

#include "absl/strings/str_format.h"
#include "ps/calls.h"
#include "ps/service.h"

namespace deepnex::ps {

namespace pb = ::deepnex::ps::proto;

// One admitted connection: its calls in flight, by the client's ids.
class BulkConnection final : public std::enable_shared_from_this<BulkConnection> {
 public:
  BulkConnection(Service* service, std::shared_ptr<BulkStream> stream, int worker)
      : service_(service), stream_(std::move(stream)), worker_(worker) {}

  BulkStream* stream() const { return stream_.get(); }

  absl::Status OnFrame(const BulkFrame& frame) {
    if (frame.text != 0 || frame.prefix != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("bulk connection with ", stream_->peer(), ": a request frame with text"));
    }
    if (frame.kind == kBulkCancel) {
      std::shared_ptr<Request> r = Find(frame.id);
      if (r) r->call->Fail(absl::CancelledError("call cancelled"));
      return stream_->Skip(frame.body);
    }
    auto r = std::make_shared<Request>();
    r->id = frame.id;
    absl::Status s;
    const uint64_t max = service_->options_.max_message_bytes;
    if (frame.kind != kBulkPush && frame.kind != kBulkPull) {
      s = absl::InvalidArgumentError(absl::StrFormat("bulk: unknown method %d", frame.kind));
    } else if (frame.body > max) {
      s = absl::ResourceExhaustedError(absl::StrFormat(
          "bulk: a request of %d bytes is over max_message_bytes (%d)", frame.body, max));
    } else if (Find(frame.id) != nullptr) {
      s = absl::InvalidArgumentError(
          absl::StrFormat("bulk: request id %d is already in flight", frame.id));
    }
    if (!s.ok()) {
      // The connection stays usable: the body is read past.
      Reply(r, ToGrpcStatus(s));
      return stream_->Skip(frame.body);
    }
    if (frame.body > 0) {
      const std::shared_ptr<ReplyBuffers>& pool = service_->reply_buffers_;
      std::unique_ptr<char[]> buffer = pool->Take(frame.body);
      DEEPNEX_RETURN_IF_ERROR(stream_->Read(buffer.get(), frame.body));
      grpc::Slice body = pool->Wrap(std::move(buffer), frame.body);
      r->request = grpc::ByteBuffer(&body, 1);
    }
    service_->metrics_.bulk_bytes->Add(frame.body);
    Site site(shared_from_this(), r);
    s = frame.kind == kBulkPush ? service_->StartPush(&site, r->request, &r->response)
                                : service_->StartPull(&site, r->request, &r->response);
    if (r->call == nullptr) Reply(r, ToGrpcStatus(s));
    return absl::OkStatus();
  }

  // The connection ended: its calls fail as cancelled gRPC calls do.
  void OnClose() {
    std::vector<std::shared_ptr<Request>> left;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [id, r] : calls_) left.push_back(r);
    }
    for (const auto& r : left) r->call->Fail(absl::CancelledError("bulk connection closed"));
  }

 private:
  struct Request {
    uint64_t id = 0;
    grpc::ByteBuffer request;
    grpc::ByteBuffer response;
    std::shared_ptr<Call> call;  // set by Bind
  };

  class Site final : public CallSite {
   public:
    Site(std::shared_ptr<BulkConnection> conn, std::shared_ptr<Request> r)
        : conn_(std::move(conn)), r_(std::move(r)) {}
    std::string peer() const override { return absl::StrCat("bulk:", conn_->stream_->peer()); }
    std::optional<int> worker() const override { return conn_->worker_; }
    void Bind(std::shared_ptr<Call> call) override {
      r_->call = call;
      {
        std::lock_guard<std::mutex> lock(conn_->mu_);
        conn_->calls_[r_->id] = r_;
      }
      call->SetFinish([conn = conn_, id = r_->id](const grpc::Status& status) {
        conn->Finish(id, status);
      });
    }

   private:
    const std::shared_ptr<BulkConnection> conn_;
    const std::shared_ptr<Request> r_;
  };

  std::shared_ptr<Request> Find(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(id);
    return it == calls_.end() ? nullptr : it->second;
  }

  void Finish(uint64_t id, const grpc::Status& status) {
    std::shared_ptr<Request> r;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = calls_.find(id);
      if (it == calls_.end()) return;
      r = std::move(it->second);
      calls_.erase(it);
    }
    Reply(r, status);
  }

  // Sends `status` and, when it is OK, the response; the call is done once
  // they are written (or cannot be).
  void Reply(const std::shared_ptr<Request>& r, const grpc::Status& status) {
    BulkFrame frame;
    frame.kind = static_cast<uint32_t>(status.error_code());
    frame.id = r->id;
    grpc::ByteBuffer body;
    if (status.ok() && r->response.Length() > 0) {
      std::vector<grpc::Slice> slices;
      if (r->response.Dump(&slices).ok() && !slices.empty()) {
        // A pull reply is EncodeFramed's: its header, then the values.
        frame.prefix = static_cast<uint32_t>(slices.size() > 1 ? slices[0].size() : 0);
        body = r->response;
        service_->metrics_.bulk_bytes->Add(body.Length());
      }
    }
    stream_->Send(frame, status.error_message(), std::move(body), [r](bool) {
      if (r->call) r->call->Done();
    });
  }

  Service* const service_;
  const std::shared_ptr<BulkStream> stream_;
  const int worker_;
  std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Request>> calls_;  // guarded by mu_
};

void Service::OfferBulk(const pb::RegisterRequest& req, pb::RegisterReply* reply) {
  if (!req.bulk()) return;
  std::lock_guard<std::mutex> lock(bulk_mu_);
  if (!bulk_) return;
  reply->set_bulk_port(static_cast<uint32_t>(bulk_->port()));
  reply->set_bulk_ticket(bulk_->Offer(req.worker_id(), req.incarnation()));
}

void Service::DropBulk(int worker, uint64_t incarnation) {
  std::lock_guard<std::mutex> lock(bulk_mu_);
  if (bulk_) bulk_->Drop(worker, incarnation);
}

void Service::ServeBulk(std::shared_ptr<BulkStream> stream, int worker, uint64_t) {
  auto conn = std::make_shared<BulkConnection>(this, stream, worker);
  {
    std::lock_guard<std::mutex> lock(bulk_mu_);
    if (!bulk_) return;  // stopping: the stream closes as it goes
    bulk_connections_.insert(conn);
    metrics_.bulk_connections->Set(bulk_connections_.size());
  }
  stream->Start([conn](const BulkFrame& frame) { return conn->OnFrame(frame); },
                [this, conn](const absl::Status&) {
                  conn->OnClose();
                  std::lock_guard<std::mutex> lock(bulk_mu_);
                  bulk_connections_.erase(conn);
                  metrics_.bulk_connections->Set(bulk_connections_.size());
                });
}

void Service::StopBulk() {
  std::unique_ptr<BulkListener> listener;
  std::vector<std::shared_ptr<BulkStream>> streams;
  {
    std::lock_guard<std::mutex> lock(bulk_mu_);
    listener = std::move(bulk_);
    for (const auto& conn : bulk_connections_) {
      streams.emplace_back(conn->shared_from_this(), conn->stream());
    }
  }
  // No new connections (admissions in progress end first), then none left.
  listener.reset();
  for (const auto& stream : streams) stream->Close();
  // Held here, no stream can be destroyed on its own reader thread, and
  // none of their threads outlives this call.
  for (const auto& stream : streams) stream->Join();
}

Service::~Service() { StopBulk(); }

}  // namespace deepnex::ps
