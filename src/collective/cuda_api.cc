#include "collective/cuda_api.h"

#include <dlfcn.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace deepnex::collective {
namespace {

// The sonames of the headers' major versions: another major's calls may
// differ in their types.
const std::string kCudart = absl::StrCat("libcudart.so.", CUDART_VERSION / 1000);
const std::string kNccl = absl::StrCat("libnccl.so.", NCCL_MAJOR);

absl::Status Unloadable(const std::string& what) {
  return absl::FailedPreconditionError(
      absl::StrCat("backend nccl: no CUDA runtime or NCCL here (", what, ")"));
}

absl::StatusOr<CudaApi> Load() {
  // Never closed: CUDA's and NCCL's own threads may outlive any user of
  // them, as they do when linked.
  void* cudart = dlopen(kCudart.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (cudart == nullptr) return Unloadable(dlerror());
  void* nccl = dlopen(kNccl.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (nccl == nullptr) return Unloadable(dlerror());
  CudaApi api;
#define DEEPNEX_CUDA_API_LOAD(lib, name, fn)                                    \
  api.fn = reinterpret_cast<decltype(api.fn)>(dlsym(lib, #fn));               \
  if (api.fn == nullptr) return Unloadable(absl::StrCat(name, " lacks " #fn));
#define DEEPNEX_CUDART_LOAD(fn) DEEPNEX_CUDA_API_LOAD(cudart, kCudart, fn)
#define DEEPNEX_NCCL_LOAD(fn) DEEPNEX_CUDA_API_LOAD(nccl, kNccl, fn)
  DEEPNEX_CUDART_CALLS(DEEPNEX_CUDART_LOAD)
  DEEPNEX_CUDART_LOAD(cudaMalloc)
  DEEPNEX_NCCL_CALLS(DEEPNEX_NCCL_LOAD)
#undef DEEPNEX_NCCL_LOAD
#undef DEEPNEX_CUDART_LOAD
#undef DEEPNEX_CUDA_API_LOAD
  return api;
}

}  // namespace

absl::StatusOr<const CudaApi*> LoadCudaApi() {
  static const absl::StatusOr<CudaApi>* const loaded = new absl::StatusOr<CudaApi>(Load());
  if (!loaded->ok()) return loaded->status();
  return &**loaded;
}

}  // namespace deepnex::collective
