// The DCP group's communicator over NCCL (pagedattn/dcp.h: DcpCommunicator), for device tensors:
// all_gather is one ncclAllGather on current_cuda_stream(), so it orders with the attention
// kernels around it and a CUDA graph can capture it. Built with the CUDA backend when CMake finds
// NCCL (cmake/PagedattnNccl.cmake; built_with_nccl() says whether it was); a program may call
// these only when PAGEDATTN_HAS_NCCL is defined.
//
// One rank = one GPU, as in vLLM: each rank (a process, or a thread) makes its GPU current
// (cudaSetDevice) before creating its communicator, its layers and its caches. Keep NVLink
// multicast off on shared machines (NCCL_NVLS_ENABLE=0).
#pragma once

#include <array>
#include <memory>
#include <string>

#include "pagedattn/dcp.h"

#if PAGEDATTN_HAS_NCCL

namespace pagedattn {

// ncclUniqueId: made by one rank (nccl_unique_id), handed to the others (a pipe, a file, a store)
// before each calls make_nccl_dcp_communicator.
struct NcclUniqueId {
  std::array<char, 128> bytes{};
};
NcclUniqueId nccl_unique_id();

// A new NCCL group (ncclCommInitRank; blocks until every rank has joined) on the calling thread's
// current CUDA device. The communicator owns the ncclComm_t and destroys it.
std::unique_ptr<DcpCommunicator> make_nccl_dcp_communicator(const NcclUniqueId& id, int world_size, int rank);

// An existing ncclComm_t (passed as void*: no NCCL types in this header), e.g. one an engine's
// process group already holds. Not owned; its device is the calling thread's current device.
std::unique_ptr<DcpCommunicator> wrap_nccl_dcp_communicator(void* nccl_comm);

// "2.28.9": the version of the NCCL library loaded at run time.
std::string nccl_version();

}  // namespace pagedattn

#endif  // PAGEDATTN_HAS_NCCL
