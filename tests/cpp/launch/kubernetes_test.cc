// The kubernetes backend's manifests, checked without an API server (the
// backend against one played by the test is tests/python/
// test_launch_kubernetes.py, which also validates manifests against the
// Kubernetes models).
#include "launch/kubernetes.h"

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"

namespace deepnex::launch {
namespace {

using nlohmann::json;

ContainerSpec Spec() {
  ContainerSpec spec;
  spec.name = "w0";
  spec.image = "busybox:1.36";
  spec.command = {"id", "-u"};
  return spec;
}

RunContext Context() {
  RunContext context;
  context.run_name = "l1-w0-0";
  context.labels = {{"deepnex.launcher", "l1"}, {"deepnex.name", "w0"}};
  return context;
}

// deepnex-central's run_as: the pod runs as the user's uid and gid, never
// as root, and its container holds no capability and cannot gain one.
TEST(KubernetesManifestTest, RunAsIsThePodsIdentityWithNoCapabilities) {
  ContainerSpec spec = Spec();
  spec.run_as = RunAs{1001, 1002, "ann", "/home/ann"};
  json pod = json::parse(KubernetesManifest(spec, Context(), {}, "l1-w0-0", "team-a"));
  EXPECT_EQ(pod["kind"], "Pod");
  EXPECT_EQ(pod["spec"]["securityContext"],
            json::parse(R"({"runAsUser": 1001, "runAsGroup": 1002, "runAsNonRoot": true})"));
  ASSERT_EQ(pod["spec"]["containers"].size(), 1u);
  EXPECT_EQ(pod["spec"]["containers"][0]["securityContext"],
            json::parse(R"({"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
                            "capabilities": {"drop": ["ALL"]}})"));

  // A Job's pod template carries the same.
  KubernetesOptions job;
  job.kind = "job";
  json manifest = json::parse(KubernetesManifest(spec, Context(), job, "l1-w0-0", "team-a"));
  EXPECT_EQ(manifest["kind"], "Job");
  const json& template_spec = manifest["spec"]["template"]["spec"];
  EXPECT_EQ(template_spec["securityContext"], pod["spec"]["securityContext"]);
  EXPECT_EQ(template_spec["containers"][0]["securityContext"],
            pod["spec"]["containers"][0]["securityContext"]);
}

TEST(KubernetesManifestTest, NoRunAsLeavesTheImagesUser) {
  json pod = json::parse(KubernetesManifest(Spec(), Context(), {}, "l1-w0-0", "team-a"));
  EXPECT_FALSE(pod["spec"].contains("securityContext"));
  EXPECT_EQ(pod["spec"]["containers"][0]["securityContext"],
            json::parse(R"({"allowPrivilegeEscalation": false,
                            "readOnlyRootFilesystem": true})"));
}

}  // namespace
}  // namespace deepnex::launch
