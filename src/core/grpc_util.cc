#include "core/grpc_util.h"

#include "core/file_util.h"

#include <google/protobuf/message_lite.h>
#include <malloc.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace deepnex {

absl::Status ToAbslStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

std::string BearerValue(const std::string& token) {
  return "Bearer " + token;
}

absl::StatusOr<Identity> AuthenticateCall(const TokenTable& tokens,
                                          const grpc::ServerContextBase& ctx,
                                          const std::string& job,
                                          bool require_admin) {
  const auto& metadata = ctx.client_metadata();
  auto it = metadata.find(kAuthorizationKey);
  std::string value;
  if (it != metadata.end()) value.assign(it->second.data(), it->second.size());
  return tokens.Authenticate(value, job, require_admin);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const std::string& cert_file, const std::string& key_file) {
  if (cert_file.empty() && key_file.empty()) {
    return grpc::InsecureServerCredentials();
  }
  if (cert_file.empty() || key_file.empty()) {
    return absl::InvalidArgumentError(
        "TLS needs both tls_cert_file and tls_key_file");
  }
  DEEPNEX_ASSIGN_OR_RETURN(std::string cert,
                           ReadWholeFile(cert_file, "tls_cert_file"));
  DEEPNEX_ASSIGN_OR_RETURN(std::string key,
                           ReadWholeFile(key_file, "tls_key_file"));
  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({key, cert});
  return grpc::SslServerCredentials(options);
}

namespace {

// Binds what `address` resolves to as gRPC would, and lets go again: the
// first failure's errno (*err) and reason, e.g. "Address already in use";
// err 0 when every bind worked or the address is not HOST:PORT.
std::string ProbeBind(const std::string& address, int* err) {
  *err = 0;
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || address.rfind("unix:", 0) == 0) return "";
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found);
      rc != 0) {
    return gai_strerror(rc);
  }
  std::string why;
  for (addrinfo* a = found; a != nullptr && *err == 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as gRPC does
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0) {
      *err = errno;
      why = std::strerror(errno);
    }
    close(fd);
  }
  freeaddrinfo(found);
  return why;
}

}  // namespace

absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(
    grpc::ServerBuilder& builder, const std::string& what, const std::string& address,
    const std::shared_ptr<grpc::ServerCredentials>& credentials, int* port) {
  auto cannot = [&](const std::string& why) {
    return absl::UnavailableError(absl::StrCat(what, ": cannot listen on \"", address, "\": ",
                                               why.empty() ? "gRPC could not bind it" : why));
  };
  // Refused before gRPC tries: it would log lines of its own, and serve on
  // the other addresses of a name (localhost) when one of them is taken.
  int err = 0;
  const std::string why = ProbeBind(address, &err);
  if (err == EADDRINUSE) return cannot(why);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(address, credentials, port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) return cannot(why);
  return server;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>>
MakeChannelCredentials(const std::string& ca_file) {
  if (ca_file.empty()) return grpc::InsecureChannelCredentials();
  DEEPNEX_ASSIGN_OR_RETURN(std::string ca,
                           ReadWholeFile(ca_file, "tls_ca_file"));
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = ca;
  return grpc::SslCredentials(options);
}

std::shared_ptr<grpc::Channel> MakeChannel(
    const std::string& address,
    const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(address, credentials, args);
}

// ---- framing

namespace {

constexpr uint8_t kHeaderTag = (1 << 3) | 2;   // field 1, length-delimited
constexpr uint8_t kPayloadTag = (2 << 3) | 2;  // field 2, length-delimited

void AppendVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

bool ReadVarint(PayloadReader* r, uint64_t* v) {
  *v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    uint8_t byte;
    if (!r->Read(&byte, 1)) return false;
    *v |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if (!(byte & 0x80)) return true;
  }
  return false;
}

void DeleteBuffer(void* p) { delete[] static_cast<char*>(p); }

}  // namespace

grpc::ByteBuffer EncodeFramed(const google::protobuf::MessageLite& header,
                              std::vector<grpc::Slice> payload) {
  uint64_t payload_size = 0;
  for (const auto& s : payload) payload_size += s.size();
  std::string prefix;
  std::string header_bytes = header.SerializeAsString();
  prefix.push_back(static_cast<char>(kHeaderTag));
  AppendVarint(&prefix, header_bytes.size());
  prefix += header_bytes;
  prefix.push_back(static_cast<char>(kPayloadTag));
  AppendVarint(&prefix, payload_size);
  std::vector<grpc::Slice> slices;
  slices.reserve(payload.size() + 1);
  slices.emplace_back(prefix);
  for (auto& s : payload) {
    if (s.size() > 0) slices.push_back(std::move(s));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

bool PayloadReader::Read(void* dst, uint64_t n) {
  if (n > remaining_) return false;
  char* out = static_cast<char*>(dst);
  remaining_ -= n;
  while (n > 0) {
    const grpc::Slice& s = slices_[slice_];
    size_t take = std::min<uint64_t>(n, s.size() - offset_);
    std::memcpy(out, s.begin() + offset_, take);
    out += take;
    n -= take;
    offset_ += take;
    if (offset_ == s.size()) {
      ++slice_;
      offset_ = 0;
    }
  }
  return true;
}

bool PayloadReader::Skip(uint64_t n) {
  if (n > remaining_) return false;
  remaining_ -= n;
  while (n > 0) {
    size_t take = std::min<uint64_t>(n, slices_[slice_].size() - offset_);
    n -= take;
    offset_ += take;
    if (offset_ == slices_[slice_].size()) {
      ++slice_;
      offset_ = 0;
    }
  }
  return true;
}

absl::Status DecodeFramed(const grpc::ByteBuffer& buffer,
                          google::protobuf::MessageLite* header,
                          PayloadReader* payload) {
  PayloadReader r;
  grpc::Status dumped = buffer.Dump(&r.slices_);
  if (!dumped.ok()) return ToAbslStatus(dumped);
  // Empty slices would stall the cursor arithmetic; drop them.
  r.slices_.erase(std::remove_if(r.slices_.begin(), r.slices_.end(),
                                 [](const grpc::Slice& s) { return s.size() == 0; }),
                  r.slices_.end());
  for (const auto& s : r.slices_) r.remaining_ += s.size();

  auto garbled = [](const char* why) {
    return absl::InvalidArgumentError(
        absl::StrCat("garbled request body: ", why));
  };
  bool have_payload = false;
  size_t payload_slice = 0, payload_offset = 0;
  uint64_t payload_size = 0;
  header->Clear();
  while (r.remaining() > 0) {
    uint64_t tag, len;
    if (!ReadVarint(&r, &tag)) return garbled("bad field tag");
    if ((tag & 7) != 2) return garbled("unexpected wire type");
    if (!ReadVarint(&r, &len) || len > r.remaining()) {
      return garbled("field length past the end of the message");
    }
    uint64_t field = tag >> 3;
    if (field == 1) {
      std::string bytes(len, '\0');
      r.Read(bytes.data(), len);
      if (!header->ParseFromString(bytes)) return garbled("bad header");
    } else if (field == 2) {
      have_payload = true;
      payload_slice = r.slice_;
      payload_offset = r.offset_;
      payload_size = len;
      r.Skip(len);
    } else {
      r.Skip(len);
    }
  }
  payload->slices_ = std::move(r.slices_);
  payload->slice_ = have_payload ? payload_slice : 0;
  payload->offset_ = have_payload ? payload_offset : 0;
  payload->remaining_ = have_payload ? payload_size : 0;
  return absl::OkStatus();
}

grpc::Slice OwnedSlice(std::unique_ptr<char[]> data, size_t size) {
  return grpc::Slice(data.release(), size, &DeleteBuffer);
}

void TuneMallocForLargeBuffers() {
  static std::once_flag once;
  std::call_once(once, [] {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc refuses larger values
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    // Threads other than the first get arenas made of 64 MiB heaps, which
    // glibc unmaps as soon as they empty whatever the trim threshold: with
    // tens of MiB of messages in flight every round faulted its pages in
    // again (a quarter of the CPU in ps_bench's profile). One arena keeps
    // them; these threads allocate few, large blocks, so its lock is cold.
    // Measured: 64 MiB push+pull, 1 worker, 0.56-0.71 -> 1.19-1.23 GB/s.
    mallopt(M_ARENA_MAX, 1);
  });
}

}  // namespace deepnex
