// Host addresses: which address of this host its peers can dial, and name
// resolution with the system resolver. Private to libdeepnex.
//
// A server that listens on a wildcard (0.0.0.0, [::]) must not tell its peers
// "0.0.0.0:P": it advertises an address of this host instead, the one that
// routes towards the job's coordinator, or an address given by the caller.
#ifndef DEEPNEX_CORE_NET_H_
#define DEEPNEX_CORE_NET_H_

#include <netinet/in.h>
#include <sys/socket.h>

#include <string>

#include "deepnex/status.h"

namespace deepnex {

// host:port, the host in brackets when it is an IPv6 address.
std::string JoinHostPort(const std::string& host, int port);

// The host part of "HOST:PORT" ("[::1]:7" -> "::1"); the whole text when
// there is no port.
std::string HostOf(const std::string& address);

// True for 0.0.0.0, ::, [::] and the empty host: "every interface".
bool IsWildcardHost(const std::string& host);
// True for 127.0.0.0/8, ::1 and "localhost".
bool IsLoopbackHost(const std::string& host);

// Empty when `addr` (AF_INET or AF_INET6) is an address of the public
// internet; else what it is instead, e.g. "a loopback address", "a private
// address (RFC 1918)", "a link-local address" (cloud metadata services sit
// at 169.254.169.254). An IPv4-mapped IPv6 address is judged as its IPv4.
// What a server that connects where its users say (webhooks) checks before
// it connects.
std::string NonPublicAddress(const sockaddr* addr);

// The address (without port) of an AF_INET or AF_INET6 `addr`, as text.
std::string AddressText(const sockaddr* addr);

// An IPv4 address of `host` (a name or a dotted quad) with `port`, from the
// system resolver (getaddrinfo: /etc/hosts, then DNS). InvalidArgument
// naming the host when it does not resolve.
absl::StatusOr<sockaddr_in> ResolveIPv4(const std::string& host, int port);

// This host's name (gethostname).
std::string HostName();

// "hostname/boot id": equal for two processes of one boot of one host, so
// that same-host peers (collective ranks, parameter-server clients) know
// each other without comparing addresses (NAT, proxies, many interfaces).
std::string HostIdentity();

// This host's source address on the route to `peer` (a UDP "connect",
// nothing is sent); empty when `peer` does not resolve or has no route.
std::string RouteSourceAddress(const std::string& peer);

// This host's primary address: the source address of the route to `peer`
// when it is given and is not a loopback address, else the first
// non-loopback IPv4 address of an interface that is up, else 127.0.0.1.
std::string PrimaryAddress(const std::string& peer = "");

// The address peers dial for a server asked to listen on `listen_address`
// ("HOST:PORT") and bound to `port`: `advertise` (a host name or address)
// when given; else the listen host, unless it is a wildcard; then
// PrimaryAddress towards the job's coordinator ($DEEPNEX_STORE_ADDR) or
// deepnex-central ($DEEPNEX_CENTRAL), whichever is set.
std::string AdvertisedAddress(const std::string& listen_address, const std::string& advertise,
                              int port);

// InvalidArgument naming `field` when `host` cannot be advertised: not a
// name or an address, a wildcard, or with a port.
absl::Status ValidateAdvertiseHost(const std::string& field, const std::string& host);

}  // namespace deepnex

#endif  // DEEPNEX_CORE_NET_H_
