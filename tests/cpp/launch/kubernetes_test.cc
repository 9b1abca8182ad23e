// The kubernetes backend's manifests, checked without an API server (the
// backend against one played by the test is tests/python/
// test_launch_kubernetes.py, which also validates manifests against the
// Kubernetes models).
#include "launch/kubernetes.h"

#include <unistd.h>

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

// The value of `name` in the container's env, or "" when it has none.
std::string EnvOf(const json& container, const std::string& name) {
  for (const json& var : container.value("env", json::array())) {
    if (var["name"] == name) return var["value"];
  }
  return "";
}

// deepnex-central's run_as: the pod runs as the user's uid and gid, never
// as root, under the runtime's seccomp profile (the "restricted" Pod
// Security Standard), and its container holds no capability and cannot
// gain one; HOME is the user's (the runtime's "/" is read-only).
TEST(KubernetesManifestTest, RunAsIsThePodsIdentityWithNoCapabilities) {
  ContainerSpec spec = Spec();
  spec.run_as = RunAs{1001, 1002, "ann", "/home/ann"};
  json pod = json::parse(KubernetesManifest(spec, Context(), {}, "l1-w0-0", "team-a"));
  EXPECT_EQ(pod["kind"], "Pod");
  EXPECT_EQ(pod["spec"]["securityContext"],
            json::parse(R"({"runAsUser": 1001, "runAsGroup": 1002, "runAsNonRoot": true,
                            "seccompProfile": {"type": "RuntimeDefault"}})"));
  ASSERT_EQ(pod["spec"]["containers"].size(), 1u);
  EXPECT_EQ(pod["spec"]["containers"][0]["securityContext"],
            json::parse(R"({"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
                            "capabilities": {"drop": ["ALL"]}})"));
  EXPECT_EQ(EnvOf(pod["spec"]["containers"][0], "HOME"), "/home/ann");
  // The spec's own HOME wins.
  spec.env["HOME"] = "/scratch";
  EXPECT_EQ(EnvOf(json::parse(KubernetesManifest(spec, Context(), {}, "l1-w0-0",
                                                 "team-a"))["spec"]["containers"][0],
                  "HOME"),
            "/scratch");
  spec.env.erase("HOME");

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

// launcher.h: an unset run_as is the launcher's own uid and gid, not the
// image's user (root in most images) with the runtime's capabilities.
TEST(KubernetesManifestTest, NoRunAsIsTheLaunchersOwnIdentity) {
  json pod = json::parse(KubernetesManifest(Spec(), Context(), {}, "l1-w0-0", "team-a"));
  const uint32_t uid = geteuid(), gid = getegid();
  json security = {{"runAsUser", uid}, {"runAsGroup", gid},
                   {"seccompProfile", {{"type", "RuntimeDefault"}}}};
  json capabilities = {{"drop", {"ALL"}}};
  if (uid != 0) {
    security["runAsNonRoot"] = true;
  } else {
    // Root keeps runc's default set, as an oci container's root does.
    capabilities["add"] = {"AUDIT_WRITE", "KILL", "NET_BIND_SERVICE"};
  }
  EXPECT_EQ(pod["spec"]["securityContext"], security);
  EXPECT_EQ(pod["spec"]["containers"][0]["securityContext"],
            json({{"allowPrivilegeEscalation", false}, {"readOnlyRootFilesystem", true},
                  {"capabilities", capabilities}}));
  EXPECT_EQ(EnvOf(pod["spec"]["containers"][0], "HOME"), uid == 0 ? "/root" : "/");
}

}  // namespace
}  // namespace deepnex::launch
