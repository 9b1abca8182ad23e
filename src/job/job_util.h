// Small helpers of the job runner (job.cc): names, ports, the host and the
// environment its processes inherit. Private to libdeepnex.
#ifndef DEEPNEX_JOB_JOB_UTIL_H_
#define DEEPNEX_JOB_JOB_UTIL_H_

#include <map>
#include <string>

#include "deepnex/gpu/jobs.h"
#include "deepnex/launch/launcher.h"
#include "deepnex/status.h"

namespace deepnex::job {

// A port the OS considers free now. The parameter servers listen on fixed
// ports (not :0) so that one restarted by its policy comes back where the
// workers already look for it. For a server on another node this is only a
// likely free port there; one that is taken ends the server at once, and
// the job with "ended before serving".
absl::StatusOr<int> ReservePort();
// Whether host:port accepts a TCP connection now.
bool Connects(const std::string& host, int port);
// The job's processes inherit this process's environment, as mpirun's and
// torchrun's do (PATH, PYTHONPATH, HOME, ...), minus any job variables of an
// enclosing job. `as_another_user` (the central backend: deepnex-central
// decides whom they run as): minus this user's identity too (HOME, USER, LOGNAME, MAIL,
// XDG_RUNTIME_DIR), which the launcher sets for the user they run as.
std::map<std::string, std::string> InheritedEnv(bool as_another_user);
// A worker's exit as a process exit code: 128 + signal for a signal, 137 for
// an OOM kill, 1 if lost or stopped.
int ExitCodeOf(const launch::ExitStatus& e);
// A deepnex.report() as python/deepnex/_tune_report.py keeps it in the job's
// store (JSON {"step", "metrics", "time_ms"}); none (the epoch) for a value
// that does not parse.
gpu::JobReport ParseReport(const std::string& value);

}  // namespace deepnex::job

#endif  // DEEPNEX_JOB_JOB_UTIL_H_
