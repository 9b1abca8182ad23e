// The image catalog (src/launch/images.h) and registry references
// (images_registry.h), without a server.
#include <filesystem>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "launch/images.h"
#include "launch/images_registry.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::launch {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using test::IsOk;
using test::StatusIs;
using test::TempDir;

CatalogImage Owned(const std::string& owner, const std::string& name, const std::string& tag) {
  CatalogImage i;
  i.owner = owner;
  i.name = name;
  i.tag = tag;
  i.source = "host";
  return i;
}

std::vector<std::string> Names(const ImageCatalog& c, const ImageCaller& caller) {
  std::vector<std::string> out;
  for (const CatalogImage& i : c.List(caller)) {
    out.push_back(ImageCatalog::DisplayName(caller, i) + ":" + i.tag);
  }
  return out;
}

TEST(ImageRefTest, ParsesNamesTagsAndOwnersAndRefusesPaths) {
  auto r = ImageRef::Parse("alice/tools:v1", "image");
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->owner, "alice");
  EXPECT_EQ(r->name, "tools");
  EXPECT_EQ(r->tag, "v1");
  r = ImageRef::Parse("base", "image");
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->owner, "");
  EXPECT_EQ(r->tag, "latest");
  for (const char* bad : {"", "/", "/usr", "../x", "a/b/c", "x:", ":v1", "a b", "-x", "x:.t"}) {
    EXPECT_THAT(ImageRef::Parse(bad, "spec.image").status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(std::string("spec.image: \"") + bad + "\"")))
        << bad;
  }
}

TEST(ImageCatalogTest, UsersSeePresetsTheirOwnAndWhatIsSharedWithThem) {
  auto c = ImageCatalog::Open("");
  ASSERT_THAT(c.status(), IsOk());
  ASSERT_THAT((*c)->Put(Owned("", "base", "latest"), false), IsOk());
  ASSERT_THAT((*c)->Put(Owned("alice", "tools", "v1"), false), IsOk());
  ASSERT_THAT((*c)->Put(Owned("bob", "tools", "v1"), false), IsOk());
  const ImageCaller alice{"alice"}, bob{"bob"}, carol{"carol"}, root{"root", true};
  EXPECT_THAT(Names(**c, alice), ElementsAre("base:latest", "tools:v1"));
  EXPECT_THAT(Names(**c, root), ElementsAre("base:latest", "alice/tools:v1", "bob/tools:v1"));
  // A name without an owner is the caller's own first.
  EXPECT_EQ((*c)->Resolve(bob, "tools:v1")->owner, "bob");
  EXPECT_THAT((*c)->Resolve(bob, "alice/tools:v1").status(),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("image \"alice/tools:v1\": no such image that user bob may run")));
  ASSERT_THAT((*c)->Share(alice, "tools:v1", {"bob"}, false).status(), IsOk());
  EXPECT_THAT((*c)->Resolve(bob, "alice/tools:v1").status(), IsOk());
  EXPECT_THAT((*c)->Resolve(carol, "alice/tools:v1").status(),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT((*c)->Share(bob, "alice/tools:v1", {"carol"}, false).status(),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_EQ((*c)->Share(alice, "tools:v1", {}, true)->visibility(), "public");
  EXPECT_THAT((*c)->Resolve(carol, "alice/tools:v1").status(), IsOk());
  EXPECT_EQ((*c)->Unshare(alice, "tools:v1", {})->visibility(), "private");
  EXPECT_THAT((*c)->Resolve(bob, "alice/tools:v1").status(),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT((*c)->Put(Owned("alice", "tools", "v1"), false),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstr("image \"alice/tools:v1\" exists (force replaces it)")));
  EXPECT_THAT((*c)->Remove(alice, "base").status(),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT((*c)->Remove(root, "base").status(), IsOk());
  EXPECT_THAT(Names(**c, alice), ElementsAre("tools:v1"));
}

TEST(ImageCatalogTest, ChangesSurviveAReopen) {
  TempDir dir;
  const ImageCaller alice{"alice"}, bob{"bob"};
  double created = 0;
  {
    auto c = ImageCatalog::Open(dir.path() + "/images");
    ASSERT_THAT(c.status(), IsOk());
    ASSERT_THAT((*c)->Put(Owned("alice", "tools", "v1"), false), IsOk());
    ASSERT_THAT((*c)->Put(Owned("alice", "gone", "v1"), false), IsOk());
    ASSERT_THAT((*c)->Share(alice, "tools:v1", {"bob"}, false).status(), IsOk());
    ASSERT_THAT((*c)->Remove(alice, "gone:v1").status(), IsOk());
    created = (*c)->Resolve(alice, "tools:v1")->created;
    // One Ledger per directory: a second catalog there is refused.
    EXPECT_THAT(ImageCatalog::Open(dir.path() + "/images").status(),
                StatusIs(absl::StatusCode::kFailedPrecondition));
  }
  auto c = ImageCatalog::Open(dir.path() + "/images");
  ASSERT_THAT(c.status(), IsOk());
  EXPECT_THAT(Names(**c, alice), ElementsAre("tools:v1"));
  auto shared = (*c)->Resolve(bob, "alice/tools:v1");
  ASSERT_THAT(shared.status(), IsOk());
  EXPECT_THAT(shared->shared_with, ElementsAre("bob"));
  EXPECT_EQ(shared->created, created);
}

TEST(ImageCatalogTest, AReservationHoldsANameForOneCommitUntilFilledOrDropped) {
  TempDir dir;
  const ImageCaller alice{"alice"};
  {
    auto c = ImageCatalog::Open(dir.path() + "/images");
    ASSERT_THAT(c.status(), IsOk());
    auto held = (*c)->Reserve("alice", "tools", "v1");
    ASSERT_THAT(held.status(), IsOk());
    EXPECT_THAT((*c)->Reserve("alice", "tools", "v1").status(),
                StatusIs(absl::StatusCode::kAlreadyExists,
                         "name: image \"tools:v1\" of user alice is being committed by another "
                         "call; commit as a new tag (NAME:TAG)"));
    EXPECT_THAT((*c)->Put(Owned("alice", "tools", "v1"), /*force=*/true),
                StatusIs(absl::StatusCode::kAlreadyExists,
                         "image \"alice/tools:v1\" is being committed"));
    // Another user's, or another tag, is not held.
    EXPECT_THAT((*c)->Reserve("bob", "tools", "v1").status(), IsOk());
    EXPECT_THAT((*c)->Reserve("alice", "tools", "v2").status(), IsOk());
    EXPECT_THAT(Names(**c, alice), ElementsAre());
    EXPECT_THAT((*c)->Resolve(alice, "tools:v1").status(),
                StatusIs(absl::StatusCode::kNotFound));
    EXPECT_THAT(held->Fill(Owned("alice", "other", "v1")),
                StatusIs(absl::StatusCode::kInternal));
    // Dropped unfilled (a failed commit): the name is free again.
    { ImageCatalog::Reservation dropped = std::move(*held); }
    auto again = (*c)->Reserve("alice", "tools", "v1");
    ASSERT_THAT(again.status(), IsOk());
    ASSERT_THAT(again->Fill(Owned("alice", "tools", "v1")), IsOk());
    EXPECT_THAT(Names(**c, alice), ElementsAre("tools:v1"));
    EXPECT_THAT((*c)->Reserve("alice", "tools", "v1").status(),
                StatusIs(absl::StatusCode::kAlreadyExists,
                         "name: image \"tools:v1\" of user alice exists; commit as a new tag "
                         "(NAME:TAG) or remove it first"));
    // Held when central stops (dropped before its catalog, declared after
    // it): no record of it is written.
    auto pending = (*c)->Reserve("alice", "pending", "v1");
    ASSERT_THAT(pending.status(), IsOk());
  }
  auto c = ImageCatalog::Open(dir.path() + "/images");
  ASSERT_THAT(c.status(), IsOk());
  EXPECT_THAT(Names(**c, alice), ElementsAre("tools:v1"));
  EXPECT_THAT((*c)->Reserve("alice", "pending", "v1").status(), IsOk());
}

TEST(RegistryRefTest, ParsesPinnedDigests) {
  const std::string digest = "sha256:" + std::string(64, 'a');
  auto r = RegistryRef::Parse("docker://127.0.0.1:5000/alice/tools:v1@" + digest);
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->repo, "alice/tools");
  EXPECT_EQ(r->tag, "v1");
  EXPECT_EQ(r->digest, digest);
  EXPECT_EQ(r->ToString(), "docker://127.0.0.1:5000/alice/tools:v1@" + digest);
  EXPECT_EQ(r->Location(), "docker://127.0.0.1:5000/alice/tools@" + digest);
  r->digest.clear();
  EXPECT_EQ(r->Location(), "docker://127.0.0.1:5000/alice/tools:v1");
  EXPECT_THAT(RegistryRef::Parse("docker://h:1/a:v1@sha256:abc").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "image \"docker://h:1/a:v1@sha256:abc\": digest \"sha256:abc\" is not "
                       "sha256:<64 hex digits>"));
  EXPECT_THAT(RegistryRef::Parse("docker://h:1/a@" + digest).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("is not docker://HOST:PORT/REPO:TAG[@DIGEST]")));
}

TEST(RegistryRefTest, ParsesDockerReferences) {
  auto r = RegistryRef::Parse("docker://127.0.0.1:5000/alice/tools:v1");
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->registry, "127.0.0.1:5000");
  EXPECT_EQ(r->repo, "alice/tools");
  EXPECT_EQ(r->tag, "v1");
  EXPECT_EQ(r->ToString(), "docker://127.0.0.1:5000/alice/tools:v1");
  for (const char* bad : {"127.0.0.1:5000/a:v1", "docker://127.0.0.1:5000/a", "docker://h/:v1",
                          "docker:///a:v1"}) {
    EXPECT_THAT(RegistryRef::Parse(bad).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(std::string("image \"") + bad + "\"")))
        << bad;
  }
}

TEST(RegistryTest, AnUnreachableRegistryIsUnavailableNamingIt) {
  if (!std::filesystem::exists("/usr/bin/skopeo")) GTEST_SKIP() << "skopeo is not installed";
  // Port 1 on loopback: nothing listens there.
  RegistryRef ref{"127.0.0.1:1", "library/x", "v1", ""};
  EXPECT_THAT(RegistryDigest(ref).status(),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("image registry 127.0.0.1:1 is unreachable "
                                 "(docker://127.0.0.1:1/library/x:v1): ")));
}

}  // namespace
}  // namespace deepnex::launch
