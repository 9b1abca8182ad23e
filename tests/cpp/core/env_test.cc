#include "deepnex/env.h"

#include <cstdlib>
#include <map>
#include <optional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;
using ::testing::UnorderedElementsAre;

using Env = std::map<std::string, std::string>;

absl::StatusOr<Context> Parse(const Env& env) {
  return Context::FromLookup(
      [&env](const std::string& name) -> std::optional<std::string> {
        auto it = env.find(name);
        if (it == env.end()) return std::nullopt;
        return it->second;
      });
}

Env Minimal() {
  return {{"DEEPNEX_JOB_ID", "mnist-42"},
          {"DEEPNEX_ROLE", "worker"},
          {"DEEPNEX_RANK", "1"},
          {"DEEPNEX_WORLD_SIZE", "4"}};
}

Env With(Env env, const std::string& name, const std::string& value) {
  env[name] = value;
  return env;
}

Env Without(Env env, const std::string& name) {
  env.erase(name);
  return env;
}

TEST(ContextTest, MinimalEnvironmentGivesDefaults) {
  absl::StatusOr<Context> c = Parse(Minimal());
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->job_id, "mnist-42");
  EXPECT_EQ(c->role, Role::kWorker);
  EXPECT_EQ(c->rank, 1);
  EXPECT_EQ(c->world_size, 4);
  EXPECT_EQ(c->local_rank, 0);
  EXPECT_THAT(c->ps_addrs, IsEmpty());
  EXPECT_EQ(c->store_addr, "");
  EXPECT_EQ(c->token, "");
  EXPECT_EQ(c->cuda_visible_devices, "");
  EXPECT_EQ(c->nvidia_visible_devices, "");
  EXPECT_EQ(c->gpu_memory_limit, std::nullopt);
}

TEST(ContextTest, FullEnvironment) {
  Env env = Minimal();
  env["DEEPNEX_ROLE"] = "chief";
  env["DEEPNEX_RANK"] = "0";
  env["DEEPNEX_LOCAL_RANK"] = "3";
  env["DEEPNEX_PS_ADDRS"] = "ps-0:7000,10.0.0.2:7001,[::1]:65535";
  env["DEEPNEX_STORE_ADDR"] = "store:29500";
  env["DEEPNEX_TOKEN"] = "s3cret";
  env["CUDA_VISIBLE_DEVICES"] = "0,2";
  env["NVIDIA_VISIBLE_DEVICES"] = "GPU-aaaa,GPU-bbbb";
  env["DEEPNEX_GPU_MEMORY_LIMIT"] = "8GiB";
  env["UNRELATED"] = "ignored";
  absl::StatusOr<Context> c = Parse(env);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->role, Role::kChief);
  EXPECT_EQ(c->rank, 0);
  EXPECT_EQ(c->local_rank, 3);
  EXPECT_THAT(c->ps_addrs,
              ElementsAre("ps-0:7000", "10.0.0.2:7001", "[::1]:65535"));
  EXPECT_EQ(c->store_addr, "store:29500");
  EXPECT_EQ(c->token, "s3cret");
  EXPECT_EQ(c->cuda_visible_devices, "0,2");
  EXPECT_EQ(c->nvidia_visible_devices, "GPU-aaaa,GPU-bbbb");
  EXPECT_EQ(c->gpu_memory_limit, uint64_t{8} << 30);
}

TEST(ContextTest, Roles) {
  EXPECT_EQ(Parse(With(Minimal(), "DEEPNEX_ROLE", "ps"))->role, Role::kPs);
  EXPECT_EQ(Parse(With(Minimal(), "DEEPNEX_ROLE", "worker"))->role,
            Role::kWorker);
  EXPECT_STREQ(RoleName(Role::kWorker), "worker");
  EXPECT_STREQ(RoleName(Role::kPs), "ps");
  EXPECT_STREQ(RoleName(Role::kChief), "chief");
}

TEST(ContextTest, LastRankAndSingleProcess) {
  EXPECT_EQ(Parse(With(Minimal(), "DEEPNEX_RANK", "3"))->rank, 3);
  Env one =
      With(With(Minimal(), "DEEPNEX_RANK", "0"), "DEEPNEX_WORLD_SIZE", "1");
  EXPECT_THAT(Parse(one), IsOk());
}

TEST(ContextTest, EmptyOptionalVariablesCountAsUnset) {
  Env env = Minimal();
  for (const char* name :
       {"DEEPNEX_LOCAL_RANK", "DEEPNEX_PS_ADDRS", "DEEPNEX_STORE_ADDR",
        "DEEPNEX_TOKEN", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
        "DEEPNEX_GPU_MEMORY_LIMIT"}) {
    env[name] = "";
  }
  absl::StatusOr<Context> c = Parse(env);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->local_rank, 0);
  EXPECT_THAT(c->ps_addrs, IsEmpty());
  EXPECT_EQ(c->gpu_memory_limit, std::nullopt);
}

constexpr char kLauncher[] =
    "(the job environment is given by a deepnex launcher)";

TEST(ContextTest, MissingRequiredVariable) {
  for (const char* name : {"DEEPNEX_JOB_ID", "DEEPNEX_ROLE", "DEEPNEX_RANK",
                           "DEEPNEX_WORLD_SIZE"}) {
    EXPECT_THAT(Parse(Without(Minimal(), name)),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         std::string(name) + " is not set " + kLauncher))
        << name;
    EXPECT_THAT(Parse(With(Minimal(), name, "")),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         std::string(name) + " is set but empty " + kLauncher))
        << name;
  }
  EXPECT_THAT(Parse({}), StatusIs(absl::StatusCode::kInvalidArgument,
                                  HasSubstr("DEEPNEX_JOB_ID is not set")));
}

struct Bad {
  const char* name;
  const char* value;
  const char* message;  // the whole expected message
};

class ContextBadTest : public ::testing::TestWithParam<Bad> {};

TEST_P(ContextBadTest, NamesTheVariableAndTheValue) {
  const Bad& bad = GetParam();
  EXPECT_THAT(Parse(With(Minimal(), bad.name, bad.value)),
              StatusIs(absl::StatusCode::kInvalidArgument, bad.message));
}

INSTANTIATE_TEST_SUITE_P(
    Variables, ContextBadTest,
    ::testing::Values(
        Bad{"DEEPNEX_ROLE", "boss",
            "DEEPNEX_ROLE=\"boss\" is not a role (use worker, ps or chief)"},
        Bad{"DEEPNEX_ROLE", "Worker",
            "DEEPNEX_ROLE=\"Worker\" is not a role (use worker, ps or chief)"},
        Bad{"DEEPNEX_RANK", "x", "DEEPNEX_RANK=\"x\" is not an integer"},
        Bad{"DEEPNEX_RANK", "1.0", "DEEPNEX_RANK=\"1.0\" is not an integer"},
        Bad{"DEEPNEX_RANK", " 1", "DEEPNEX_RANK=\" 1\" is not an integer"},
        Bad{"DEEPNEX_RANK", "1 ", "DEEPNEX_RANK=\"1 \" is not an integer"},
        Bad{"DEEPNEX_RANK", "+1", "DEEPNEX_RANK=\"+1\" is not an integer"},
        Bad{"DEEPNEX_RANK", "0x1", "DEEPNEX_RANK=\"0x1\" is not an integer"},
        Bad{"DEEPNEX_RANK", "99999999999",
            "DEEPNEX_RANK=\"99999999999\" is out of range for an integer"},
        Bad{"DEEPNEX_RANK", "4",
            "DEEPNEX_RANK=\"4\" is out of range: must be 0 <= rank < "
            "DEEPNEX_WORLD_SIZE (4)"},
        Bad{"DEEPNEX_RANK", "-1",
            "DEEPNEX_RANK=\"-1\" is out of range: must be 0 <= rank < "
            "DEEPNEX_WORLD_SIZE (4)"},
        Bad{"DEEPNEX_WORLD_SIZE", "four",
            "DEEPNEX_WORLD_SIZE=\"four\" is not an integer"},
        Bad{"DEEPNEX_WORLD_SIZE", "0",
            "DEEPNEX_WORLD_SIZE=\"0\" must be at least 1"},
        Bad{"DEEPNEX_WORLD_SIZE", "-2",
            "DEEPNEX_WORLD_SIZE=\"-2\" must be at least 1"},
        Bad{"DEEPNEX_LOCAL_RANK", "a",
            "DEEPNEX_LOCAL_RANK=\"a\" is not an integer"},
        Bad{"DEEPNEX_LOCAL_RANK", "-1",
            "DEEPNEX_LOCAL_RANK=\"-1\" must not be negative"},
        Bad{"DEEPNEX_PS_ADDRS", "ps-0",
            "DEEPNEX_PS_ADDRS=\"ps-0\" has entry \"ps-0\", which has no port "
            "(expected host:port)"},
        Bad{"DEEPNEX_PS_ADDRS", "a:1,:7000",
            "DEEPNEX_PS_ADDRS=\"a:1,:7000\" has entry \":7000\", which has "
            "an empty host (expected host:port)"},
        Bad{"DEEPNEX_PS_ADDRS", "a:0",
            "DEEPNEX_PS_ADDRS=\"a:0\" has entry \"a:0\", which has port "
            "\"0\" (must be 1..65535)"},
        Bad{"DEEPNEX_PS_ADDRS", "a:65536",
            "DEEPNEX_PS_ADDRS=\"a:65536\" has entry \"a:65536\", which has "
            "port \"65536\" (must be 1..65535)"},
        Bad{"DEEPNEX_PS_ADDRS", "a:",
            "DEEPNEX_PS_ADDRS=\"a:\" has entry \"a:\", which has port \"\" "
            "(must be 1..65535)"},
        Bad{"DEEPNEX_PS_ADDRS", "a:http",
            "DEEPNEX_PS_ADDRS=\"a:http\" has entry \"a:http\", which has "
            "port \"http\" (must be 1..65535)"},
        Bad{"DEEPNEX_PS_ADDRS", "a:-5",
            "DEEPNEX_PS_ADDRS=\"a:-5\" has entry \"a:-5\", which has port "
            "\"-5\" (must be 1..65535)"},
        Bad{"DEEPNEX_PS_ADDRS", "::1:7000",
            "DEEPNEX_PS_ADDRS=\"::1:7000\" has entry \"::1:7000\", which has "
            "an IPv6 address without brackets (write [addr]:port)"},
        Bad{"DEEPNEX_PS_ADDRS", "a:1,,b:2",
            "DEEPNEX_PS_ADDRS=\"a:1,,b:2\" has an empty entry (number 2; "
            "expected host:port,host:port,...)"},
        Bad{"DEEPNEX_PS_ADDRS", "a:1,",
            "DEEPNEX_PS_ADDRS=\"a:1,\" has an empty entry (number 2; "
            "expected host:port,host:port,...)"},
        Bad{"DEEPNEX_PS_ADDRS", "a:1, b:2",
            "DEEPNEX_PS_ADDRS=\"a:1, b:2\" has entry \" b:2\", which has "
            "whitespace (expected host:port)"},
        Bad{"DEEPNEX_GPU_MEMORY_LIMIT", "12XB",
            "DEEPNEX_GPU_MEMORY_LIMIT: \"12XB\" is not a byte size (unknown "
            "unit \"XB\"; use B, KiB, MiB, GiB, TiB, PiB, EiB, K, M, G, T, "
            "P, E, KB, MB, GB, TB, PB or EB)"},
        Bad{"DEEPNEX_GPU_MEMORY_LIMIT", "-1G",
            "DEEPNEX_GPU_MEMORY_LIMIT: \"-1G\" is not a byte size "
            "(negative)"}));

TEST(ContextTest, ToEnvReproducesTheContext) {
  Env env = Minimal();
  env["DEEPNEX_LOCAL_RANK"] = "1";
  env["DEEPNEX_PS_ADDRS"] = "ps-0:7000,ps-1:7000";
  env["DEEPNEX_STORE_ADDR"] = "10.1.2.3:29500";
  env["DEEPNEX_TOKEN"] = "tok";
  env["CUDA_VISIBLE_DEVICES"] = "1";
  env["NVIDIA_VISIBLE_DEVICES"] = "GPU-1";
  env["DEEPNEX_GPU_MEMORY_LIMIT"] = "1.5GiB";
  ASSERT_OK_AND_ASSIGN(Context c, Parse(env));
  Env out = c.ToEnv();
  EXPECT_THAT(
      out,
      UnorderedElementsAre(
          Pair("DEEPNEX_JOB_ID", "mnist-42"), Pair("DEEPNEX_ROLE", "worker"),
          Pair("DEEPNEX_RANK", "1"), Pair("RANK", "1"),
          Pair("DEEPNEX_WORLD_SIZE", "4"), Pair("WORLD_SIZE", "4"),
          Pair("DEEPNEX_LOCAL_RANK", "1"), Pair("LOCAL_RANK", "1"),
          Pair("DEEPNEX_PS_ADDRS", "ps-0:7000,ps-1:7000"),
          Pair("DEEPNEX_STORE_ADDR", "10.1.2.3:29500"),
          Pair("MASTER_ADDR", "10.1.2.3"), Pair("MASTER_PORT", "29500"),
          Pair("DEEPNEX_TOKEN", "tok"), Pair("CUDA_VISIBLE_DEVICES", "1"),
          Pair("NVIDIA_VISIBLE_DEVICES", "GPU-1"),
          Pair("DEEPNEX_GPU_MEMORY_LIMIT", "1610612736")));
  ASSERT_OK_AND_ASSIGN(Context back, Parse(out));
  EXPECT_EQ(back.ToEnv(), out);
}

TEST(ContextTest, ToEnvOmitsEmptyFields) {
  Context c;
  c.job_id = "j";
  c.role = Role::kPs;
  EXPECT_THAT(c.ToEnv(),
              UnorderedElementsAre(
                  Pair("DEEPNEX_JOB_ID", "j"), Pair("DEEPNEX_ROLE", "ps"),
                  Pair("DEEPNEX_RANK", "0"), Pair("RANK", "0"),
                  Pair("DEEPNEX_WORLD_SIZE", "1"), Pair("WORLD_SIZE", "1"),
                  Pair("DEEPNEX_LOCAL_RANK", "0"), Pair("LOCAL_RANK", "0")));
}

TEST(ContextTest, ToEnvMasterFromStoreAddr) {
  Context c;
  c.job_id = "j";
  c.store_addr = "[fe80::1]:1234";
  Env env = c.ToEnv();
  EXPECT_EQ(env["MASTER_ADDR"], "fe80::1");
  EXPECT_EQ(env["MASTER_PORT"], "1234");
  // A store address that is not host:port is passed on, without MASTER_*.
  c.store_addr = "unix:/run/deepnex/store.sock";
  env = c.ToEnv();
  EXPECT_EQ(env["DEEPNEX_STORE_ADDR"], "unix:/run/deepnex/store.sock");
  EXPECT_EQ(env.count("MASTER_ADDR"), 0u);
  EXPECT_EQ(env.count("MASTER_PORT"), 0u);
}

TEST(ContextTest, FromEnvReadsTheProcessEnvironment) {
  const char* names[] = {"DEEPNEX_JOB_ID", "DEEPNEX_ROLE", "DEEPNEX_RANK",
                         "DEEPNEX_WORLD_SIZE", "DEEPNEX_GPU_MEMORY_LIMIT"};
  std::map<std::string, std::optional<std::string>> saved;
  for (const char* name : names) {
    const char* v = std::getenv(name);
    saved[name] = v ? std::optional<std::string>(v) : std::nullopt;
  }
  ::setenv("DEEPNEX_JOB_ID", "from-env", 1);
  ::setenv("DEEPNEX_ROLE", "ps", 1);
  ::setenv("DEEPNEX_RANK", "2", 1);
  ::setenv("DEEPNEX_WORLD_SIZE", "3", 1);
  ::setenv("DEEPNEX_GPU_MEMORY_LIMIT", "512M", 1);
  absl::StatusOr<Context> c = Context::FromEnv();
  ::unsetenv("DEEPNEX_RANK");
  absl::StatusOr<Context> missing = Context::FromEnv();
  for (const auto& [name, value] : saved) {
    if (value) {
      ::setenv(name.c_str(), value->c_str(), 1);
    } else {
      ::unsetenv(name.c_str());
    }
  }
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->job_id, "from-env");
  EXPECT_EQ(c->role, Role::kPs);
  EXPECT_EQ(c->rank, 2);
  EXPECT_EQ(c->world_size, 3);
  EXPECT_EQ(c->gpu_memory_limit, uint64_t{512} << 20);
  EXPECT_THAT(missing,
              StatusIs(absl::StatusCode::kInvalidArgument,
                       std::string("DEEPNEX_RANK is not set ") + kLauncher));
}

}  // namespace
}  // namespace deepnex
