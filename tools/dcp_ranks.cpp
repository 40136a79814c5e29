// The --dcp group of `pagedattn run` (dcp_ranks.h).
#include "dcp_ranks.h"

#include <cstdlib>
#include <string>

#include "cli_common.h"
#include "pagedattn/dcp_nccl.h"
#include "pagedattn/device.h"

namespace pagedattn::cli {

DcpRanks::DcpRanks(int world_size, Device device) : device_(device) {
  if (device == Device::cpu) {
    comms_ = make_in_memory_dcp_group(world_size);
    return;
  }
#if PAGEDATTN_HAS_NCCL
  const int gpus = cuda_device_count();
  if (gpus < world_size) {
    throw UsageError("--dcp: " + std::to_string(world_size) + " ranks need one GPU each, " + std::to_string(gpus) +
                     " are visible");
  }
  setenv("NCCL_NVLS_ENABLE", "0", 1);  // no NVLink multicast: shared machines forbid it
  const NcclUniqueId id = nccl_unique_id();
  comms_.resize(static_cast<size_t>(world_size));
  comms_.shrink_to_fit();
  // ncclCommInitRank blocks until every rank has joined: one thread per rank.
  run_dcp_ranks(world_size, [&](int r) {
    set_current_cuda_device(r);
    comms_[static_cast<size_t>(r)] = make_nccl_dcp_communicator(id, world_size, r);
  });
#else
  (void)world_size;
  throw UsageError("--dcp with --device cuda needs NCCL, and this build has none (cmake/PagedattnNccl.cmake; "
                   "scripts/install-deps --nccl): use --device cpu");
#endif
}

void DcpRanks::run(const std::function<void(int)>& body) const {
  run_dcp_ranks(
      size(),
      [&](int r) {
        if (device_ == Device::cuda) set_current_cuda_device(r);
        body(r);
      },
      comms_);
}

DcpRanks::OnRank::OnRank(const DcpRanks& ranks, int rank) {
  if (ranks.device() != Device::cuda) return;
  previous_ = current_cuda_device();
  set_current_cuda_device(rank);
}

DcpRanks::OnRank::~OnRank() {
  if (previous_ < 0) return;
  try {
    set_current_cuda_device(previous_);
  } catch (...) {  // (a destructor: the device was current a moment ago)
  }
}

}  // namespace pagedattn::cli
