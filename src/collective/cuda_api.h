// The CUDA runtime and NCCL calls of the nccl backend, loaded with dlopen
// when a nccl communicator is first made rather than linked: libdeepnex then
// loads where they are not installed (a CPU-only node, deepnex-central's
// host), and the nccl backend is FailedPrecondition there, as on a host
// without a GPU. Built only with DEEPNEX_HAVE_NCCL. Private to libdeepnex.
#ifndef DEEPNEX_COLLECTIVE_CUDA_API_H_
#define DEEPNEX_COLLECTIVE_CUDA_API_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/status/statusor.h"

namespace deepnex::collective {

// Every call the backend makes, by its C name (and cudaMalloc, below).
#define DEEPNEX_CUDART_CALLS(X)                                                          \
  X(cudaGetErrorName) X(cudaGetErrorString) X(cudaGetDeviceCount) X(cudaSetDevice)       \
  X(cudaGetDevice) X(cudaStreamCreateWithFlags) X(cudaStreamDestroy) X(cudaStreamQuery) \
  X(cudaFree) X(cudaMemcpyAsync) X(cudaPointerGetAttributes)             \
  X(cudaGetLastError)
#define DEEPNEX_NCCL_CALLS(X)                                                         \
  X(ncclGetErrorString) X(ncclGetLastError) X(ncclGetUniqueId)                       \
  X(ncclCommInitRankConfig) X(ncclCommGetAsyncError) X(ncclCommFinalize)             \
  X(ncclCommDestroy) X(ncclCommAbort) X(ncclAllReduce) X(ncclBroadcast)              \
  X(ncclAllGather) X(ncclReduceScatter)

struct CudaApi {
#define DEEPNEX_CUDA_API_MEMBER(fn) decltype(&::fn) fn = nullptr;
  DEEPNEX_CUDART_CALLS(DEEPNEX_CUDA_API_MEMBER)
  DEEPNEX_NCCL_CALLS(DEEPNEX_CUDA_API_MEMBER)
#undef DEEPNEX_CUDA_API_MEMBER
  // Not in the list: cuda_runtime.h overloads its name with a template.
  cudaError_t (*cudaMalloc)(void** ptr, size_t size) = nullptr;
};

// Loads libcudart.so.<major> and libnccl.so.<major> of the headers built
// against, once per process; FailedPrecondition "backend nccl: no CUDA
// runtime or NCCL here (...)" naming the library or call missing, every
// time after a failed load.
absl::StatusOr<const CudaApi*> LoadCudaApi();

}  // namespace deepnex::collective

#endif  // DEEPNEX_COLLECTIVE_CUDA_API_H_
