// Decode context parallelism on the host: the N-way LSE merge and the in-memory group (one process,
// one thread per rank) of pagedattn/dcp.h. The per-rank step is in dcp_forward.cpp.
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "pagedattn/backend.h"
#include "pagedattn/dcp.h"
#include "pagedattn/error.h"

namespace pagedattn {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void check_host(const TensorView& t, const char* argument, const char* who) {
  PAGEDATTN_CHECK(t.defined() && t.device() == Device::cpu, argument, who, ": ", argument, " (", t.describe(),
                  ") must be a host tensor (device tensors go through a DcpPlan and dcp_combine(plan, ...))");
}

// Offset in elements of element (i, j, k) of a rank-2 or rank-3 view (k ignored for rank 2).
int64_t offset3(const TensorView& t, int64_t i, int64_t j, int64_t k) {
  int64_t o = i * t.stride(0) + j * t.stride(1);
  if (t.ndim() == 3) o += k * t.stride(2);
  return o;
}

// An in-memory group: all_gather through a shared table of the ranks' send views and a generation
// barrier (everyone published -> everyone copies -> everyone done, so a send outlives the copies).
struct InMemoryGroupState {
  explicit InMemoryGroupState(int n) : world(n), sends(static_cast<size_t>(n)) {}
  int world;
  std::vector<TensorView> sends;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;

  void barrier() {
    std::unique_lock lock(mu);
    check_not_aborted();
    const uint64_t gen = generation;
    if (++arrived == world) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    cv.wait(lock, [&] { return generation != gen || aborted; });
    if (generation == gen) check_not_aborted();
  }
  void abort() {
    std::lock_guard lock(mu);
    aborted = true;
    cv.notify_all();
  }
  void check_not_aborted() const {
    PAGEDATTN_CHECK(!aborted, "comm", "DCP all_gather: another rank of the in-memory group failed (the group was "
                    "aborted)");
  }
};

class InMemoryCommunicator final : public DcpCommunicator {
 public:
  InMemoryCommunicator(std::shared_ptr<InMemoryGroupState> state, int rank) : state_(std::move(state)), rank_(rank) {}
  int world_size() const override { return state_->world; }
  int rank() const override { return rank_; }

  void abort() override { state_->abort(); }

  void all_gather(const TensorView& send, const TensorView& recv) override {
    constexpr const char* kWho = "DCP all_gather";
    check_host(send, "send", kWho);
    check_host(recv, "recv", kWho);
    PAGEDATTN_CHECK(send.is_contiguous() && recv.is_contiguous(), "send", kWho,
                    ": send and recv must be contiguous");
    Shape want;
    want.push_back(state_->world);
    for (int64_t d : send.shape()) want.push_back(d);
    PAGEDATTN_CHECK(recv.shape() == want && recv.dtype() == send.dtype(), "recv", kWho, ": recv is ",
                    recv.describe(), ", expected ", want.str(), " of ", dtype_name(send.dtype()));
    state_->sends[static_cast<size_t>(rank_)] = send;
    state_->barrier();
    const size_t bytes = static_cast<size_t>(send.numel()) * send.element_size();
    for (int r = 0; r < state_->world; ++r) {
      const TensorView& s = state_->sends[static_cast<size_t>(r)];
      PAGEDATTN_CHECK(s.shape() == send.shape() && s.dtype() == send.dtype(), "send", kWho, ": rank ", r,
                      " sent ", s.describe(), " but rank ", rank_, " ", send.describe(), ": every rank sends the same shape");
      std::memcpy(static_cast<uint8_t*>(recv.data()) + static_cast<size_t>(r) * bytes, s.data(), bytes);
    }
    state_->barrier();
  }

 private:
  std::shared_ptr<InMemoryGroupState> state_;
  int rank_;
};

}  // namespace

void merge_attn_states_n(std::span<const TensorView> outs, std::span<const TensorView> lses, const TensorView& out,
                         const TensorView& out_lse) {
  constexpr const char* kWho = "merge_attn_states_n";
  PAGEDATTN_CHECK(!outs.empty() && outs.size() == lses.size(), "outs", kWho, ": outs has ", outs.size(),
                  " entries and lses ", lses.size(), ": expected the same number, at least one");
  check_host(out, "out", kWho);
  PAGEDATTN_CHECK(out.ndim() == 3, "out", kWho, ": out is ", out.describe(), ", expected (T, H, D)");
  const int64_t t = out.size(0), h = out.size(1), d = out.size(2);
  for (size_t r = 0; r < outs.size(); ++r) {
    check_host(outs[r], "outs", kWho);
    check_host(lses[r], "lses", kWho);
    PAGEDATTN_CHECK(outs[r].shape() == out.shape() && outs[r].dtype() == out.dtype(), "outs", kWho, ": outs[", r,
                    "] is ", outs[r].describe(), ", expected the shape and dtype of out ", out.describe());
    PAGEDATTN_CHECK(lses[r].ndim() == 2 && lses[r].size(0) == h && lses[r].size(1) >= t && lses[r].dtype() == DType::f32,
                    "lses", kWho, ": lses[", r, "] is ", lses[r].describe(), ", expected float32 (", h, ", >= ", t, ")");
  }
  if (out_lse.defined()) {
    check_host(out_lse, "out_lse", kWho);
    PAGEDATTN_CHECK(out_lse.ndim() == 2 && out_lse.size(0) == h && out_lse.size(1) >= t && out_lse.dtype() == DType::f32,
                    "out_lse", kWho, ": out_lse is ", out_lse.describe(), ", expected float32 (", h, ", >= ", t, ")");
  }
  const size_t n = outs.size();
  std::vector<float> weight(n);
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t j = 0; j < h; ++j) {
      float m = kNegInf;
      bool nan = false;  // a rank's row saw a NaN logit: the merged row is NaN (out and LSE)
      for (size_t r = 0; r < n; ++r) {
        const float l = lses[r].data_as<const float>()[j * lses[r].stride(0) + i * lses[r].stride(1)];
        nan = nan || std::isnan(l);
        if (l > m && l != std::numeric_limits<float>::infinity()) m = l;
      }
      if (nan) {
        const float q = std::numeric_limits<float>::quiet_NaN();
        for (int64_t k = 0; k < d; ++k) store_f32(out.data(), out.dtype(), offset3(out, i, j, k), q);
        if (out_lse.defined()) out_lse.data_as<float>()[j * out_lse.stride(0) + i * out_lse.stride(1)] = q;
        continue;
      }
      float sum = 0.f;
      for (size_t r = 0; r < n; ++r) {
        const float l = lses[r].data_as<const float>()[j * lses[r].stride(0) + i * lses[r].stride(1)];
        weight[r] = m == kNegInf || !(l > kNegInf) || l == std::numeric_limits<float>::infinity() ? 0.f : std::exp(l - m);
        sum += weight[r];
      }
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      for (int64_t k = 0; k < d; ++k) {
        float acc = 0.f;
        for (size_t r = 0; r < n; ++r) {
          if (weight[r] != 0.f) acc += weight[r] * load_f32(outs[r].data(), outs[r].dtype(), offset3(outs[r], i, j, k));
        }
        store_f32(out.data(), out.dtype(), offset3(out, i, j, k), acc * inv);
      }
      if (out_lse.defined()) {
        out_lse.data_as<float>()[j * out_lse.stride(0) + i * out_lse.stride(1)] = sum > 0.f ? m + std::log(sum) : kNegInf;
      }
    }
  }
}

bool built_with_nccl() {
#if PAGEDATTN_HAS_NCCL
  return true;
#else
  return false;
#endif
}

std::vector<std::unique_ptr<DcpCommunicator>> make_in_memory_dcp_group(int world_size) {
  PAGEDATTN_CHECK(world_size >= 1, "world_size", "make_in_memory_dcp_group: world_size = ", world_size,
                  " must be >= 1");
  auto state = std::make_shared<InMemoryGroupState>(world_size);
  std::vector<std::unique_ptr<DcpCommunicator>> group;
  for (int r = 0; r < world_size; ++r) group.push_back(std::make_unique<InMemoryCommunicator>(state, r));
  return group;
}

void run_dcp_ranks(int world_size, const std::function<void(int)>& body,
                   std::span<const std::unique_ptr<DcpCommunicator>> group) {
  PAGEDATTN_CHECK(world_size >= 1, "world_size", "run_dcp_ranks: world_size = ", world_size, " must be >= 1");
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world_size));
  std::mutex mu;
  int first = -1;  // the rank that failed first (the others may fail because it did)
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
        bool abort_group = false;
        {
          std::lock_guard lock(mu);
          if (first < 0) {
            first = r;
            abort_group = true;
          }
        }
        if (abort_group) {
          for (const auto& comm : group) {
            if (comm) comm->abort();
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (first >= 0) std::rethrow_exception(errors[static_cast<size_t>(first)]);
}

}  // namespace pagedattn
