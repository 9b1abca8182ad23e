// The wire form of a ContainerSpec and of a container's state, shared by
// deepnex-central's Containers service and deepnex-agent. Private to
// libdeepnex.
#ifndef DEEPNEX_LAUNCH_CENTRAL_WIRE_H_
#define DEEPNEX_LAUNCH_CENTRAL_WIRE_H_

#include <cstdint>
#include <string>

#include "deepnex/central.pb.h"
#include "deepnex/launch/launcher.h"

namespace deepnex::launch {

// The most bytes of logs one ContainerLogs reply carries; a client that got
// fewer has read all there is for now.
inline constexpr uint64_t kMaxLogChunk = 1 << 20;

// Neither carries spec.allocation, spec.user or spec.on_restart.
absl::StatusOr<ContainerSpec> SpecFromProto(const gpu::proto::ContainerSpec& p);
void SpecToProto(const ContainerSpec& s, gpu::proto::ContainerSpec* p);
// StateName's inverse; Internal for an unknown name.
absl::StatusOr<State> ParseState(const std::string& name);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_CENTRAL_WIRE_H_
