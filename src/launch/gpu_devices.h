// Which NVIDIA GPU device nodes a container's cgroup may open (private to
// src/launch): the granted GPUs' /dev/nvidiaN, and the driver's control
// nodes that every CUDA process opens. cgroup v1 takes devices.deny rules;
// v2 has no devices file and takes an eBPF program of type
// BPF_PROG_TYPE_CGROUP_DEVICE attached to the cgroup, as runc's device
// filter does.
#ifndef DEEPNEX_LAUNCH_GPU_DEVICES_H_
#define DEEPNEX_LAUNCH_GPU_DEVICES_H_

#include <string>
#include <vector>

#include "deepnex/status.h"

namespace deepnex::launch {

// The NVIDIA driver's character device major; GPUs are the minors below
// those of its control nodes (nvidia-modeset 254, nvidiactl 255).
constexpr int kNvidiaMajor = 195;
constexpr int kNvidiaFirstControlMinor = 254;

// v1: a "c 195:N rwm" rule for each GPU minor not in `granted`. A v1 cgroup
// inherits allow-all, where an allow entry cannot punch a hole into a wider
// deny, so each other minor is denied.
std::vector<std::string> GpuDenyRules(const std::vector<int>& granted);

// v2: loads a device program that refuses every GPU minor not in `granted`
// (any access) and allows every other device, and attaches it to the cgroup
// directory `dir` (with BPF_F_ALLOW_MULTI, so that programs above still
// apply). It stays attached until the cgroup is removed. FailedPrecondition
// naming the step and errno where the kernel refuses (no CAP_SYS_ADMIN, no
// BPF_CGROUP_DEVICE).
absl::Status AttachGpuDeviceProgram(const std::string& dir, const std::vector<int>& granted);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_GPU_DEVICES_H_
