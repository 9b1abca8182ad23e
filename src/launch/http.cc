#include "launch/http.h"

#include <curl/curl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/un.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/file_util.h"

namespace deepnex::launch {
namespace {

using Clock = std::chrono::steady_clock;

absl::StatusCode CodeForHttpStatus(int status) {
  switch (status) {
    case 400:
    case 422:
      return absl::StatusCode::kInvalidArgument;
    case 401:
      return absl::StatusCode::kUnauthenticated;
    case 403:
      return absl::StatusCode::kPermissionDenied;
    case 404:
    case 410:
      return absl::StatusCode::kNotFound;
    case 409:
      return absl::StatusCode::kAlreadyExists;
    case 429:
      return absl::StatusCode::kResourceExhausted;
    case 501:
      return absl::StatusCode::kUnimplemented;
    case 502:
    case 503:
      return absl::StatusCode::kUnavailable;
    case 504:
      return absl::StatusCode::kDeadlineExceeded;
    default:
      return status >= 500 ? absl::StatusCode::kInternal : absl::StatusCode::kUnknown;
  }
}

// The PEM text of `file`, or `text` when no file is given. libcurl would
// only find a missing or mangled file at the first request: InvalidArgument
// now, naming it, when it cannot be read or has no "<block>-----" in it.
absl::StatusOr<std::string> LoadPem(const std::string& name, const std::string& file,
                                    const std::string& text, const std::string& block) {
  std::string source = absl::StrCat(name, " data");
  std::string pem = text;
  if (!file.empty()) {
    source = absl::StrCat(name, " file \"", file, "\"");
    absl::StatusOr<std::string> read = ReadWholeFile(file, absl::StrCat(name, " file"));
    if (!read.ok()) return absl::InvalidArgumentError(read.status().message());
    pem = *std::move(read);
  }
  if (!absl::StrContains(pem, "-----BEGIN ") || !absl::StrContains(pem, block + "-----")) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": no PEM ", absl::AsciiStrToLower(block), " in it"));
  }
  return pem;
}

// What one transfer's callbacks share with the loop that drives it.
struct Transfer {
  HttpResponse* head;
  const std::function<bool(const std::string&)>* body_sink;
  // The final (not 1xx) response's headers have ended: later header lines
  // are trailers.
  bool in_body = false;
  // body_sink asked to stop: the write error that follows is not one.
  bool sink_stopped = false;
  // The read timeout counts from the connection, then from the newest bytes.
  bool connected = false;
  Clock::time_point last_bytes = Clock::now();
  // HttpClientOptions::allow_address, and why it refused an address.
  const std::function<absl::Status(const sockaddr*)>* allow_address = nullptr;
  absl::Status refused;
};

curl_socket_t OnOpenSocket(void* user, curlsocktype purpose, curl_sockaddr* address) {
  auto* t = static_cast<Transfer*>(user);
  if (purpose == CURLSOCKTYPE_IPCXN) {
    absl::Status allowed = (*t->allow_address)(&address->addr);
    if (!allowed.ok()) {
      t->refused = std::move(allowed);
      return CURL_SOCKET_BAD;
    }
  }
  return socket(address->family, address->socktype | SOCK_CLOEXEC, address->protocol);
}

size_t OnHeader(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t length = size * n;
  t->last_bytes = Clock::now();
  if (t->in_body) return length;
  const std::string line(absl::StripAsciiWhitespace(absl::string_view(data, length)));
  if (absl::StartsWith(line, "HTTP/")) {
    // A response begins: an interim 1xx one, or the final one.
    std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(' ', 2));
    if (parts.size() < 2 || !absl::SimpleAtoi(parts[1], &t->head->status)) t->head->status = 0;
    t->head->headers.clear();
  } else if (line.empty()) {
    t->in_body = t->head->status >= 200;
  } else if (size_t colon = line.find(':'); colon != std::string::npos) {
    std::string name = absl::AsciiStrToLower(line.substr(0, colon));
    std::string value(absl::StripAsciiWhitespace(line.substr(colon + 1)));
    auto [it, fresh] = t->head->headers.emplace(name, value);
    if (!fresh) absl::StrAppend(&it->second, ", ", value);
  }
  return length;
}

size_t OnBody(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  t->last_bytes = Clock::now();
  if (!(*t->body_sink)(std::string(data, size * n))) {
    t->sink_stopped = true;
    return 0;  // any short count ends the transfer
  }
  return size * n;
}

int OnConnected(void* user, char*, char*, int, int) {
  auto* t = static_cast<Transfer*>(user);
  t->connected = true;
  t->last_bytes = Clock::now();
  return CURL_PREREQFUNC_OK;
}

// The error for a transfer that libcurl ended with `rc`, worded as before
// libcurl so that callers and users see the same messages. `detail` is
// libcurl's error buffer.
absl::Status CurlError(CURL* easy, CURLcode rc, const char* detail, const std::string& what,
                       const std::string& host, std::chrono::milliseconds connect_timeout) {
  const std::string why = detail[0] != '\0' ? detail : curl_easy_strerror(rc);
  switch (rc) {
    case CURLE_COULDNT_RESOLVE_HOST:
      return absl::UnavailableError(absl::StrCat("cannot resolve \"", host, "\": ", why));
    case CURLE_COULDNT_CONNECT: {
      long os_errno = 0;
      curl_easy_getinfo(easy, CURLINFO_OS_ERRNO, &os_errno);
      return absl::UnavailableError(absl::StrCat("cannot connect to ", what, ": ",
                                                 os_errno != 0 ? strerror(os_errno) : why));
    }
    case CURLE_OPERATION_TIMEDOUT:  // only the connect timeout is libcurl's
      return absl::DeadlineExceededError(absl::StrCat(
          "cannot connect to ", what, " within ", connect_timeout.count(), " ms"));
    case CURLE_PEER_FAILED_VERIFICATION:
      return absl::UnavailableError(absl::StrCat(
          "TLS handshake with ", what, ": server certificate rejected: ", why));
    case CURLE_SSL_CONNECT_ERROR:
      return absl::UnavailableError(absl::StrCat("TLS handshake with ", what, ": ", why));
    // The PEM texts passed LoadPem's check, but OpenSSL refused them.
    case CURLE_SSL_CERTPROBLEM:
      return absl::InvalidArgumentError(absl::StrCat(
          "TLS with ", what, ": the client certificate and key do not load or do not match: ",
          why));
    case CURLE_SSL_CACERT_BADFILE:
      return absl::InvalidArgumentError(
          absl::StrCat("TLS with ", what, ": the CA certificates do not load: ", why));
    case CURLE_UNSUPPORTED_PROTOCOL:  // the schemes were checked at Create
    case CURLE_WEIRD_SERVER_REPLY:
      return absl::UnavailableError(absl::StrCat("not an HTTP response: ", why));
    case CURLE_OUT_OF_MEMORY:
    case CURLE_FAILED_INIT:
      return absl::InternalError(absl::StrCat("libcurl: ", why));
    default:
      return absl::UnavailableError(absl::StrCat(what, ": ", why));
  }
}

}  // namespace

HttpCancel::HttpCancel() : fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}

HttpCancel::~HttpCancel() {
  if (fd_ >= 0) close(fd_);
}

void HttpCancel::Cancel() {
  uint64_t one = 1;
  // An eventfd stays readable once written, which is what every poller sees.
  if (write(fd_, &one, sizeof(one)) < 0) return;
}

absl::StatusOr<std::unique_ptr<HttpClient>> HttpClient::Create(const HttpClientOptions& options) {
  Target target;
  const std::string& e = options.endpoint;
  std::string rest;
  if (absl::StartsWith(e, "unix:")) {
    target.unix_socket = true;
    target.host = e.substr(5);
    if (target.host.empty() || target.host[0] != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat("endpoint \"", e, "\": a unix socket path must be absolute"));
    }
    if (target.host.size() >= sizeof(sockaddr_un::sun_path)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "endpoint \"", e, "\": a unix socket path must be under ", sizeof(sockaddr_un::sun_path),
          " bytes"));
    }
  } else if (absl::StartsWith(e, "http://") || absl::StartsWith(e, "https://")) {
    target.tls = absl::StartsWith(e, "https://");
    rest = e.substr(target.tls ? 8 : 7);
    std::string authority = rest.substr(0, rest.find('/'));
    target.port = target.tls ? 443 : 80;
    std::string port_text;
    if (!authority.empty() && authority[0] == '[') {  // [v6]:port
      size_t close = authority.find(']');
      if (close == std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat("endpoint \"", e, "\": unclosed '['"));
      }
      target.host = authority.substr(1, close - 1);
      if (close + 1 < authority.size() && authority[close + 1] == ':') port_text = authority.substr(close + 2);
    } else {
      size_t colon = authority.rfind(':');
      target.host = authority.substr(0, colon);
      if (colon != std::string::npos) port_text = authority.substr(colon + 1);
    }
    if (!port_text.empty() && (!absl::SimpleAtoi(port_text, &target.port) || target.port <= 0 ||
                               target.port > 65535)) {
      return absl::InvalidArgumentError(
          absl::StrCat("endpoint \"", e, "\": bad port \"", port_text, "\""));
    }
    if (target.host.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("endpoint \"", e, "\": no host"));
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "endpoint \"", e, "\": expected unix:/path, http://host:port or https://host:port"));
  }
  Pems pems;
  if (target.tls) {
    const std::string kCertificate = "CERTIFICATE";
    if (!options.ca_file.empty()) {
      DEEPNEX_ASSIGN_OR_RETURN(pems.ca, LoadPem("CA", options.ca_file, "", kCertificate));
    }
    if (!options.ca_pem.empty()) {
      DEEPNEX_ASSIGN_OR_RETURN(std::string pem, LoadPem("CA", "", options.ca_pem, kCertificate));
      absl::StrAppend(&pems.ca, "\n", pem);
    }
    // Files win over PEM text, as kubeconfig's client-certificate does
    // over client-certificate-data.
    const bool files = !options.client_cert_file.empty() || !options.client_key_file.empty();
    if (files || !options.client_cert_pem.empty() || !options.client_key_pem.empty()) {
      DEEPNEX_ASSIGN_OR_RETURN(
          pems.client_cert,
          LoadPem("client certificate", files ? options.client_cert_file : "",
                  files ? "" : options.client_cert_pem, kCertificate));
      DEEPNEX_ASSIGN_OR_RETURN(
          pems.client_key, LoadPem("client key", files ? options.client_key_file : "",
                                   files ? "" : options.client_key_pem, "PRIVATE KEY"));
    }
  }
  // Once per process, before any handle; not thread-safe in libcurl 7.88.
  static const CURLcode kGlobalInit = curl_global_init(CURL_GLOBAL_DEFAULT);
  if (kGlobalInit != CURLE_OK) {
    return absl::InternalError(
        absl::StrCat("curl_global_init: ", curl_easy_strerror(kGlobalInit)));
  }
  if (!target.unix_socket) {
    // What libcurl refuses at each request (a space, a control character)
    // is refused here: the notifier took such a webhook URL and retried it
    // for ever.
    std::unique_ptr<CURLU, decltype(&curl_url_cleanup)> url(curl_url(), &curl_url_cleanup);
    if (url == nullptr) return absl::InternalError("libcurl: no URL handle");
    if (CURLUcode rc = curl_url_set(url.get(), CURLUPART_URL, e.c_str(), 0); rc != CURLUE_OK) {
      return absl::InvalidArgumentError(
          absl::StrCat("endpoint \"", absl::CEscape(e), "\": ", curl_url_strerror(rc)));
    }
  }
  return std::unique_ptr<HttpClient>(new HttpClient(options, std::move(target), std::move(pems)));
}

std::string HttpClient::Url(const std::string& path) const {
  if (target_.unix_socket) return absl::StrCat(options_.endpoint, ":", path);
  std::string base = options_.endpoint;
  while (!base.empty() && base.back() == '/') base.pop_back();
  return base + path;
}

absl::Status HttpClient::Perform(const std::string& method, const std::string& path,
                                 const std::string& body, std::chrono::milliseconds read_timeout,
                                 HttpCancel* cancel, HttpResponse* head,
                                 const std::function<bool(const std::string&)>& body_sink,
                                 const std::vector<std::string>& headers, bool* transient) const {
  if (transient != nullptr) *transient = false;
  auto with_url = [&](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(method, " ", Url(path), ": ", s.message()));
  };
  const std::string what = target_.unix_socket
                               ? absl::StrCat("unix:", target_.host)
                               : absl::StrCat(target_.host, ":", target_.port);
  // Declared in this order so that the easy handle, which leaves its multi
  // handle as it is cleaned up, goes first.
  std::unique_ptr<CURLM, decltype(&curl_multi_cleanup)> multi(curl_multi_init(),
                                                              &curl_multi_cleanup);
  std::unique_ptr<CURL, decltype(&curl_easy_cleanup)> easy(curl_easy_init(), &curl_easy_cleanup);
  if (multi == nullptr || easy == nullptr) return with_url(absl::InternalError("libcurl: no handle"));
  curl_slist* header_list = nullptr;
  for (const std::string& h : {
           std::string("Accept: application/json, */*"), std::string("Connection: close"),
           // libcurl would wait for a 100 Continue that the engines never send.
           std::string("Expect:"),
           // Without a body, no Content-Type: not libcurl's form type either.
           std::string(body.empty() ? "Content-Type:" : "Content-Type: application/json"),
           options_.bearer_token.empty() ? std::string()
                                         : "Authorization: Bearer " + options_.bearer_token}) {
    if (!h.empty()) header_list = curl_slist_append(header_list, h.c_str());
  }
  for (const std::string& h : headers) header_list = curl_slist_append(header_list, h.c_str());
  std::unique_ptr<curl_slist, decltype(&curl_slist_free_all)> header_slist(header_list,
                                                                      &curl_slist_free_all);

  Transfer transfer{head, &body_sink};
  if (options_.allow_address) transfer.allow_address = &options_.allow_address;
  char detail[CURL_ERROR_SIZE] = "";
  CURLcode rc = CURLE_OK;
  auto set = [&](CURLoption option, auto value) {
    if (rc == CURLE_OK) rc = curl_easy_setopt(easy.get(), option, value);
  };
  const std::string url = target_.unix_socket ? "http://localhost" + path : Url(path);
  set(CURLOPT_URL, url.c_str());
  set(CURLOPT_PROTOCOLS_STR, "http,https");
  set(CURLOPT_PATH_AS_IS, 1L);
  set(CURLOPT_HTTP_VERSION, static_cast<long>(CURL_HTTP_VERSION_1_1));
  set(CURLOPT_NOSIGNAL, 1L);
  set(CURLOPT_ERRORBUFFER, detail);
  set(CURLOPT_USERAGENT, "deepnex");
  set(CURLOPT_HTTPHEADER, header_slist.get());
  set(CURLOPT_CUSTOMREQUEST, method.c_str());
  if (method == "HEAD") set(CURLOPT_NOBODY, 1L);
  // A body-less POST still says its length (Docker's start wants it).
  if (!body.empty() || (method != "GET" && method != "HEAD")) {
    set(CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
    set(CURLOPT_POSTFIELDS, body.data());
  }
  set(CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(options_.connect_timeout.count()));
  set(CURLOPT_HEADERFUNCTION, &OnHeader);
  set(CURLOPT_HEADERDATA, &transfer);
  set(CURLOPT_WRITEFUNCTION, &OnBody);
  set(CURLOPT_WRITEDATA, &transfer);
  set(CURLOPT_PREREQFUNCTION, &OnConnected);
  set(CURLOPT_PREREQDATA, &transfer);
  if (target_.unix_socket) set(CURLOPT_UNIX_SOCKET_PATH, target_.host.c_str());
  if (transfer.allow_address != nullptr) {
    set(CURLOPT_OPENSOCKETFUNCTION, &OnOpenSocket);
    set(CURLOPT_OPENSOCKETDATA, &transfer);
    // Direct: through a proxy from the environment the check would see the
    // proxy's address, and the proxy would connect anywhere.
    set(CURLOPT_NOPROXY, "*");
  }
  if (target_.tls) {
    set(CURLOPT_SSLVERSION, static_cast<long>(CURL_SSLVERSION_TLSv1_2));
    if (options_.insecure_skip_verify) {
      set(CURLOPT_SSL_VERIFYPEER, 0L);
      set(CURLOPT_SSL_VERIFYHOST, 0L);
    }
    auto blob = [](const std::string& pem) {
      return curl_blob{const_cast<char*>(pem.data()), pem.size(), CURL_BLOB_NOCOPY};
    };
    curl_blob ca = blob(pems_.ca), cert = blob(pems_.client_cert), key = blob(pems_.client_key);
    if (!pems_.ca.empty()) {
      // Only these CAs, as kubeconfig means: not the system's besides.
      set(CURLOPT_CAINFO, static_cast<char*>(nullptr));
      set(CURLOPT_CAPATH, static_cast<char*>(nullptr));
      set(CURLOPT_CAINFO_BLOB, &ca);
    }
    if (!pems_.client_cert.empty()) {
      set(CURLOPT_SSLCERTTYPE, "PEM");
      set(CURLOPT_SSLCERT_BLOB, &cert);
      set(CURLOPT_SSLKEYTYPE, "PEM");
      set(CURLOPT_SSLKEY_BLOB, &key);
    }
  }
  if (rc != CURLE_OK) {
    return with_url(absl::InternalError(
        absl::StrCat("libcurl refuses an option: ", curl_easy_strerror(rc))));
  }

  // libcurl's multi interface, so that the wait for the next bytes also
  // watches the cancel token and the read timeout is ours to the ms.
  curl_multi_add_handle(multi.get(), easy.get());
  curl_waitfd cancel_fd{cancel != nullptr ? cancel->fd() : -1, CURL_WAIT_POLLIN, 0};
  const Clock::time_point start = Clock::now();
  int running = 1;
  while (running != 0) {
    int wait_ms = INT_MAX;  // libcurl shortens it to its own timers
    if (options_.total_timeout.count() > 0) {
      auto left = std::chrono::ceil<std::chrono::milliseconds>(start + options_.total_timeout -
                                                               Clock::now());
      if (left.count() <= 0) {
        if (transient != nullptr) *transient = true;
        return with_url(absl::DeadlineExceededError(absl::StrCat(
            what, ": no whole answer within ", options_.total_timeout.count(), " ms")));
      }
      wait_ms = static_cast<int>(std::min<int64_t>(left.count(), INT_MAX));
    }
    if (transfer.connected && read_timeout.count() > 0) {
      auto left = std::chrono::ceil<std::chrono::milliseconds>(transfer.last_bytes +
                                                               read_timeout - Clock::now());
      if (left.count() <= 0) {
        if (transient != nullptr) *transient = true;
        return with_url(absl::DeadlineExceededError(absl::StrCat(
            what, ": no answer within ", read_timeout.count(), " ms while reading the response")));
      }
      wait_ms = std::min(wait_ms, static_cast<int>(std::min<int64_t>(left.count(), INT_MAX)));
    }
    cancel_fd.revents = 0;
    CURLMcode mc = curl_multi_poll(multi.get(), cancel != nullptr ? &cancel_fd : nullptr,
                                   cancel != nullptr ? 1 : 0, wait_ms, nullptr);
    if (mc == CURLM_OK && cancel_fd.revents != 0) {
      return with_url(absl::CancelledError(absl::StrCat(what, ": cancelled")));
    }
    if (mc == CURLM_OK) mc = curl_multi_perform(multi.get(), &running);
    if (mc != CURLM_OK) {
      return with_url(absl::InternalError(absl::StrCat("libcurl: ", curl_multi_strerror(mc))));
    }
  }
  int queued = 0;
  while (CURLMsg* message = curl_multi_info_read(multi.get(), &queued)) {
    if (message->msg == CURLMSG_DONE) rc = message->data.result;
  }
  if (rc == CURLE_OK || (rc == CURLE_WRITE_ERROR && transfer.sink_stopped)) return absl::OkStatus();
  if (!transfer.refused.ok()) return with_url(transfer.refused);
  if (transient != nullptr) {
    // Not a name that does not resolve, nor TLS: trying again changes nothing.
    *transient = rc == CURLE_COULDNT_CONNECT || rc == CURLE_OPERATION_TIMEDOUT ||
                 rc == CURLE_GOT_NOTHING || rc == CURLE_RECV_ERROR || rc == CURLE_SEND_ERROR ||
                 rc == CURLE_PARTIAL_FILE;
  }
  return with_url(CurlError(easy.get(), rc, detail, what, target_.host, options_.connect_timeout));
}

absl::StatusOr<HttpResponse> HttpClient::Send(const std::string& method, const std::string& path,
                                              const std::string& body,
                                              const std::vector<std::string>& headers,
                                              HttpCancel* cancel) {
  const Clock::time_point deadline = Clock::now() + options_.retry_for;
  std::chrono::milliseconds backoff = options_.retry_backoff;
  while (true) {
    HttpResponse response;
    bool transient = false;
    absl::Status sent = Perform(method, path, body, options_.read_timeout, cancel, &response,
                                [&](const std::string& piece) {
                                  const uint64_t max = options_.max_body_bytes;
                                  if (max == 0) {
                                    response.body += piece;
                                    return true;
                                  }
                                  response.body.append(
                                      piece, 0, std::min<uint64_t>(piece.size(),
                                                                   max - response.body.size()));
                                  return response.body.size() < max;
                                },
                                headers, &transient);
    std::chrono::milliseconds wait = backoff;
    if (sent.ok()) {
      const int s = response.status;
      if (s != 429 && s != 500 && s != 502 && s != 503 && s != 504) return response;
      auto after = response.headers.find("retry-after");
      int64_t seconds = 0;
      if (after != response.headers.end() && absl::SimpleAtoi(after->second, &seconds) &&
          seconds >= 0) {
        wait = std::chrono::seconds(seconds);
      }
    } else if (!transient) {
      return sent;
    }
    // A wait that would end past the deadline would only delay the same
    // error: the caller has its own plans for it.
    if (Clock::now() + wait >= deadline) {
      if (!sent.ok()) return sent;
      return response;
    }
    if (cancel != nullptr) {
      pollfd p{cancel->fd(), POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(wait.count())) > 0) {
        return absl::CancelledError(absl::StrCat(method, " ", Url(path), ": cancelled"));
      }
    } else {
      std::this_thread::sleep_for(wait);
    }
    backoff = std::min(backoff * 2, options_.retry_max_backoff);
  }
}

absl::StatusOr<std::string> HttpClient::Call(const std::string& method, const std::string& path,
                                             const std::string& body) {
  DEEPNEX_ASSIGN_OR_RETURN(HttpResponse response, Send(method, path, body));
  if (response.status < 200 || response.status >= 300) return ErrorFor(method, path, response);
  return std::move(response.body);
}

absl::Status HttpClient::Stream(const std::string& method, const std::string& path,
                                const std::string& body,
                                const std::function<bool(const std::string&)>& sink,
                                std::chrono::milliseconds read_timeout, HttpCancel* cancel) {
  HttpResponse head;
  auto ok = [&head] { return head.status >= 200 && head.status < 300; };
  DEEPNEX_RETURN_IF_ERROR(Perform(method, path, body, read_timeout, cancel, &head,
                                  [&](const std::string& piece) {
                                    if (ok()) return sink(piece);
                                    head.body += piece;
                                    return head.body.size() < 64 * 1024;
                                  }));
  return ok() ? absl::OkStatus() : ErrorFor(method, path, head);
}

absl::Status HttpClient::ErrorFor(const std::string& method, const std::string& path,
                                  const HttpResponse& response) const {
  // Docker and Kubernetes both put the reason in a JSON "message".
  nlohmann::json json = nlohmann::json::parse(response.body, nullptr, /*allow_exceptions=*/false);
  std::string message = JsonValue<std::string>(json, "message", "");
  if (message.empty()) message = std::string(absl::StripAsciiWhitespace(response.body.substr(0, 300)));
  return absl::Status(CodeForHttpStatus(response.status),
                      absl::StrCat(method, " ", Url(path), ": HTTP ", response.status,
                                   message.empty() ? "" : ": ", message));
}

const nlohmann::json& JsonField(const nlohmann::json& j, const std::string& key) {
  static const nlohmann::json* const kNull = new nlohmann::json();
  if (!j.is_object()) return *kNull;
  auto it = j.find(key);
  return it == j.end() ? *kNull : *it;
}

std::string UrlEncode(const std::string& text) {
  static const char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : text) {
    if (absl::ascii_isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

}  // namespace deepnex::launch
