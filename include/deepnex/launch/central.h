// The launcher of deepnex-central: users start, list, stop and read the logs
// of their own containers, each on one of their allocations; when a
// container ends for good (its restart policy gives up, or Stop) and no other
// container runs on its allocation, the allocation is released. A container
// whose allocation goes away under it (released, lease expired) is stopped
// within a second, so that it holds no GPU the allocator grants again.
//
// This lives in launch, not gpu, because it needs both (launch uses gpu's
// Allocation; gpu must not depend on launch): CreateCentralServer below is
// gpu::CentralServer with a Containers service added on the same port.
//
//   DEEPNEX_ASSIGN_OR_RETURN(auto client, launch::CentralClient::Create({.address = addr}));
//   ContainerSpec spec;
//   spec.name = "w0"; spec.command = {"python3", "train.py"};
//   DEEPNEX_ASSIGN_OR_RETURN(CentralContainer c, client->StartContainer(spec, grant.id));
#ifndef DEEPNEX_LAUNCH_CENTRAL_H_
#define DEEPNEX_LAUNCH_CENTRAL_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "deepnex/gpu/central.h"
#include "deepnex/launch/launcher.h"
#include "deepnex/launch/session.h"
#include "deepnex/status.h"

namespace deepnex::launch {

// Whom deepnex-central runs its users' containers as, and what they may ask
// for beyond their grant.
struct ContainerPolicy {
  // Each user's identity. Neither uid nor gid may be 0, and a
  // deepnex-central that does not run as root can map users only to its
  // own uid and gid (InvalidArgument naming the user).
  std::map<std::string, RunAs> users;
  // The users whose containers may use the host's network
  // (ContainerSpec::host_network); "*": every user.
  std::set<std::string> host_network_users;
  // HOST:PORT of the site's OCI registry (plain HTTP) that holds the
  // catalog's images: an OCI image layout registered as an image is pushed
  // there, and nodes pull it on first use. Empty: images stay directories
  // on deepnex-central's host.
  std::string registry;
  // Ended containers kept per user (state, exit, logs: what ps and logs
  // show); past it the oldest go, with their files. At least 1.
  size_t ended_kept_per_user = 100;
};

// Parses a users file: lines "NAME UID GID" or "NAME UID:GID", '#'
// comments and blank lines ignored. InvalidArgument naming the line.
absl::StatusOr<std::map<std::string, RunAs>> LoadUsersFile(const std::string& path);

// Parses one "NAME=UID:GID" into `users`; InvalidArgument naming it.
absl::Status AddUserMapping(const std::string& text, std::map<std::string, RunAs>* users);

// Parses one "NAME=DIR" of an image catalog (deepnex-central's and
// deepnex-agent's --image) into `images`: DIR an existing absolute directory
// (symlinks resolved) or "host", NAME new and not a path. InvalidArgument
// naming `field` and the text.
absl::Status AddImageMapping(const std::string& field, const std::string& text,
                             std::map<std::string, std::string>* images);

// deepnex-central with a launcher on `launcher`'s backend. Container names
// are per user: the launcher runs them as "<user>.<name>". Users may mount
// only paths under `launcher.allowed_mount_roots` (symlinks resolved first);
// when it is empty, no mount at all (PermissionDenied), unlike a Launcher's,
// where empty means anywhere.
//
// A deepnex-central that crashed leaves its containers running on
// allocations that the ledger still holds, and nothing would stop them: once
// their users released those, the GPUs would be granted twice. So before it
// serves, the containers recorded in `launcher.state_dir` by a launcher that
// no longer runs are swept (Launcher::Cleanup of its id), their allocations
// released and their records removed; `swept` (optional) gets a line for
// each launcher swept. The state_dir also names the launcher that last
// served from it (file launcher_id), so that its containers are swept even
// where their records are damaged; such a container's directory is removed
// and its allocation, which no record names, stays held until released.
//
// Users' containers never run as root: `policy.users` maps each user to the
// uid and gid their containers run as (RunAs), and a user without one can
// allocate but not start a container (PermissionDenied naming the user).
// Images come only from `launcher.images` (a path or another name is
// PermissionDenied naming the catalog; the process backend, which runs on
// the host's files, always takes "host").
absl::StatusOr<std::unique_ptr<gpu::CentralServer>> CreateCentralServer(
    const gpu::CentralServerOptions& options, const LauncherOptions& launcher,
    const ContainerPolicy& policy, std::vector<std::string>* swept = nullptr);

// One container as deepnex-central reports it.
struct CentralContainer {
  std::string name;  // as its user named it
  std::string user;
  std::string allocation_id;
  std::string backend;
  std::string id;  // the backend's id
  State state = State::kStarting;
  int restarts = 0;
  std::string last_exit;  // ExitStatus::ToString(); empty before a run ended
  std::vector<int> gpus;
  double cpus = 0;
  uint64_t memory = 0;
  Usage usage;  // no GPU memory
  std::chrono::system_clock::time_point started_at{};
  // Its allocation was released (it ended and was the last one on it).
  bool allocation_released = false;
  // The node it runs on (its allocation's): through that node's
  // deepnex-agent when it has one, else on deepnex-central's own machine.
  std::string node;
};

// One image of deepnex-central's catalog, as the caller sees it.
struct CentralImage {
  std::string name;  // as the caller names it: NAME, or OWNER/NAME for another's
  std::string tag;
  std::string owner;       // empty: a preset
  std::string visibility;  // preset, public, shared or private
  std::vector<std::string> shared_with;  // shown to its owner and admins
  uint64_t size = 0;                     // bytes
  std::chrono::system_clock::time_point created{};
};

// The Containers service of deepnex-central. Options (address, token, TLS,
// per-call timeout) are gpu::CentralClient's. A user sees and acts on their
// own containers only: another user's is NotFound, as if it did not exist.
// `user` arguments are for admins ("": the caller's own). Thread-safe.
class CentralClient {
 public:
  static absl::StatusOr<std::unique_ptr<CentralClient>> Create(
      const gpu::CentralClientOptions& options);
  virtual ~CentralClient() = default;

  // Starts `spec` on allocation `allocation_id`: NotFound for an unknown id,
  // PermissionDenied for another user's. The allocation applies as in
  // Launcher::Start (spec.allocation must be empty, spec.mounts are
  // subject to the server's --allow-mount directories; spec.user is the
  // allocation's), and so does the server's ContainerPolicy: the container
  // runs as the user's mapped uid, and a user without one, an image not in
  // the server's catalog or a host_network the user is not allowed is
  // PermissionDenied. A name whose container ended is reused.
  virtual absl::StatusOr<CentralContainer> StartContainer(const ContainerSpec& spec,
                                                          const std::string& allocation_id) = 0;
  // The caller's containers, ordered by user and name; admins see everyone's
  // unless `user` filters. `user` "*": every user's, for admins only
  // (PermissionDenied naming the caller otherwise).
  virtual absl::StatusOr<std::vector<CentralContainer>> ListContainers(
      const std::string& user = "") = 0;
  // SIGTERM, SIGKILL after `grace`, no restart; returns once it ended (its
  // allocation released as above).
  virtual absl::StatusOr<CentralContainer> StopContainer(
      const std::string& name, std::chrono::milliseconds grace = std::chrono::seconds(10),
      const std::string& user = "") = 0;
  // The log from byte `offset` on (at most 1 MiB per call; see LogChunk).
  virtual absl::StatusOr<LogChunk> ContainerLogs(const std::string& name, uint64_t offset = 0,
                                                 const std::string& user = "") = 0;
  // Calls `sink` with the log from the start and new output as it comes
  // (polling every `poll`) until the container ended for good and all of its
  // log was passed, or `sink` returns false.
  virtual absl::Status FollowContainerLogs(
      const std::string& name, const std::function<bool(const std::string&)>& sink,
      std::chrono::milliseconds poll = std::chrono::milliseconds(200),
      const std::string& user = "") = 0;

  // ---- The image catalog. An image is NAME[:TAG] (the caller's own, else
  // a preset) or OWNER/NAME[:TAG] (another user's shared with the caller).
  // What the caller may not run is NotFound; what they see but do not own
  // is PermissionDenied to change.

  // What the caller may run (admins: every image), by owner, name and tag.
  virtual absl::StatusOr<std::vector<CentralImage>> ListImages() = 0;
  // Admins: adds image `name` from `source` (a directory on central's host,
  // or "host") as a preset, or as `owner`'s; AlreadyExists unless `force`.
  virtual absl::StatusOr<CentralImage> RegisterImage(const std::string& name,
                                                     const std::string& source,
                                                     const std::string& owner = "",
                                                     bool force = false) = 0;
  // Lets `users` (and with `make_public` everyone) run the caller's image.
  virtual absl::StatusOr<CentralImage> ShareImage(const std::string& name,
                                                  const std::vector<std::string>& users,
                                                  bool make_public = false) = 0;
  // Takes `users`' shares back; none: every share and the public one.
  virtual absl::StatusOr<CentralImage> UnshareImage(const std::string& name,
                                                    const std::vector<std::string>& users) = 0;
  virtual absl::StatusOr<CentralImage> RemoveImage(const std::string& name) = 0;
  // Saves the caller's running oci container `container`'s changes as their
  // own private image `name` (NAME[:TAG]): one new layer on top of its
  // image's, in central's registry. NotFound for another user's container,
  // FailedPrecondition naming the backend for a container not on oci,
  // InvalidArgument naming a bad `name`, AlreadyExists for an image of the
  // caller's with that name and tag.
  virtual absl::StatusOr<CentralImage> Commit(const std::string& container,
                                              const std::string& name) = 0;

  // A session (exec, shell, port-forward) with the caller's running
  // container options.container, where it runs (through its node's
  // deepnex-agent). Errors come from the session's first Read: NotFound for
  // a container that is not the caller's, FailedPrecondition when it is not
  // running, NotFound for a command missing in it, Unavailable for a port
  // nothing listens on.
  virtual absl::StatusOr<std::unique_ptr<Session>> OpenSession(const SessionOptions& options) = 0;
  // Runs `command` in container `name` with `input` as its stdin (then EOF),
  // `output` called with its stdout and stderr as they come; returns its
  // exit code (128 + N for signal N).
  absl::StatusOr<int> Exec(
      const std::string& name, const std::vector<std::string>& command, const std::string& input,
      const std::function<void(bool is_stderr, const std::string& data)>& output,
      const std::string& user = "");
};

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_CENTRAL_H_
