#include "core/net.h"

#include <arpa/inet.h>
#include <stdlib.h>

#include <string>

#include "test_matchers.h"

namespace deepnex {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::testing::HasSubstr;

// Unsets a variable for one test and puts it back.
class ScopedUnset {
 public:
  explicit ScopedUnset(const char* name) : name_(name) {
    const char* v = getenv(name);
    if (v != nullptr) saved_ = v, had_ = true;
    unsetenv(name);
  }
  ~ScopedUnset() {
    if (had_) setenv(name_, saved_.c_str(), 1);
  }

 private:
  const char* name_;
  std::string saved_;
  bool had_ = false;
};

TEST(Net, JoinAndSplitHostPort) {
  EXPECT_EQ(JoinHostPort("10.77.0.11", 7070), "10.77.0.11:7070");
  EXPECT_EQ(JoinHostPort("::1", 7070), "[::1]:7070");
  EXPECT_EQ(JoinHostPort("[::1]", 7070), "[::1]:7070");
  EXPECT_EQ(HostOf("n1:7070"), "n1");
  EXPECT_EQ(HostOf("[::1]:7070"), "::1");
  EXPECT_EQ(HostOf("n1"), "n1");
}

TEST(Net, WildcardAndLoopbackHosts) {
  for (const char* h : {"", "0.0.0.0", "::", "[::]"}) EXPECT_TRUE(IsWildcardHost(h)) << h;
  for (const char* h : {"127.0.0.1", "10.77.0.11", "n1"}) EXPECT_FALSE(IsWildcardHost(h)) << h;
  for (const char* h : {"127.0.0.1", "127.1.2.3", "localhost", "::1"}) {
    EXPECT_TRUE(IsLoopbackHost(h)) << h;
  }
  EXPECT_FALSE(IsLoopbackHost("10.77.0.11"));
}

// The address an IPv4 or IPv6 literal parses to, as a sockaddr.
sockaddr_storage Parse(const std::string& text) {
  sockaddr_storage s{};
  if (text.find(':') == std::string::npos) {
    auto* in = reinterpret_cast<sockaddr_in*>(&s);
    in->sin_family = AF_INET;
    EXPECT_EQ(inet_pton(AF_INET, text.c_str(), &in->sin_addr), 1) << text;
  } else {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&s);
    in6->sin6_family = AF_INET6;
    EXPECT_EQ(inet_pton(AF_INET6, text.c_str(), &in6->sin6_addr), 1) << text;
  }
  return s;
}

std::string NonPublic(const std::string& text) {
  sockaddr_storage s = Parse(text);
  return NonPublicAddress(reinterpret_cast<const sockaddr*>(&s));
}

TEST(Net, NonPublicAddressesAreNamedAndPublicOnesAreNot) {
  for (const char* text : {"127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1"}) {
    EXPECT_EQ(NonPublic(text), "a loopback address") << text;
  }
  for (const char* text : {"10.77.0.11", "172.16.0.1", "172.31.255.255", "192.168.1.1",
                           "::ffff:10.0.0.1", "64:ff9b::c0a8:101"}) {
    EXPECT_EQ(NonPublic(text), "a private address (RFC 1918)") << text;
  }
  EXPECT_EQ(NonPublic("169.254.169.254"), "a link-local address");  // cloud metadata
  EXPECT_EQ(NonPublic("fe80::1"), "a link-local address");
  EXPECT_EQ(NonPublic("fd00::1"), "a private address (unique local, fc00::/7)");
  EXPECT_EQ(NonPublic("0.0.0.0"), "an unspecified address (\"this network\")");
  EXPECT_EQ(NonPublic("::"), "an unspecified address");
  EXPECT_EQ(NonPublic("100.64.0.1"), "a shared address (carrier-grade NAT, RFC 6598)");
  EXPECT_EQ(NonPublic("224.0.0.1"), "a multicast address");
  EXPECT_EQ(NonPublic("255.255.255.255"), "a reserved address (240.0.0.0/4 or broadcast)");
  for (const char* text : {"8.8.8.8", "172.32.0.1", "172.15.255.255", "192.169.0.1",
                           "100.128.0.1", "2606:4700::1111", "::ffff:8.8.8.8"}) {
    EXPECT_EQ(NonPublic(text), "") << text;
  }
  sockaddr_storage s = Parse("2001:db8::1");
  EXPECT_EQ(AddressText(reinterpret_cast<const sockaddr*>(&s)), "2001:db8::1");
}

TEST(Net, ResolvesNamesWithTheSystemResolver) {
  // "localhost" comes from /etc/hosts, which gRPC's c-ares resolver skips.
  ASSERT_OK_AND_ASSIGN(sockaddr_in a, ResolveIPv4("localhost", 7));
  EXPECT_EQ(ntohl(a.sin_addr.s_addr), 0x7f000001u);
  EXPECT_EQ(ntohs(a.sin_port), 7);
  EXPECT_THAT(ResolveIPv4("deepnex-no-such-host.invalid", 7),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("cannot resolve host \"deepnex-no-such-host.invalid\"")));
  const char* resolver = getenv("GRPC_DNS_RESOLVER");
  ASSERT_NE(resolver, nullptr);
  EXPECT_STREQ(resolver, "native");
}

TEST(Net, RouteToLoopbackIsLoopbackAndPrimaryIsNot) {
  EXPECT_EQ(RouteSourceAddress("127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(RouteSourceAddress("deepnex-no-such-host.invalid"), "");
  // A loopback peer says nothing about which address other hosts reach.
  const std::string primary = PrimaryAddress();
  EXPECT_EQ(PrimaryAddress("127.0.0.1"), primary);
  EXPECT_FALSE(IsWildcardHost(primary));
  // 127.0.0.1 only on a machine without another address.
  ASSERT_OK_AND_ASSIGN(sockaddr_in a, ResolveIPv4(primary, 0));
  EXPECT_NE(a.sin_addr.s_addr, htonl(INADDR_ANY));
}

TEST(Net, AdvertisedAddress) {
  ScopedUnset store("DEEPNEX_STORE_ADDR");
  ScopedUnset central("DEEPNEX_CENTRAL");
  EXPECT_EQ(AdvertisedAddress("127.0.0.1:0", "", 4242), "127.0.0.1:4242");
  EXPECT_EQ(AdvertisedAddress("0.0.0.0:0", "", 4242), PrimaryAddress() + ":4242");
  EXPECT_EQ(AdvertisedAddress("[::]:0", "", 4242), PrimaryAddress() + ":4242");
  EXPECT_EQ(AdvertisedAddress("0.0.0.0:0", "10.77.0.11", 4242), "10.77.0.11:4242");
  EXPECT_EQ(AdvertisedAddress("0.0.0.0:0", "n1", 4242), "n1:4242");
  EXPECT_EQ(AdvertisedAddress("0.0.0.0:0", "::1", 4242), "[::1]:4242");
  // Towards the job's coordinator: a loopback one routes nowhere else.
  setenv("DEEPNEX_STORE_ADDR", "127.0.0.1:5000", 1);
  EXPECT_EQ(AdvertisedAddress("0.0.0.0:0", "", 4242), PrimaryAddress() + ":4242");
  unsetenv("DEEPNEX_STORE_ADDR");
}

TEST(Net, AdvertiseHostIsChecked) {
  EXPECT_THAT(ValidateAdvertiseHost("advertise", ""), IsOk());
  EXPECT_THAT(ValidateAdvertiseHost("advertise", "10.77.0.11"), IsOk());
  EXPECT_THAT(ValidateAdvertiseHost("advertise", "n1.cluster"), IsOk());
  EXPECT_THAT(ValidateAdvertiseHost("advertise", "[::1]"), IsOk());
  EXPECT_THAT(ValidateAdvertiseHost("advertise", "0.0.0.0"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "advertise \"0.0.0.0\": peers cannot dial a wildcard address"));
  EXPECT_THAT(ValidateAdvertiseHost("advertise_address", "10.77.0.11:7070"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "advertise_address \"10.77.0.11:7070\": a host name or an address, "
                       "without a port"));
  EXPECT_THAT(ValidateAdvertiseHost("advertise", "http://n1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "advertise \"http://n1\": a host name or an address, without a port"));
}

}  // namespace
}  // namespace deepnex
