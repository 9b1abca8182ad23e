#include "deepnex/auth.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <tuple>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kMissing[] =
    "missing bearer token (authorization metadata); give one with --token, "
    "--token-file or $DEEPNEX_TOKEN (token= or token_file= in code)";

// A file under the test's temporary directory, removed at the end.
class TempFile {
 public:
  explicit TempFile(const std::string& contents) {
    path_ = ::testing::TempDir() + "deepnex_auth_test_" +
            std::to_string(::getpid()) + "_" + std::to_string(counter_++);
    std::ofstream(path_, std::ios::binary) << contents;
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  std::string path_;
};

TEST(TokenTableTest, EmptyTableAllowsEverything) {
  TokenTable table;
  EXPECT_FALSE(table.enabled());
  absl::StatusOr<Identity> id = table.Authenticate("", "job", true);
  ASSERT_THAT(id, IsOk());
  EXPECT_EQ(id->name, "anonymous");
  EXPECT_EQ(id->role, AuthRole::kAdmin);
  EXPECT_THAT(table.Authenticate("Bearer whatever"), IsOk());
}

TEST(TokenTableTest, SingleToken) {
  TokenTable table = TokenTable::Single("s3cret", "alice");
  EXPECT_TRUE(table.enabled());
  absl::StatusOr<Identity> id = table.Authenticate("Bearer s3cret");
  ASSERT_THAT(id, IsOk());
  EXPECT_EQ(id->name, "alice");
  EXPECT_EQ(id->role, AuthRole::kUser);
  EXPECT_EQ(id->job, "");
  // The scheme is case-insensitive and surrounding spaces are ignored.
  EXPECT_THAT(table.Authenticate("bearer s3cret"), IsOk());
  EXPECT_THAT(table.Authenticate("BEARER   s3cret  "), IsOk());
  // An unscoped token may act on any job.
  EXPECT_THAT(table.Authenticate("Bearer s3cret", "any-job"), IsOk());
  EXPECT_EQ(TokenTable::Single("s3cret").Authenticate("Bearer s3cret")->name,
            "user");
}

TEST(TokenTableTest, SingleWithAnEmptyTokenIsDisabled) {
  EXPECT_FALSE(TokenTable::Single("").enabled());
  EXPECT_FALSE(TokenTable::Single("a b").enabled());
}

TEST(TokenTableTest, MissingToken) {
  TokenTable table = TokenTable::Single("s3cret");
  for (const char* authorization :
       {"", "   ", "Bearer", "Bearer ", "Bearer    "}) {
    EXPECT_THAT(table.Authenticate(authorization),
                StatusIs(absl::StatusCode::kUnauthenticated, kMissing))
        << '"' << authorization << '"';
  }
}

TEST(TokenTableTest, NotABearerHeader) {
  TokenTable table = TokenTable::Single("s3cret");
  for (const char* authorization :
       {"s3cret", "Basic s3cret", "Bearers3cret", "Token s3cret"}) {
    EXPECT_THAT(table.Authenticate(authorization),
                StatusIs(absl::StatusCode::kUnauthenticated,
                         "the authorization is not \"Bearer <token>\""))
        << authorization;
  }
}

TEST(TokenTableTest, InvalidToken) {
  TokenTable table = TokenTable::Single("s3cret");
  for (const char* authorization :
       {"Bearer s3cre", "Bearer s3cret2", "Bearer S3CRET", "Bearer x",
        "Bearer s3cret s3cret"}) {
    EXPECT_THAT(table.Authenticate(authorization),
                StatusIs(absl::StatusCode::kUnauthenticated, "invalid token"))
        << authorization;
  }
}

TEST(TokenTableTest, JobScope) {
  TokenTable table;
  ASSERT_THAT(table.Add("tok-a", Identity{"job-a", AuthRole::kUser, "a"}),
              IsOk());
  EXPECT_THAT(table.Authenticate("Bearer tok-a", "a"), IsOk());
  EXPECT_THAT(table.Authenticate("Bearer tok-a"), IsOk());
  absl::StatusOr<Identity> other = table.Authenticate("Bearer tok-a", "b");
  EXPECT_THAT(other, StatusIs(absl::StatusCode::kPermissionDenied,
                              "the token of \"job-a\" is for job \"a\", not "
                              "job \"b\""));
  EXPECT_THAT(other.status().message(), Not(HasSubstr("tok-a")));
}

// What a job-scoped identity may act on: only what belongs to its job.
TEST(CheckJobTest, AJobTokenReachesOnlyItsJob) {
  const Identity scoped{"alice", AuthRole::kUser, "j1"};
  EXPECT_THAT(CheckJob(scoped, "j1", "allocation a1"), IsOk());
  EXPECT_THAT(CheckJob(scoped, "j2", "allocation a1"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       "the token of \"alice\" is for job \"j1\"; allocation a1 is of "
                       "job \"j2\""));
  EXPECT_THAT(CheckJob(scoped, "", "container \"w0\""),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       "the token of \"alice\" is for job \"j1\"; container \"w0\" is of "
                       "no job"));
  const Identity plain{"alice", AuthRole::kUser, ""};
  EXPECT_THAT(CheckJob(plain, "j2", "allocation a1"), IsOk());
  EXPECT_THAT(CheckJob(plain, "", "allocation a1"), IsOk());
}

TEST(TokenTableTest, AdminOnly) {
  TokenTable table;
  ASSERT_THAT(table.Add("user-tok", Identity{"bob"}), IsOk());
  ASSERT_THAT(table.Add("admin-tok", Identity{"root", AuthRole::kAdmin}),
              IsOk());
  EXPECT_THAT(table.Authenticate("Bearer user-tok", "", true),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       "\"bob\" is not an admin (this call requires the "
                       "admin role)"));
  absl::StatusOr<Identity> admin =
      table.Authenticate("Bearer admin-tok", "", true);
  ASSERT_THAT(admin, IsOk());
  EXPECT_EQ(admin->name, "root");
  EXPECT_EQ(admin->role, AuthRole::kAdmin);
  EXPECT_EQ(table.Authenticate("Bearer user-tok")->name, "bob");
}

TEST(TokenTableTest, AddRefusesBadEntries) {
  TokenTable table;
  EXPECT_THAT(table.Add("", Identity{"x"}),
              StatusIs(absl::StatusCode::kInvalidArgument, "empty token"));
  EXPECT_THAT(table.Add("a b", Identity{"x"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "the token for \"x\" contains whitespace"));
  EXPECT_THAT(table.Add("tok", Identity{""}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "a token needs a non-empty name"));
  ASSERT_THAT(table.Add("tok", Identity{"x"}), IsOk());
  EXPECT_THAT(table.Add("tok", Identity{"y"}),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       "the token for \"y\" is already in the table (for "
                       "\"x\")"));
  EXPECT_EQ(table.Authenticate("Bearer tok")->name, "x");
}

TEST(TokenTableTest, FromFileSingleToken) {
  TempFile file("  # the job's token\n\n  only-token  \n");
  ASSERT_OK_AND_ASSIGN(TokenTable table, TokenTable::FromFile(file.path()));
  ASSERT_OK_AND_ASSIGN(Identity id, table.Authenticate("Bearer only-token"));
  EXPECT_EQ(id.name, "user");
  EXPECT_EQ(id.role, AuthRole::kUser);
}

TEST(TokenTableTest, FromFileTable) {
  TempFile file(
      "# token name role [job]\n"
      "t-alice alice user\n"
      "t-root  root  admin   # operators\n"
      "\n"
      "t-job   mnist user  mnist-42\r\n");
  ASSERT_OK_AND_ASSIGN(TokenTable table, TokenTable::FromFile(file.path()));
  EXPECT_EQ(table.Authenticate("Bearer t-alice")->name, "alice");
  EXPECT_EQ(table.Authenticate("Bearer t-root", "", true)->role,
            AuthRole::kAdmin);
  ASSERT_OK_AND_ASSIGN(Identity job,
                       table.Authenticate("Bearer t-job", "mnist-42"));
  EXPECT_EQ(job.job, "mnist-42");
  EXPECT_THAT(table.Authenticate("Bearer t-job", "other"),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(table.Authenticate("Bearer t-alice", "", true),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(table.Authenticate("Bearer #"),
              StatusIs(absl::StatusCode::kUnauthenticated, "invalid token"));
}

// A node token (deepnex-agent's) acts only as its node: every call but the
// agents' service refuses it, admin calls included.
TEST(TokenTableTest, NodeTokenActsOnlyAsItsNode) {
  TempFile file("t-h2 h2 node\nt-alice alice user\n");
  ASSERT_OK_AND_ASSIGN(TokenTable table, TokenTable::FromFile(file.path()));
  EXPECT_THAT(table.Authenticate("Bearer t-h2"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       "the token of \"h2\" is a node token: it may only act "
                       "as its node (deepnex-agent)"));
  EXPECT_THAT(table.Authenticate("Bearer t-h2", "", true),
              StatusIs(absl::StatusCode::kPermissionDenied));
  ASSERT_OK_AND_ASSIGN(Identity node,
                       table.Authenticate("Bearer t-h2", "", false, true));
  EXPECT_EQ(node.name, "h2");
  EXPECT_EQ(node.role, AuthRole::kNode);
  EXPECT_EQ(table.Authenticate("Bearer t-alice", "", false, true)->role,
            AuthRole::kUser);
  TempFile with_job("t-h2 h2 node j1\n");
  EXPECT_THAT(TokenTable::FromFile(with_job.path()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::HasSubstr("line 1: a node token has no job, got \"j1\"")));
}

TEST(TokenTableTest, FromFileMalformed) {
  struct Case {
    const char* contents;
    const char* message;  // after "token file \"PATH\" "
    absl::StatusCode code;
  };
  const Case cases[] = {
      {"a alice user\nsecret-xyz bob\n",
       "line 2: expected \"TOKEN NAME ROLE [JOB]\", got 2 fields",
       absl::StatusCode::kInvalidArgument},
      {"a alice user\nsecret-xyz\n",
       "line 2: expected \"TOKEN NAME ROLE [JOB]\", got 1 field",
       absl::StatusCode::kInvalidArgument},
      {"secret-xyz bob user job extra\n",
       "line 1: expected \"TOKEN NAME ROLE [JOB]\", got 5 fields",
       absl::StatusCode::kInvalidArgument},
      {"\n\nsecret-xyz bob root\n",
       "line 3: role \"root\" is not user, admin or node",
       absl::StatusCode::kInvalidArgument},
      {"secret-xyz bob user\nsecret-xyz carol admin\n",
       "line 2: the token for \"carol\" is already in the table (for \"bob\")",
       absl::StatusCode::kAlreadyExists},
      {"", "holds no token", absl::StatusCode::kInvalidArgument},
      {"# nothing\n\n   \n", "holds no token",
       absl::StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    TempFile file(c.contents);
    absl::StatusOr<TokenTable> table = TokenTable::FromFile(file.path());
    std::string prefix = "token file \"" + file.path() + "\"";
    EXPECT_THAT(table, StatusIs(c.code, prefix + " " + c.message))
        << c.contents;
    EXPECT_THAT(table.status().message(), Not(HasSubstr("secret-xyz")));
  }
}

TEST(TokenTableTest, FromFileMissing) {
  std::string path = ::testing::TempDir() + "deepnex_no_such_token_file";
  EXPECT_THAT(
      TokenTable::FromFile(path),
      StatusIs(absl::StatusCode::kNotFound,
               "token file \"" + path + "\": No such file or directory"));
}

TEST(TokenTableTest, FromOptions) {
  ASSERT_OK_AND_ASSIGN(TokenTable none, TokenTable::FromOptions("", ""));
  EXPECT_FALSE(none.enabled());

  ASSERT_OK_AND_ASSIGN(TokenTable one, TokenTable::FromOptions("tok", ""));
  EXPECT_TRUE(one.enabled());
  EXPECT_EQ(one.Authenticate("Bearer tok")->name, "user");

  TempFile file("t-root root admin\n");
  ASSERT_OK_AND_ASSIGN(TokenTable from_file,
                       TokenTable::FromOptions("", file.path()));
  EXPECT_THAT(from_file.Authenticate("Bearer t-root", "", true), IsOk());

  absl::StatusOr<TokenTable> both =
      TokenTable::FromOptions("secret-xyz", file.path());
  EXPECT_THAT(both, StatusIs(absl::StatusCode::kInvalidArgument,
                             "a token and a token file (\"" + file.path() +
                                 "\") were both given; give one"));
  EXPECT_THAT(TokenTable::FromOptions("a b", ""),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("whitespace"), Not(HasSubstr("a b")))));
}

TEST(ResolveClientTokenTest, TokenOrFile) {
  EXPECT_EQ(*ResolveClientToken("", ""), "");
  EXPECT_EQ(*ResolveClientToken("tok", ""), "tok");
  EXPECT_EQ(*ResolveClientToken("  tok\n", ""), "tok");

  TempFile file("  from-file  \nsecond line\n");
  EXPECT_EQ(*ResolveClientToken("", file.path()), "from-file");
  TempFile no_newline("t");
  EXPECT_EQ(*ResolveClientToken("", no_newline.path()), "t");

  EXPECT_THAT(ResolveClientToken("secret-xyz", file.path()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("were both given"),
                             Not(HasSubstr("secret-xyz")))));
}

TEST(ResolveClientTokenTest, BadFiles) {
  TempFile empty("");
  EXPECT_THAT(
      ResolveClientToken("", empty.path()),
      StatusIs(absl::StatusCode::kInvalidArgument,
               "token file \"" + empty.path() + "\": the first line is empty"));
  TempFile table("secret-xyz alice user\n");
  absl::StatusOr<std::string> token = ResolveClientToken("", table.path());
  EXPECT_THAT(token, StatusIs(absl::StatusCode::kInvalidArgument,
                              HasSubstr("the first line has more than one "
                                        "field")));
  EXPECT_THAT(token.status().message(), Not(HasSubstr("secret-xyz")));
  std::string missing = ::testing::TempDir() + "deepnex_no_such_token_file";
  EXPECT_THAT(ResolveClientToken("", missing),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(missing)));
  // A directory read as an empty file: "the first line is empty".
  const std::string dir = ::testing::TempDir();
  EXPECT_THAT(ResolveClientToken("", dir),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "token file \"" + dir + "\": is a directory, not a file"));
}

TEST(TokenTableTest, AuthErrorsNeverContainTheToken) {
  TokenTable table;
  ASSERT_THAT(table.Add("secret-xyz", Identity{"bob", AuthRole::kUser, "a"}),
              IsOk());
  for (const auto& [authorization, job, admin] :
       {std::tuple<std::string, std::string, bool>{"Bearer secret-xyz", "b",
                                                   false},
        {"Bearer secret-xyz", "a", true},
        {"Bearer secret-xyzz", "", false},
        {"Basic secret-xyz", "", false}}) {
    absl::StatusOr<Identity> id = table.Authenticate(authorization, job, admin);
    EXPECT_THAT(id, Not(IsOk()));
    EXPECT_THAT(id.status().message(), Not(HasSubstr("secret")));
  }
}

}  // namespace
}  // namespace deepnex
