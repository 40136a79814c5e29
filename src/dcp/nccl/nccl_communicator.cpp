// DcpCommunicator over NCCL (pagedattn/dcp_nccl.h). Compiled only when CMake found NCCL
// (src/dcp/module.cmake).
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>

#include "pagedattn/dcp_nccl.h"
#include "pagedattn/device.h"
#include "pagedattn/error.h"

namespace pagedattn {
namespace {

void check_nccl(ncclResult_t status, ncclComm_t comm, const char* call) {
  if (status == ncclSuccess || status == ncclInProgress) return;
  std::string what = ncclGetErrorString(status);
  if (comm != nullptr) {
    if (const char* last = ncclGetLastError(comm); last != nullptr && *last != '\0') what += std::string(": ") + last;
  }
  throw Error("nccl", detail::concat("DCP NCCL: ", call, " failed: ", what));
}

class NcclCommunicator final : public DcpCommunicator {
 public:
  NcclCommunicator(ncclComm_t comm, bool owned) : comm_(comm), owned_(owned) {
    check_nccl(ncclCommCount(comm_, &world_), comm_, "ncclCommCount");
    check_nccl(ncclCommUserRank(comm_, &rank_), comm_, "ncclCommUserRank");
    check_nccl(ncclCommCuDevice(comm_, &device_), comm_, "ncclCommCuDevice");
  }
  ~NcclCommunicator() override {
    if (owned_ && comm_ != nullptr) (void)ncclCommDestroy(comm_);
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int world_size() const override { return world_; }
  int rank() const override { return rank_; }
  Device device() const override { return Device::cuda; }

  // An owned communicator: ncclCommAbort (its pending collectives return, and it is freed). A
  // wrapped one is its owner's to abort or free: it is only refused from now on.
  void abort() override {
    std::lock_guard lock(abort_mu_);
    if (aborted_) return;
    aborted_ = true;
    if (owned_) {
      (void)ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }

  void all_gather(const TensorView& send, const TensorView& recv) override {
    constexpr const char* kWho = "DCP all_gather (NCCL)";
    PAGEDATTN_CHECK(!aborted_, "comm", kWho, ": the communicator was aborted (a rank of the group failed)");
    for (const auto& [t, name] : {std::pair{&send, "send"}, std::pair{&recv, "recv"}}) {
      PAGEDATTN_CHECK(t->defined() && t->device() == Device::cuda && t->device_index() == device_ && t->is_contiguous(),
                      name, kWho, ": ", name, " is ", t->describe(), ", expected a contiguous tensor on cuda:", device_,
                      " (the communicator's device)");
    }
    Shape want;
    want.push_back(world_);
    for (int64_t d : send.shape()) want.push_back(d);
    PAGEDATTN_CHECK(recv.shape() == want && recv.dtype() == send.dtype(), "recv", kWho, ": recv is ", recv.describe(),
                    ", expected ", want.str(), " of ", dtype_name(send.dtype()));
    const size_t bytes = static_cast<size_t>(send.numel()) * send.element_size();
    check_nccl(ncclAllGather(send.data(), recv.data(), bytes, ncclUint8, comm_,
                             static_cast<cudaStream_t>(current_cuda_stream())),
               comm_, "ncclAllGather");
  }

 private:
  ncclComm_t comm_;
  bool owned_;
  std::mutex abort_mu_;
  std::atomic<bool> aborted_{false};
  int world_ = 0, rank_ = 0, device_ = 0;
};

}  // namespace

NcclUniqueId nccl_unique_id() {
  static_assert(sizeof(ncclUniqueId) == sizeof(NcclUniqueId::bytes));
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId");
  NcclUniqueId out;
  std::memcpy(out.bytes.data(), &id, sizeof(id));
  return out;
}

std::unique_ptr<DcpCommunicator> make_nccl_dcp_communicator(const NcclUniqueId& id, int world_size, int rank) {
  PAGEDATTN_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "rank", "make_nccl_dcp_communicator: rank ",
                  rank, " of world_size ", world_size, ": expected 0 <= rank < world_size");
  ncclUniqueId raw;
  std::memcpy(&raw, id.bytes.data(), sizeof(raw));
  ncclComm_t comm = nullptr;
  check_nccl(ncclCommInitRank(&comm, world_size, raw, rank), nullptr, "ncclCommInitRank");
  return std::make_unique<NcclCommunicator>(comm, true);
}

std::unique_ptr<DcpCommunicator> wrap_nccl_dcp_communicator(void* nccl_comm) {
  PAGEDATTN_CHECK(nccl_comm != nullptr, "nccl_comm", "wrap_nccl_dcp_communicator: nccl_comm is null");
  return std::make_unique<NcclCommunicator>(static_cast<ncclComm_t>(nccl_comm), false);
}

std::string nccl_version() {
  int v = 0;
  check_nccl(ncclGetVersion(&v), nullptr, "ncclGetVersion");
  // NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since 2.9.
  return detail::concat(v / 10000, ".", v / 100 % 100, ".", v % 100);
}

}  // namespace pagedattn
