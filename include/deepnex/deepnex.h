// The umbrella header: every public header of libdeepnex, for C++ trainers
// that would rather not pick them one by one.
//
//   #include "deepnex/deepnex.h"
//
// Each part is also usable alone through its own header (see
// ARCHITECTURE.md). The test `umbrella_header` fails when a public header
// under include/deepnex/ is missing here.
#ifndef DEEPNEX_DEEPNEX_H_
#define DEEPNEX_DEEPNEX_H_

// core
#include "deepnex/auth.h"
#include "deepnex/env.h"
#include "deepnex/metrics.h"
#include "deepnex/status.h"
#include "deepnex/tensor.h"
#include "deepnex/transport.h"
#include "deepnex/units.h"

// gpu
#include "deepnex/gpu/allocator.h"
#include "deepnex/gpu/central.h"
#include "deepnex/gpu/discovery.h"
#include "deepnex/gpu/jobs.h"
#include "deepnex/gpu/types.h"

// launch
#include "deepnex/launch/central.h"
#include "deepnex/launch/launcher.h"
#include "deepnex/launch/session.h"

// agent
#include "deepnex/agent/agent.h"

// ps
#include "deepnex/ps/client.h"
#include "deepnex/ps/optimizer.h"
#include "deepnex/ps/server.h"

// collective
#include "deepnex/collective/bucketing.h"
#include "deepnex/collective/communicator.h"
#include "deepnex/collective/store.h"

// data
#include "deepnex/data/sharder.h"

// job
#include "deepnex/job/job.h"

#endif  // DEEPNEX_DEEPNEX_H_
