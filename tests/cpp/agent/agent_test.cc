// deepnex-agent against an in-process deepnex-central: registration with
// node tokens, heartbeats and NotReady, and containers started through
// central on an agent's node.
#include "deepnex/agent/agent.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "agent/hub.h"
#include "agent/remote_launcher.h"
#include "core/grpc_util.h"
#include "core/net.h"
#include "gmock/gmock.h"
#include "gpu/central_server.h"
#include "launch/session_client.h"
#include "gpu/gpu_test_util.h"
#include "gtest/gtest.h"
#include "deepnex/agent.grpc.pb.h"
#include "deepnex/launch/central.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::agent {
namespace {

using ::deepnex::gpu::test::TempDir;
using ::deepnex::test::StatusIs;
using ::deepnex::test::WaitFor;
using ::testing::HasSubstr;
using namespace std::chrono_literals;  // NOLINT

class AgentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ofstream(dir_.path() + "/tokens") << "admintok root admin\nalicetok alice user\n"
                                               "h1tok h1 node\nh2tok h2 node\n"
                                               "j1admintok root admin j1\n";
    Serve(60s);
  }

  // (Re)starts central: its ledger in dir_/ledger, on `address`.
  void Serve(std::chrono::milliseconds lost_after, const std::string& address = "127.0.0.1:0") {
    alice_c_.reset();
    alice_.reset();
    server_.reset();
    gpu::CentralServerOptions o;
    o.address = address;
    o.token_file = dir_.path() + "/tokens";
    o.allocator.state_dir = dir_.path() + "/ledger";
    o.node_timeout = 400ms;
    o.node_lost_after = lost_after;
    o.agent_heartbeat = 100ms;
    launch::LauncherOptions l;
    l.backend = "process";
    l.state_dir = dir_.path() + "/central";
    // Alice's containers run as nobody (as root) or as this test's own uid.
    launch::ContainerPolicy policy;
    policy.users["alice"] = geteuid() == 0 ? launch::RunAs{65534, 65534}
                                           : launch::RunAs{geteuid(), getegid()};
    ASSERT_EQ(chmod(dir_.path().c_str(), 0711), 0);
    ASSERT_OK_AND_ASSIGN(server_, launch::CreateCentralServer(o, l, policy));
    gpu::CentralClientOptions c;
    c.address = server_->address();
    c.token = "alicetok";
    c.timeout = 10s;
    ASSERT_OK_AND_ASSIGN(alice_, gpu::CentralClient::Create(c));
    ASSERT_OK_AND_ASSIGN(alice_c_, launch::CentralClient::Create(c));
  }

  // Starts a container that sleeps on a new allocation on `node`.
  launch::CentralContainer Sleeper(const std::string& node, const std::string& name) {
    auto a = alice_->Allocate(OnNode(node));
    EXPECT_TRUE(a.ok()) << a.status();
    launch::ContainerSpec spec;
    spec.name = name;
    spec.command = {"sleep", "60"};
    auto c = alice_c_->StartContainer(spec, a->id);
    EXPECT_TRUE(c.ok()) << c.status();
    return *c;
  }

  AgentOptions Options(const std::string& node, const std::string& token) {
    AgentOptions o;
    o.central = server_->address();
    o.node = node;
    o.token = token;
    o.launcher.backend = "process";
    o.launcher.state_dir = dir_.path() + "/" + node;
    o.gpus = ParseGpus("2x16GiB").value();
    o.cpus = 4;
    o.memory = 8ull << 30;
    o.labels = {{"rack", "r1"}};
    return o;
  }

  std::unique_ptr<Agent> Start(const std::string& node, const std::string& token) {
    auto a = Agent::Create(Options(node, token));
    EXPECT_TRUE(a.ok()) << a.status();
    return std::move(a).value();
  }

  // A stream to central's Agents service as `token`, for what deepnex-agent
  // itself never sends. Members go in reverse: the stream first.
  struct RawAgent {
    std::unique_ptr<proto::Agents::Stub> stub;
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<proto::AgentMessage, proto::CentralMessage>> stream;
  };
  std::unique_ptr<RawAgent> Raw(const std::string& token) {
    auto r = std::make_unique<RawAgent>();
    r->stub = proto::Agents::NewStub(
        grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
    r->ctx.AddMetadata("authorization", "Bearer " + token);
    // A read that nothing answers fails the test rather than stalling it.
    r->ctx.set_deadline(std::chrono::system_clock::now() + 60s);
    r->stream = r->stub->Connect(&r->ctx);
    return r;
  }

  // What a raw agent sends to register node h2 (1 CPU, 1 GiB, one 16 GiB
  // GPU), reporting alice's container "alice.NAME" on `allocation` when
  // `name` is not empty.
  static proto::AgentMessage RegisterH2(const std::string& name = "",
                                        const std::string& allocation = "") {
    proto::AgentMessage m;
    proto::Register* reg = m.mutable_register_();
    reg->mutable_node()->set_name("h2");
    reg->mutable_node()->set_cpus(1);
    reg->mutable_node()->set_memory(1 << 30);
    reg->mutable_node()->set_mode("exclusive");
    reg->mutable_node()->add_gpus()->set_memory(16ull << 30);
    reg->set_backend("process");
    if (!name.empty()) {
      proto::ContainerReport* c = reg->add_containers();
      c->set_name("alice." + name);
      c->set_state("running");
      c->set_user("alice");
      c->set_allocation_id(allocation);
    }
    return m;
  }

  bool Ready(const std::string& node) {
    auto n = server_->allocator().GetNode(node);
    return n.ok() && n->ready;
  }

  gpu::Request OnNode(const std::string& node) {
    gpu::Request r;
    r.gpus = 1;
    r.cpus = 1;
    r.memory = 256 << 20;
    r.node = node;
    return r;
  }

  TempDir dir_;
  std::unique_ptr<gpu::CentralServer> server_;
  std::unique_ptr<gpu::CentralClient> alice_;
  std::unique_ptr<launch::CentralClient> alice_c_;
};

TEST(ParseGpusTest, CountTimesSize) {
  ASSERT_OK_AND_ASSIGN(auto gpus, ParseGpus("2x16GiB"));
  ASSERT_EQ(gpus.size(), 2u);
  EXPECT_EQ(gpus[1].memory, 16ull << 30);
  EXPECT_EQ(ParseGpus("0")->size(), 0u);
  EXPECT_THAT(ParseGpus("16GiB", "--gpus").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "--gpus: \"16GiB\" is not NxSIZE with N from 1 to 1024 (e.g. 2x16GiB)"));
  EXPECT_THAT(ParseGpus("2x0").status(), StatusIs(absl::StatusCode::kInvalidArgument,
                                                  "gpus: \"2x0\": a GPU needs memory"));
  EXPECT_THAT(ParseGpus("2x12XB").status(), StatusIs(absl::StatusCode::kInvalidArgument,
                                                     HasSubstr("unknown unit \"XB\"")));
}

TEST(AgentOptionsTest, BadOptionsAreRefused) {
  AgentOptions o;
  o.central = "http://127.0.0.1:7070";
  o.node = "h1";
  EXPECT_THAT(Agent::Create(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("central address \"http://127.0.0.1:7070\"")));
  o.central = "127.0.0.1:7070";
  o.node = "";
  EXPECT_THAT(Agent::Create(o).status(), StatusIs(absl::StatusCode::kInvalidArgument,
                                                  "node: the node needs a name"));
  o.node = "h1";
  o.cpus = -2;
  o.gpus = std::vector<gpu::Gpu>{};
  EXPECT_THAT(Agent::Create(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "cpus: -2 is negative"));
  o.cpus = 1;
  o.advertise = "0.0.0.0";
  EXPECT_THAT(Agent::Create(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "advertise \"0.0.0.0\": peers cannot dial a wildcard address"));
}

// The host peers dial on the node: --advertise, or by default this host's
// address towards central; central keeps it per node.
TEST_F(AgentTest, AdvertisedAddressReachesNodes) {
  AgentOptions o = Options("h1", "h1tok");
  o.advertise = "h1.lab";
  ASSERT_OK_AND_ASSIGN(auto h1, Agent::Create(o));
  EXPECT_EQ(h1->address(), "h1.lab");
  EXPECT_EQ(h1->http_address(), "");
  auto h2 = Start("h2", "h2tok");
  EXPECT_EQ(h2->address(), PrimaryAddress("127.0.0.1"));
  ASSERT_OK(h1->WaitRegistered(10s));
  ASSERT_OK(h2->WaitRegistered(10s));
  ASSERT_OK_AND_ASSIGN(auto nodes, alice_->Nodes());
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes[0].address, "h1.lab");
  EXPECT_EQ(nodes[1].address, h2->address());
}

// Central checks the address of a Register sent by other than deepnex-agent.
TEST_F(AgentTest, RegisterWithABadAddressIsRefused) {
  auto raw = Raw("h2tok");
  auto& stream = raw->stream;
  proto::AgentMessage m;
  m.mutable_register_()->mutable_node()->set_name("h2");
  m.mutable_register_()->set_address("h2:7070");
  ASSERT_TRUE(stream->Write(m));
  proto::CentralMessage reply;
  EXPECT_FALSE(stream->Read(&reply));
  grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "address \"h2:7070\": a host name or an address, without a port");
  EXPECT_TRUE(alice_->Nodes().value().empty());
}

TEST(CentralOptionsTest, NodeTimeoutsAreChecked) {
  gpu::CentralServerOptions o;
  o.node_timeout = 0ms;
  EXPECT_THAT(gpu::CentralServer::Create(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "node_timeout=0ms: must be positive"));
  o.node_timeout = 10s;
  o.node_lost_after = 5s;
  EXPECT_THAT(gpu::CentralServer::Create(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "node_lost_after=5000ms must be at least node_timeout=10000ms"));
  o.node_lost_after = 60s;
  o.agent_heartbeat = 0ms;
  EXPECT_THAT(gpu::CentralServer::Create(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "agent_heartbeat=0ms: must be positive"));
}

TEST_F(AgentTest, RegistersItsNodeAndHeartbeats) {
  auto h1 = Start("h1", "h1tok");
  ASSERT_OK(h1->WaitRegistered(10s));
  ASSERT_OK_AND_ASSIGN(auto nodes, alice_->Nodes());
  ASSERT_EQ(nodes.size(), 1u);
  const gpu::NodeInfo& n = nodes[0];
  EXPECT_EQ(n.node.name, "h1");
  EXPECT_EQ(n.node.gpus.size(), 2u);
  EXPECT_EQ(n.node.gpus[0].memory, 16ull << 30);
  EXPECT_EQ(n.node.cpus, 4);
  EXPECT_EQ(n.node.memory, 8ull << 30);
  EXPECT_EQ(n.node.labels.at("rack"), "r1");
  EXPECT_EQ(n.node.labels.at("deepnex.io/agent"), "true");
  EXPECT_TRUE(n.ready);
  const int64_t first = n.last_heartbeat_ms;
  EXPECT_GT(first, 0);
  // Heartbeats move it on.
  ASSERT_TRUE(WaitFor(
      [&] {
        auto now = alice_->Nodes();
        return now.ok() && (*now)[0].last_heartbeat_ms > first;
      },
      10s, "a heartbeat after registration"));
}

TEST_F(AgentTest, SilentNodeIsNotReadyAndGetsNoGrant) {
  auto h1 = Start("h1", "h1tok");
  ASSERT_OK(h1->WaitRegistered(10s));
  h1->Stop();
  ASSERT_TRUE(WaitFor([&] { return !Ready("h1"); }, 10s, "h1 NotReady"));
  // The hub marks the node NotReady in the allocator first, then logs,
  // tells the observer and counts it.
  ASSERT_TRUE(WaitFor(
      [&] {
        return server_->MetricsText().find("deepnex_node_not_ready_total{node=\"h1\"} 1") !=
               std::string::npos;
      },
      10s, "h1's NotReady counted"));
  gpu::AllocateOptions now;
  now.wait = false;
  EXPECT_THAT(alice_->Allocate(OnNode("h1"), now).status(),
              StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(server_->MetricsText(), HasSubstr("deepnex_node_ready{node=\"h1\"} 0"));
  EXPECT_THAT(server_->MetricsText(),
              HasSubstr("deepnex_node_not_ready_total{node=\"h1\"} 1"));
  // Back: Ready, and grants again.
  auto again = Start("h1", "h1tok");
  ASSERT_OK(again->WaitRegistered(10s));
  ASSERT_TRUE(WaitFor([&] { return Ready("h1"); }, 10s, "h1 Ready again"));
  ASSERT_OK_AND_ASSIGN(gpu::Allocation a, alice_->Allocate(OnNode("h1"), now));
  EXPECT_EQ(a.node, "h1");
}

TEST_F(AgentTest, NodeTokenActsOnlyAsItsNode) {
  auto wrong = Agent::Create(Options("h2", "h1tok"));
  ASSERT_OK(wrong.status());
  EXPECT_THAT((*wrong)->WaitRegistered(10s),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       "the token of node h1 cannot act as node h2"));
  EXPECT_THAT((*wrong)->Wait(), StatusIs(absl::StatusCode::kPermissionDenied));
  wrong->reset();  // its launcher holds h2's state directory
  auto user = Agent::Create(Options("h2", "alicetok"));
  ASSERT_OK(user.status());
  EXPECT_THAT((*user)->WaitRegistered(10s),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("user alice cannot register a node: it needs a node token")));
  EXPECT_FALSE(server_->allocator().GetNode("h2").ok());
  // And a node token is no user's: it allocates nothing.
  gpu::CentralClientOptions c;
  c.address = server_->address();
  c.token = "h1tok";
  ASSERT_OK_AND_ASSIGN(auto node_client, gpu::CentralClient::Create(c));
  EXPECT_THAT(node_client->Nodes().status(),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("is a node token")));
}

TEST_F(AgentTest, ContainerOnAnAgentsNodeRunsThere) {
  auto h1 = Start("h1", "h1tok");
  auto h2 = Start("h2", "h2tok");
  ASSERT_OK(h1->WaitRegistered(10s));
  ASSERT_OK(h2->WaitRegistered(10s));
  ASSERT_OK_AND_ASSIGN(gpu::Allocation a, alice_->Allocate(OnNode("h2")));
  launch::ContainerSpec spec;
  spec.name = "w0";
  spec.command = {"sh", "-c", "echo hi from $CUDA_VISIBLE_DEVICES; sleep 60"};
  ASSERT_OK_AND_ASSIGN(launch::CentralContainer c, alice_c_->StartContainer(spec, a.id));
  EXPECT_EQ(c.node, "h2");
  EXPECT_EQ(c.backend, "process");
  // It is h2's agent's container: its records are in h2's state directory.
  EXPECT_TRUE(std::filesystem::exists(dir_.path() + "/h2/containers/alice.w0"));
  EXPECT_FALSE(std::filesystem::exists(dir_.path() + "/h1/containers/alice.w0"));
  EXPECT_FALSE(std::filesystem::exists(dir_.path() + "/central/containers/alice.w0"));
  const std::string want = "hi from " + std::to_string(a.gpus[0].index) + "\n";
  ASSERT_TRUE(WaitFor(
      [&] {
        auto chunk = alice_c_->ContainerLogs("w0");
        return chunk.ok() && chunk->data == want;
      },
      10s, "w0's log through central"));
  ASSERT_TRUE(WaitFor(
      [&] {
        auto list = alice_c_->ListContainers();
        return list.ok() && list->size() == 1 && (*list)[0].state == launch::State::kRunning &&
               (*list)[0].usage.cpu_seconds >= 0 && (*list)[0].node == "h2";
      },
      10s, "w0 listed running on h2"));
  EXPECT_THAT(server_->MetricsText(),
              HasSubstr("deepnex_container_memory_bytes{container=\"alice.w0\",node=\"h2\","
                        "user=\"alice\"}"));
  ASSERT_OK_AND_ASSIGN(launch::CentralContainer stopped, alice_c_->StopContainer("w0", 5s));
  EXPECT_EQ(stopped.state, launch::State::kStopped);
  EXPECT_EQ(stopped.last_exit, "signaled(SIGTERM)");
  EXPECT_TRUE(stopped.allocation_released);
  EXPECT_FALSE(server_->allocator().GetAllocation(a.id).ok());
}

// An agent that stops (SIGTERM, or its owner destroying it) stops its
// containers and tells central how they ended before its stream closes:
// central showed them running and held their grants until node_lost_after
// (probe). A node lost in silence is the multi-host tests' (partitions).
TEST_F(AgentTest, AStoppedAgentsContainersEndAtOnceAndReleaseTheirGrants) {
  Serve(60s);
  auto h1 = Start("h1", "h1tok");
  ASSERT_OK(h1->WaitRegistered(10s));
  launch::CentralContainer c = Sleeper("h1", "w0");
  h1.reset();
  ASSERT_TRUE(WaitFor(
      [&] {
        auto list = alice_c_->ListContainers();
        return list.ok() && list->size() == 1 && (*list)[0].state == launch::State::kStopped &&
               (*list)[0].allocation_released;
      },
      10s, "w0 stopped and its allocation released, long before node_lost_after"));
  EXPECT_EQ(alice_c_->ListContainers().value()[0].last_exit, "signaled(SIGTERM)");
  EXPECT_FALSE(server_->allocator().GetAllocation(c.allocation_id).ok());
}

// A restarted central gets the agents back and, from their registrations,
// every container record; none was stopped.
TEST_F(AgentTest, RestartedCentralTakesContainersBack) {
  auto h1 = Start("h1", "h1tok");
  auto h2 = Start("h2", "h2tok");
  ASSERT_OK(h1->WaitRegistered(10s));
  ASSERT_OK(h2->WaitRegistered(10s));
  launch::CentralContainer w1 = Sleeper("h1", "w1");
  launch::CentralContainer w2 = Sleeper("h2", "w2");
  const std::string address = server_->address();
  Serve(60s, address);
  auto listed = [&] {
    auto list = alice_c_->ListContainers();
    return list.ok() && list->size() == 2 && (*list)[0].name == "w1" &&
           (*list)[0].node == "h1" && (*list)[0].state == launch::State::kRunning &&
           (*list)[1].name == "w2" && (*list)[1].node == "h2" &&
           (*list)[1].state == launch::State::kRunning &&
           (*list)[1].allocation_id == w2.allocation_id && (*list)[1].id == w2.id;
  };
  ASSERT_TRUE(WaitFor(listed, 20s, "w1 and w2 back, running, after central's restart"));
  // Still central's to stop.
  ASSERT_OK_AND_ASSIGN(launch::CentralContainer stopped, alice_c_->StopContainer("w1", 5s));
  EXPECT_EQ(stopped.state, launch::State::kStopped);
  EXPECT_TRUE(stopped.allocation_released);
}

// Ops act on agents' nodes as on declared ones: a drain with release stops
// the node's containers through its agent.
TEST_F(AgentTest, DrainWithReleaseStopsTheNodesContainers) {
  auto h1 = Start("h1", "h1tok");
  ASSERT_OK(h1->WaitRegistered(10s));
  Sleeper("h1", "w0");
  ASSERT_OK(server_->allocator().Drain("h1", /*release=*/true));
  ASSERT_TRUE(WaitFor(
      [&] {
        auto list = alice_c_->ListContainers();
        return list.ok() && list->size() == 1 && (*list)[0].state == launch::State::kStopped;
      },
      20s, "w0 stopped by the drain"));
  EXPECT_EQ(alice_c_->ListContainers().value()[0].last_exit, "signaled(SIGTERM)");
  ASSERT_OK_AND_ASSIGN(gpu::NodeInfo n, server_->allocator().GetNode("h1"));
  EXPECT_TRUE(n.draining);
  EXPECT_TRUE(n.ready);
}

// An agent reports what runs on its node only: a report naming a grant on
// another node is not taken back as a container of central's.
TEST_F(AgentTest, ReportOfAnotherNodesGrantIsNotTaken) {
  auto h1 = Start("h1", "h1tok");
  ASSERT_OK(h1->WaitRegistered(10s));
  ASSERT_OK_AND_ASSIGN(gpu::Allocation a, alice_->Allocate(OnNode("h1")));
  auto raw = Raw("h2tok");
  auto& stream = raw->stream;
  ASSERT_TRUE(stream->Write(RegisterH2("fake", a.id)));
  proto::CentralMessage reply;
  ASSERT_TRUE(stream->Read(&reply));
  ASSERT_TRUE(reply.has_registered());
  EXPECT_TRUE(alice_c_->ListContainers().value().empty());
  raw->ctx.TryCancel();
  stream->Finish().ok();
  EXPECT_OK(server_->allocator().GetAllocation(a.id).status());
}

// Only the node's own agent (or an admin without a job) serves a session
// of its node: a job's admin token once took any node's pending session,
// and with it the user's terminal.
TEST_F(AgentTest, OnlyTheNodesAgentServesItsSessions) {
  // h2's agent is this test: it registers, then again with alice's
  // container on her grant there, which central adopts.
  auto first = Raw("h2tok");
  ASSERT_TRUE(first->stream->Write(RegisterH2()));
  proto::CentralMessage in;
  ASSERT_TRUE(first->stream->Read(&in) && in.has_registered());
  ASSERT_OK_AND_ASSIGN(gpu::Allocation a, alice_->Allocate(OnNode("h2")));
  auto agent = Raw("h2tok");
  ASSERT_TRUE(agent->stream->Write(RegisterH2("sh", a.id)));
  ASSERT_TRUE(agent->stream->Read(&in) && in.has_registered());
  first->ctx.TryCancel();
  first->stream->Finish().ok();
  // Adopted after the registration's answer: a session opened before was
  // NotFound, and this agent waited for ever for its command (CI).
  ASSERT_TRUE(WaitFor(
      [&] {
        auto list = alice_c_->ListContainers();
        return list.ok() && list->size() == 1 && (*list)[0].name == "sh";
      },
      10s, "central to adopt sh"));

  launch::SessionOptions o;
  o.container = "sh";
  o.command = {"true"};
  auto channel = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
  absl::StatusOr<std::unique_ptr<launch::Session>> session;
  std::thread user([&] { session = launch::OpenCentralSession(channel, "alicetok", o); });
  ASSERT_TRUE(agent->stream->Read(&in) && in.command().has_session());
  const std::string id = in.command().session().session_id();
  proto::AgentMessage answer;
  answer.mutable_reply()->set_id(in.command().id());
  ASSERT_TRUE(agent->stream->Write(answer));
  for (const auto& [token, who] : {std::pair<std::string, std::string>{"j1admintok", "root"},
                                   {"h1tok", "h1"}}) {
    auto stub = proto::AgentSessions::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + token);
    auto stream = stub->Open(&ctx);
    proto::AgentSessionMessage hello;
    hello.set_session_id(id);
    stream->Write(hello);
    gpu::proto::SessionInput input;
    EXPECT_FALSE(stream->Read(&input)) << token << " got the user's input";
    grpc::Status refused = stream->Finish();
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::PERMISSION_DENIED) << token;
    EXPECT_EQ(refused.error_message(), who + " cannot serve a session of node h2");
  }
  user.join();
  if (session.ok()) (*session)->Cancel();
  agent->ctx.TryCancel();
  agent->stream->Finish().ok();
}

// A central extension that serves nothing: the test holds the agents' hub
// to send an agent what deepnex-central itself never sends.
class NoExtension : public gpu::CentralExtension {
 public:
  grpc::Service* service() override { return &service_; }
  void Shutdown() override {}

 private:
  grpc::Service service_;
};

// An agent of the process backend on h1, registered with a central whose
// hub the test drives through remote launchers.
class AgentOnCentral : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ofstream(dir_.path() + "/tokens") << "h1tok h1 node\n";
    gpu::CentralServerOptions o;
    o.address = "127.0.0.1:0";
    o.token_file = dir_.path() + "/tokens";
    o.allocator.state_dir = dir_.path() + "/ledger";
    ASSERT_OK_AND_ASSIGN(
        server_,
        gpu::CreateCentralServer(o, [&](gpu::Allocator&, const TokenTable&, Hub& h)
                                        -> absl::StatusOr<std::unique_ptr<gpu::CentralExtension>> {
          hub_ = &h;
          return std::make_unique<NoExtension>();
        }));
    agent_options_.central = server_->address();
    agent_options_.node = "h1";
    agent_options_.token = "h1tok";
    agent_options_.launcher.backend = "process";
    agent_options_.launcher.state_dir = dir_.path() + "/h1";
    agent_options_.gpus = ParseGpus("1x16GiB").value();
  }
  void StartAgent() {
    ASSERT_OK_AND_ASSIGN(agent_, Agent::Create(agent_options_));
    ASSERT_OK(agent_->WaitRegistered(10s));
  }
  void TearDown() override { agent_.reset(); }

  TempDir dir_;
  std::unique_ptr<gpu::CentralServer> server_;
  Hub* hub_ = nullptr;
  AgentOptions agent_options_;
  std::unique_ptr<Agent> agent_;
};

// A start without the uid to run as would run the user's container as the
// agent's own uid (root); the agent refuses it and starts nothing.
TEST_F(AgentOnCentral, AStartWithoutTheUidIsRefused) {
  // Made before its agent registers, as after central's restart: it said
  // "" for good, and `deepnex launch` printed "( PID)".
  std::unique_ptr<launch::Launcher> h1 = NewRemoteLauncher(*hub_, "h1", {});
  EXPECT_EQ(h1->backend(), "agent");
  StartAgent();
  EXPECT_EQ(h1->backend(), "process");
  launch::ContainerSpec spec;
  spec.name = "alice.w";
  spec.command = {"true"};
  EXPECT_THAT(h1->Start(spec).status(),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       "node h1: container \"alice.w\" came without the uid to run it as; "
                       "deepnex-agent never runs a container as its own"));
  EXPECT_FALSE(std::filesystem::exists(dir_.path() + "/h1/containers/alice.w"));
}

// Central's --allow-mount roots hold on an agent's node: its launcher had
// none, "/" to it, and a probe mounted /etc, /proc and a link out of an
// allowed directory. The agent checks them where the paths are.
TEST_F(AgentOnCentral, AMountOutsideCentralsRootsIsRefusedOnTheNode) {
  const std::string allowed = dir_.path() + "/allowed", secret = dir_.path() + "/secret";
  std::filesystem::create_directories(allowed + "/sub");
  std::filesystem::create_directories(secret);
  std::filesystem::create_directory_symlink(secret, allowed + "/link");
  StartAgent();
  std::unique_ptr<launch::Launcher> h1 = NewRemoteLauncher(*hub_, "h1", {allowed});
  launch::ContainerSpec spec;
  spec.command = {"true"};
  spec.run_as = launch::RunAs{getuid(), getgid(), "root", "/"};
  int n = 0;
  for (const std::string& source : {std::string("/etc"), secret, allowed + "/link"}) {
    spec.name = absl::StrCat("alice.m", n++);
    spec.mounts = {launch::Mount{source, source, false}};
    EXPECT_THAT(h1->Start(spec).status(),
                StatusIs(absl::StatusCode::kPermissionDenied,
                         HasSubstr("is outside the allowed mount roots [" + allowed + "]")))
        << source;
  }
  spec.name = "alice.none";
  spec.mounts = {launch::Mount{allowed + "/sub", allowed + "/sub", false}};
  EXPECT_THAT(NewRemoteLauncher(*hub_, "h1", {})->Start(spec).status(),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("no mount roots are allowed here")));
  spec.name = "alice.ok";
  ASSERT_OK_AND_ASSIGN(auto h, h1->Start(spec));
  EXPECT_OK(h->Wait(10s).status());
}

// A container its agent removed is forgotten (Hub::Forget, which
// RemoteLauncher::Remove calls): central kept the report of every container
// that ever ran on a node, for good. A heartbeat built before the removal
// does not bring it back; after a heartbeat without it, or a start of that
// name answered, the name's reports count again. On a hub of its own, whose
// agent is this test's stream.
TEST_F(AgentTest, ARemovedContainersReportIsForgotten) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<gpu::Allocator> alloc, gpu::Allocator::Create({}));
  const TokenTable tokens = TokenTable::Single("h2tok", "h2", AuthRole::kNode);
  Hub hub(*alloc, tokens, HubOptions{});
  ServerHostOptions so;
  so.what = "hub";
  so.address = "127.0.0.1:0";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ServerHost> host, ServerHost::Start(so, {hub.service()}));
  auto stub = proto::Agents::NewStub(
      grpc::CreateChannel(host->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer h2tok");
  ctx.set_deadline(std::chrono::system_clock::now() + 60s);
  auto stream = stub->Connect(&ctx);
  ASSERT_TRUE(stream->Write(RegisterH2("w0")));
  proto::CentralMessage registered;
  ASSERT_TRUE(stream->Read(&registered));
  ASSERT_TRUE(registered.has_registered());
  const std::string w0 = "alice.w0";
  ASSERT_TRUE(hub.Report("h2", w0).has_value());

  // A heartbeat reporting `names`, marked by its memory_used: returns once
  // the hub has taken it.
  uint64_t mark = 0;
  auto beat = [&](const std::vector<std::string>& names) {
    proto::AgentMessage m;
    for (const std::string& name : names) {
      proto::ContainerReport* c = m.mutable_heartbeat()->add_containers();
      c->set_name(name);
      c->set_state("running");
      c->set_user("alice");
    }
    m.mutable_heartbeat()->mutable_usage()->set_memory_used(++mark);
    return stream->Write(m) && WaitFor(
                                   [&] {
                                     gpu::NodeInfo info;
                                     info.node.name = "h2";
                                     hub.Fill(&info);
                                     return info.memory_in_use == mark;
                                   },
                                   10s, "the heartbeat taken");
  };
  // Answers the next command, a reply of container `name` when not empty.
  auto answer = [&](const std::string& name) {
    proto::CentralMessage command;
    if (!stream->Read(&command)) return proto::Command();
    proto::AgentMessage reply;
    reply.mutable_reply()->set_id(command.command().id());
    if (!name.empty()) {
      reply.mutable_reply()->mutable_container()->set_name(name);
      reply.mutable_reply()->mutable_container()->set_state("running");
    }
    EXPECT_TRUE(stream->Write(reply));
    return command.command();
  };
  std::unique_ptr<launch::Launcher> remote = NewRemoteLauncher(hub, "h2", {});
  std::thread remove([&] { EXPECT_OK(remote->Remove(w0)); });
  EXPECT_EQ(answer("").remove().name(), w0);
  remove.join();
  EXPECT_FALSE(hub.Report("h2", w0).has_value());
  ASSERT_TRUE(beat({w0}));  // built before the removal
  EXPECT_FALSE(hub.Report("h2", w0).has_value());
  ASSERT_TRUE(beat({}));
  ASSERT_TRUE(beat({w0}));  // a new container of that name
  EXPECT_TRUE(hub.Report("h2", w0).has_value());

  hub.Forget("h2", w0);
  std::thread start([&] {
    proto::Command c;
    c.mutable_start();
    EXPECT_OK(hub.Call("h2", std::move(c), 10s).status());
  });
  EXPECT_TRUE(answer(w0).has_start());
  start.join();
  EXPECT_TRUE(hub.Report("h2", w0).has_value());
  ASSERT_TRUE(beat({w0}));
  EXPECT_TRUE(hub.Report("h2", w0).has_value());

  stream->WritesDone();
  hub.Shutdown();
  host->Stop();
}

}  // namespace
}  // namespace deepnex::agent
