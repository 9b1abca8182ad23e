#include "core/net.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace deepnex {
namespace {

// gRPC's default resolver (c-ares) asks DNS servers only and ignores
// /etc/hosts in the setups deepnex runs in (a cluster's node names, a
// network namespace's own hosts file), so a peer named by its hostname would
// not be found. The native resolver is getaddrinfo, as for every other
// program on the host. Set before gRPC starts (it reads the variable once),
// and only when the user has not chosen.
const bool kNativeResolver = [] {
  setenv("GRPC_DNS_RESOLVER", "native", /*overwrite=*/0);
  return true;
}();

}  // namespace

std::string JoinHostPort(const std::string& host, int port) {
  if (host.find(':') != std::string::npos && !absl::StartsWith(host, "[")) {
    return absl::StrCat("[", host, "]:", port);
  }
  return absl::StrCat(host, ":", port);
}

std::string HostOf(const std::string& address) {
  if (absl::StartsWith(address, "[")) {
    size_t close = address.find(']');
    return close == std::string::npos ? address : address.substr(1, close - 1);
  }
  size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

bool IsWildcardHost(const std::string& host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]";
}

bool IsLoopbackHost(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" ||
         absl::StartsWith(host, "127.");
}

namespace {

// What an IPv4 address (host byte order) is when it is not public; empty
// when it is.
std::string NonPublicIPv4(uint32_t a) {
  auto in = [a](uint32_t net, int bits) {
    return bits == 0 || (a >> (32 - bits)) == (net >> (32 - bits));
  };
  if (in(0x7f000000, 8)) return "a loopback address";
  if (in(0x00000000, 8)) return "an unspecified address (\"this network\")";
  if (in(0x0a000000, 8) || in(0xac100000, 12) || in(0xc0a80000, 16)) {
    return "a private address (RFC 1918)";
  }
  if (in(0x64400000, 10)) return "a shared address (carrier-grade NAT, RFC 6598)";
  if (in(0xa9fe0000, 16)) return "a link-local address";
  if (in(0xc0000000, 24) || in(0xc0000200, 24) || in(0xc6336400, 24) || in(0xcb007100, 24) ||
      in(0xc6120000, 15)) {
    return "a reserved address (documentation or benchmarking)";
  }
  if (in(0xe0000000, 4)) return "a multicast address";
  if (in(0xf0000000, 4)) return "a reserved address (240.0.0.0/4 or broadcast)";
  return "";
}

}  // namespace

std::string NonPublicAddress(const sockaddr* addr) {
  if (addr->sa_family == AF_INET) {
    return NonPublicIPv4(ntohl(reinterpret_cast<const sockaddr_in*>(addr)->sin_addr.s_addr));
  }
  if (addr->sa_family != AF_INET6) return "not an IP address";
  const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr;
  const uint8_t* b = a.s6_addr;
  // The IPv4 address in the last 4 bytes (mapped, compatible, NAT64).
  auto embedded_ipv4 = [b] {
    return NonPublicIPv4(uint32_t{b[12]} << 24 | uint32_t{b[13]} << 16 | uint32_t{b[14]} << 8 |
                         b[15]);
  };
  if (IN6_IS_ADDR_UNSPECIFIED(&a)) return "an unspecified address";
  if (IN6_IS_ADDR_LOOPBACK(&a)) return "a loopback address";
  if (IN6_IS_ADDR_V4MAPPED(&a) || IN6_IS_ADDR_V4COMPAT(&a)) return embedded_ipv4();
  if ((b[0] & 0xfe) == 0xfc) return "a private address (unique local, fc00::/7)";
  if (IN6_IS_ADDR_LINKLOCAL(&a)) return "a link-local address";
  if (IN6_IS_ADDR_SITELOCAL(&a)) return "a site-local address";
  if (IN6_IS_ADDR_MULTICAST(&a)) return "a multicast address";
  // NAT64 (64:ff9b::/96) carries an IPv4 address: judged as that one.
  static const uint8_t kNat64[12] = {0, 0x64, 0xff, 0x9b};
  if (std::memcmp(b, kNat64, 12) == 0) return embedded_ipv4();
  if (b[0] == 0x20 && b[1] == 0x01 && b[2] == 0x0d && b[3] == 0xb8) {
    return "a reserved address (documentation, 2001:db8::/32)";
  }
  return "";
}

std::string AddressText(const sockaddr* addr) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (addr->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(addr)->sin_addr, text, sizeof(text));
  } else if (addr->sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr, text,
              sizeof(text));
  }
  return text;
}

absl::StatusOr<sockaddr_in> ResolveIPv4(const std::string& host, int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) == 1) return addr;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve host \"", host, "\": ", gai_strerror(rc)));
  }
  addr.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return addr;
}

std::string RouteSourceAddress(const std::string& peer) {
  auto addr = ResolveIPv4(peer, 9);
  if (!addr.ok()) return "";
  int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  std::string out;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    char text[INET_ADDRSTRLEN];
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text)) != nullptr) {
      out = text;
    }
  }
  close(fd);
  return out;
}

std::string PrimaryAddress(const std::string& peer) {
  if (!peer.empty() && !IsLoopbackHost(peer) && !IsWildcardHost(peer)) {
    std::string routed = RouteSourceAddress(peer);
    if (!routed.empty() && !IsLoopbackHost(routed)) return routed;
  }
  std::string first;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) == 0) {
    for (ifaddrs* i = list; i != nullptr && first.empty(); i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
      if ((i->ifa_flags & IFF_UP) == 0 || (i->ifa_flags & IFF_LOOPBACK) != 0) continue;
      char text[INET_ADDRSTRLEN];
      const auto* in = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
      if (inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) != nullptr) first = text;
    }
    freeifaddrs(list);
  }
  return first.empty() ? "127.0.0.1" : first;
}

std::string AdvertisedAddress(const std::string& listen_address, const std::string& advertise,
                              int port) {
  if (!advertise.empty()) return JoinHostPort(advertise, port);
  const std::string host = HostOf(listen_address);
  if (!IsWildcardHost(host)) return JoinHostPort(host, port);
  std::string peer;
  for (const char* var : {"DEEPNEX_STORE_ADDR", "DEEPNEX_CENTRAL"}) {
    const char* v = getenv(var);
    if (v != nullptr && *v != '\0') {
      peer = HostOf(v);
      break;
    }
  }
  return JoinHostPort(PrimaryAddress(peer), port);
}

absl::Status ValidateAdvertiseHost(const std::string& field, const std::string& host) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(field, " \"", host, "\": ", why));
  };
  if (host.empty()) return absl::OkStatus();
  std::string bare = host;
  if (absl::StartsWith(bare, "[") && absl::EndsWith(bare, "]")) {
    bare = bare.substr(1, bare.size() - 2);
  }
  in6_addr v6;
  if (bare.find(':') != std::string::npos && inet_pton(AF_INET6, bare.c_str(), &v6) != 1) {
    return bad("a host name or an address, without a port");
  }
  if (IsWildcardHost(bare)) return bad("peers cannot dial a wildcard address");
  for (char c : bare) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '.' || c == '_' || c == ':';
    if (!ok) return bad("a host name or an address, without a port");
  }
  return absl::OkStatus();
}

std::string HostName() {
  char name[256] = {0};
  gethostname(name, sizeof(name) - 1);
  return name;
}

std::string HostIdentity() {
  std::string boot;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot);
  return absl::StrCat(HostName(), "/", boot);
}

}  // namespace deepnex
