// The --dcp group of `pagedattn run`: N ranks as threads of this process (pagedattn/dcp.h). On the
// host, an in-memory group. On CUDA, rank r on GPU r with an NCCL communicator (a build with NCCL
// and N visible GPUs; NVLink multicast off): rank r's layers, caches and builders are made with
// GPU r current (OnRank), and its steps run on a thread whose current GPU is r (run).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "pagedattn/dcp.h"
#include "pagedattn/tensor.h"

namespace pagedattn::cli {

class DcpRanks {
 public:
  // UsageError naming --dcp when `device` cannot hold the group (no NCCL, too few GPUs).
  DcpRanks(int world_size, Device device);
  int size() const { return static_cast<int>(comms_.size()); }
  Device device() const { return device_; }
  DcpCommunicator& comm(int rank) const { return *comms_[static_cast<size_t>(rank)]; }
  // body(rank) on every rank, one thread each (its GPU current on CUDA), joined; the lowest rank's
  // exception is rethrown.
  void run(const std::function<void(int)>& body) const;

  // The calling thread on rank r's GPU for the scope (the host: nothing).
  class OnRank {
   public:
    OnRank(const DcpRanks& ranks, int rank);
    ~OnRank();
    OnRank(const OnRank&) = delete;
    OnRank& operator=(const OnRank&) = delete;

   private:
    int previous_ = -1;
  };

 private:
  Device device_;
  std::vector<std::unique_ptr<DcpCommunicator>> comms_;
};

}  // namespace pagedattn::cli
