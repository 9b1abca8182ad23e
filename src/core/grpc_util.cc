#include "core/grpc_util.h"

#include "core/file_util.h"
#include "core/grpc_listener.h"
#include "core/net.h"
#include "core/text.h"

#include <google/protobuf/message_lite.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <grpcpp/generic/generic_stub.h>
#include <malloc.h>
#include <netdb.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <future>
#include <mutex>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace deepnex {

absl::Status ToAbslStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // The message travels in a trailer, which past gRPC's 8 KiB metadata limit
  // reaches the caller as "received initial metadata size exceeds limit",
  // naming nothing: an error quoting a huge bad value keeps its start, which
  // names the field.
  constexpr size_t kMaxMessage = 2048;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      CutText(std::string(status.message()), kMaxMessage));
}

std::string BearerValue(const std::string& token) {
  return "Bearer " + token;
}

absl::StatusOr<Identity> AuthenticateCall(const TokenTable& tokens,
                                          const grpc::ServerContextBase& ctx,
                                          const std::string& job,
                                          bool require_admin, bool allow_node) {
  const auto& metadata = ctx.client_metadata();
  auto it = metadata.find(kAuthorizationKey);
  std::string value;
  if (it != metadata.end()) value.assign(it->second.data(), it->second.size());
  return tokens.Authenticate(value, job, require_admin, allow_node);
}

namespace {

// InvalidArgument unless `cert` starts with a PEM certificate whose public
// key `key`'s PEM private key matches, as gRPC checks when it makes its TLS
// context. gRPC's refusal then only logs a line, and a server handed its
// connections (GrpcListener) served no one and leaked each of them (probe).
absl::Status CheckKeyPair(const std::string& cert_file, const std::string& cert,
                          const std::string& key_file, const std::string& key) {
  auto refuse = [&](const std::string& what) {
    const unsigned long e = ERR_get_error();
    char why[256] = "";
    if (e != 0) ERR_error_string_n(e, why, sizeof(why));
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat(what, *why ? absl::StrCat(" (", why, ")") : std::string()));
  };
  // No passphrase asked for (OpenSSL's default asks the terminal): gRPC
  // takes no encrypted key either.
  pem_password_cb* none = [](char*, int, int, void*) { return 0; };
  std::unique_ptr<BIO, decltype(&BIO_free)> cert_bio(
      BIO_new_mem_buf(cert.data(), static_cast<int>(cert.size())), &BIO_free);
  std::unique_ptr<X509, decltype(&X509_free)> x509(
      PEM_read_bio_X509(cert_bio.get(), nullptr, none, nullptr), &X509_free);
  if (x509 == nullptr) {
    return refuse(absl::StrCat("tls_cert_file: ", cert_file, " holds no PEM certificate"));
  }
  std::unique_ptr<BIO, decltype(&BIO_free)> key_bio(
      BIO_new_mem_buf(key.data(), static_cast<int>(key.size())), &BIO_free);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> pkey(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, none, nullptr), &EVP_PKEY_free);
  if (pkey == nullptr) {
    return refuse(absl::StrCat("tls_key_file: ", key_file, " holds no PEM private key"));
  }
  if (X509_check_private_key(x509.get(), pkey.get()) != 1) {
    return refuse(absl::StrCat("tls_key_file: ", key_file, " is not the private key of ",
                               cert_file, "'s certificate"));
  }
  return absl::OkStatus();
}

}  // namespace

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
  DEEPNEX_RETURN_IF_ERROR(CheckKeyPair(cert_file, cert, key_file, key));
  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({key, cert});
  return grpc::SslServerCredentials(options);
}

namespace {

// InvalidArgument unless `address` ends in a port number 0-65535: gRPC and
// getaddrinfo take one past 65535 modulo 65536 (asked for 70000, a server
// served on 4464), and a service name ("http") as its port. A unix: one
// needs a path: "unix:" alone bound a socket no client can name (probe).
absl::Status CheckListenPort(const std::string& what, const std::string& address) {
  if (absl::StartsWith(address, "unix:")) {
    if (address.size() > 5) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": listen address \"unix:\": no socket path after unix:"));
  }
  const size_t colon = address.rfind(':');
  const std::string port = colon == std::string::npos ? "" : address.substr(colon + 1);
  int value = 0;
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(port, &value) || value > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": listen address \"", address,
                                                   "\": port \"", port,
                                                   "\" is not a number in 0-65535 (0: the OS "
                                                   "picks one)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ServerHost>> ServerHost::Start(
    const ServerHostOptions& options, const std::vector<grpc::Service*>& services) {
  DEEPNEX_RETURN_IF_ERROR(CheckForkSafe(options.what));
  DEEPNEX_ASSIGN_OR_RETURN(auto credentials,
                           MakeServerCredentials(options.tls_cert_file, options.tls_key_file));
  const std::string& address = options.address;
  DEEPNEX_RETURN_IF_ERROR(CheckListenPort(options.what, address));
  const bool unix_socket = absl::StartsWith(address, "unix:");
  if (unix_socket && !options.advertise.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        options.what, ": advertise \"", options.advertise, "\" with listen address \"", address,
        "\": a unix socket is dialed by its path, on its own host only"));
  }
  // HOST:PORT: our own accept loop (core/grpc_listener.h); unix: gRPC's.
  std::unique_ptr<GrpcListener> listener;
  if (!unix_socket) {
    DEEPNEX_ASSIGN_OR_RETURN(listener, GrpcListener::Bind(options.what, address));
  }
  grpc::ServerBuilder builder;
  if (options.max_receive_bytes > 0) {
    builder.SetMaxReceiveMessageSize(
        static_cast<int>(std::min<uint64_t>(options.max_receive_bytes, INT32_MAX)));
  }
  builder.SetMaxSendMessageSize(-1);
  for (grpc::Service* service : services) builder.RegisterService(service);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Clients that keep alive (MakeChannel) ping this often, with or without
  // calls; gRPC's defaults would count those pings as abuse and hang up.
  // Half the interval, so that a ping a little early is no strike either.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             static_cast<int>(kMinKeepalive.count() / 2));
  int port = 0;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor;
  if (listener == nullptr) {
    builder.AddListeningPort(address, credentials, &port);
  } else {
    acceptor = builder.experimental().AddExternalConnectionAcceptor(
        grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD, credentials);
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (listener != nullptr) port = listener->port();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat(options.what, ": cannot listen on \"", address,
                                               "\": gRPC could not bind it"));
  }
  if (listener != nullptr) listener->Serve(std::move(acceptor));
  // gRPC reports a unix socket's port as 1; its peers dial the path.
  if (unix_socket) {
    return std::unique_ptr<ServerHost>(new ServerHost(std::move(server), nullptr, address, 0));
  }
  return std::unique_ptr<ServerHost>(
      new ServerHost(std::move(server), std::move(listener),
                     AdvertisedAddress(address, options.advertise, port), port));
}

ServerHost::ServerHost(std::unique_ptr<grpc::Server> server,
                       std::unique_ptr<GrpcListener> listener, std::string address, int port)
    : server_(std::move(server)), listener_(std::move(listener)), address_(std::move(address)),
      port_(port) {}

ServerHost::~ServerHost() { Stop(); }

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

void ServerHost::Stop() {
  // A child forked from the serving process: the server is the parent's,
  // and its threads were not forked (shutting it down here crashed).
  if (InForkedChild()) return;
  std::call_once(stop_once_, [this] {
    listener_.reset();  // no connection comes to a server shutting down
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    server_->Wait();
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    cv_.notify_all();
  });
}

void ServerHost::Wait() {
  if (InForkedChild()) return;  // nothing serves here: it would wait for ever
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return stopped_; });
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
    const std::shared_ptr<grpc::ChannelCredentials>& credentials,
    std::chrono::milliseconds keepalive) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  if (keepalive.count() > 0) {
    const int ms = static_cast<int>(std::max(keepalive, kMinKeepalive).count());
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, ms);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    // gRPC stops pinging after two pings with no data sent between them;
    // a quiet stream must still be watched.
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  }
  return grpc::CreateCustomChannel(address, credentials, args);
}

// ---- dialing

absl::Status ValidateAddress(const std::string& what, const std::string& address) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(what, " \"", address, "\": ", why,
                                                   why.empty() ? "" : "; ",
                                                   "expected HOST:PORT (e.g. 127.0.0.1:7070)"));
  };
  if (address.empty()) return bad("empty");
  if (absl::StartsWith(address, "unix:")) {
    return address.size() > 5 ? absl::OkStatus() : bad("no socket path after unix:");
  }
  if (address.find("://") != std::string::npos) return bad("");
  std::string host, port;
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == std::string::npos || address.compare(close + 1, 1, ":") != 0) {
      return bad("no port after the bracketed IPv6 address");
    }
    host = address.substr(1, close - 1);
    port = address.substr(close + 2);
    if (host.empty() || host.find_first_not_of("0123456789abcdefABCDEF:.") != std::string::npos) {
      return bad(absl::StrCat("\"", host, "\" is not an IPv6 address"));
    }
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) return bad("no port");
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
    if (host.empty()) return bad("no host");
    if (host.find(':') != std::string::npos) {
      return bad("an IPv6 address goes in brackets, as in [::1]:7070");
    }
    for (char c : host) {
      if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' &&
          c != '_') {
        return bad(absl::StrCat("host \"", host, "\" is not a name or an IP address"));
      }
    }
  }
  if (port.empty()) return bad("no port");
  int value = 0;
  if (port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(port, &value)) {
    return bad(absl::StrCat("port \"", port, "\" is not a number"));
  }
  if (value < 1 || value > 65535) return bad(absl::StrCat("port ", value, " is not in 1-65535"));
  return absl::OkStatus();
}

namespace {

// Why `channel` is not connected, from a call that does not wait for a
// connection (the channel itself keeps no reason): gRPC's last connection
// error, e.g. "failed to connect to all addresses; last error: UNKNOWN:
// ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused".
// Empty if the call reached a server after all.
std::string WhyNotConnected(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  grpc::Slice empty("");
  grpc::ByteBuffer request(&empty, 1), response;
  std::promise<grpc::Status> done;
  // No deepnex service has this method: a server that answers says UNIMPLEMENTED.
  stub.UnaryCall(&ctx, "/deepnex.Dial/Probe", grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  grpc::Status s = done.get_future().get();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) return s.error_message();
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return "still connecting (is the host unreachable, or dropping packets?)";
  }
  return "";
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::Channel>> Dial(
    const std::string& what, const std::string& address,
    const std::shared_ptr<grpc::ChannelCredentials>& credentials,
    std::chrono::milliseconds connect_timeout) {
  DEEPNEX_RETURN_IF_ERROR(ValidateAddress(absl::StrCat(what, " address"), address));
  DEEPNEX_RETURN_IF_ERROR(CheckForkSafe(absl::StrCat("dialing ", what, " at ", address)));
  std::shared_ptr<grpc::Channel> channel = MakeChannel(address, credentials, kClientKeepalive);
  if (channel->WaitForConnected(std::chrono::system_clock::now() + connect_timeout)) {
    return channel;
  }
  std::string why = WhyNotConnected(channel);
  if (why.empty()) return channel;
  return absl::UnavailableError(absl::StrCat(what, " at ", address, ": no connection within ",
                                             connect_timeout.count(), " ms: ", why));
}

// ---- fork

namespace {

std::atomic<bool> grpc_started{false};
// In a child forked after gRPC started: the parent's pid; else 0.
std::atomic<pid_t> forked_from{0};

// Runs in the child of every fork(), where only async-signal-safe work is
// allowed: two atomics and getppid.
void AfterForkInChild() {
  if (grpc_started.load() && forked_from.load() == 0) forked_from.store(getppid());
}

}  // namespace

bool InForkedChild() { return forked_from.load(std::memory_order_relaxed) != 0; }

absl::Status CheckForkSafe(const std::string& what) {
  const pid_t parent = forked_from.load(std::memory_order_relaxed);
  if (parent != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": this process (pid ", getpid(), ") was forked from pid ", parent,
        " after that process had started gRPC, which does not survive fork(); start the "
        "processes that use deepnex with multiprocessing.get_context(\"spawn\") or "
        "multiprocessing.set_start_method(\"spawn\"), or fork before creating any deepnex "
        "server or client"));
  }
  static std::once_flag once;
  std::call_once(once, [] {
    pthread_atfork(nullptr, nullptr, &AfterForkInChild);
    grpc_started.store(true);
  });
  return absl::OkStatus();
}

namespace {

// The path of the first string field below `m` that is not UTF-8 (its
// value in *value), else "".
std::string NotUtf8(const google::protobuf::Message& m, const std::string& prefix,
                    std::string* value) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection* reflection = m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  reflection->ListFields(m, &fields);
  for (const FieldDescriptor* f : fields) {
    const std::string name = prefix + f->name();
    const int n = f->is_repeated() ? reflection->FieldSize(m, f) : 1;
    for (int i = 0; i < n; ++i) {
      const std::string at = f->is_repeated() ? absl::StrCat(name, "[", i, "]") : name;
      if (f->type() == FieldDescriptor::TYPE_STRING) {
        std::string scratch;
        const std::string& s = f->is_repeated()
                                   ? reflection->GetRepeatedStringReference(m, f, i, &scratch)
                                   : reflection->GetStringReference(m, f, &scratch);
        if (!IsUtf8(s)) {
          *value = s;
          return at;
        }
      } else if (f->type() == FieldDescriptor::TYPE_MESSAGE) {
        const google::protobuf::Message& sub = f->is_repeated()
                                                   ? reflection->GetRepeatedMessage(m, f, i)
                                                   : reflection->GetMessage(m, f);
        std::string found = NotUtf8(sub, at + ".", value);
        if (!found.empty()) return found;
      }
    }
  }
  return "";
}

}  // namespace

absl::Status CheckUtf8Fields(const google::protobuf::Message& request) {
  std::string value;
  const std::string field = NotUtf8(request, "", &value);
  if (field.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": ", Quoted(value), " is not UTF-8 text"));
}

// ---- framing

namespace {

constexpr uint8_t kHeaderTag = (1 << 3) | 2;   // field 1, length-delimited
constexpr uint8_t kPayloadTag = (2 << 3) | 2;  // field 2, length-delimited

constexpr size_t kMaxVarintBytes = 10;

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}

// Appends `v` in `bytes` bytes (at least VarintSize(v), at most
// kMaxVarintBytes): the bytes past what `v` needs carry zeros.
void AppendVarint(std::string* out, uint64_t v, size_t bytes) {
  for (size_t i = 1; i < bytes; ++i, v >>= 7) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
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
  std::string header_bytes = header.SerializeAsString();
  size_t header_varint = VarintSize(header_bytes.size());
  size_t payload_varint = VarintSize(payload_size);
  if (payload_size > 0) {
    const size_t unpadded = 2 + header_varint + header_bytes.size() + payload_varint;
    size_t pad = (kFramedPayloadAlignment - unpadded % kFramedPayloadAlignment) %
                 kFramedPayloadAlignment;
    const size_t to_header = std::min(pad, kMaxVarintBytes - header_varint);
    header_varint += to_header;
    pad -= to_header;
    // Only a header of over 2 MiB has a varint too long to take all of it.
    payload_varint += std::min(pad, kMaxVarintBytes - payload_varint);
  }
  std::string prefix;
  prefix.push_back(static_cast<char>(kHeaderTag));
  AppendVarint(&prefix, header_bytes.size(), header_varint);
  prefix += header_bytes;
  prefix.push_back(static_cast<char>(kPayloadTag));
  AppendVarint(&prefix, payload_size, payload_varint);
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

bool PayloadReader::Whole(uint64_t n, grpc::Slice* slice, const char** data) const {
  if (lent_ || n > remaining_ || n == 0) return false;
  const grpc::Slice& s = slices_[slice_];
  if (s.size() - offset_ < n) return false;
  // An inlined slice carries its bytes in the object itself: a copy would
  // not keep them at `data`.
  const char* begin = reinterpret_cast<const char*>(s.begin());
  const char* object = reinterpret_cast<const char*>(&s);
  if (begin >= object && begin < object + sizeof(s)) return false;
  *slice = s;
  *data = begin + offset_;
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
