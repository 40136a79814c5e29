// RunBufferPool: the buffer sets (tile scratch, split-KV partial rows, MLA step buffers) that the
// plans of one host builder share, handed out one set per running forward.
//
// Why a pool. A plan is an independent object: plans of one builder, or one plan, may run on
// several threads at once and each run must stay correct (DESIGN.md §1). The buffers a run
// writes are large (per-thread tile scratch, partial rows) and `run` must not allocate, so they
// cannot live in each plan or be made per call. The builder makes one set at construction; a
// forward leases a set for its duration and gives it back. Only when forwards really overlap and
// every set is leased does the pool make another one (an allocation, once per extra level of
// overlap; sets are kept for the next overlap). A single-threaded caller never allocates after
// construction. The mutex is held for a pop or a push only, never while a run computes.
//
// Host memory only: a lease ends when the host call returns, which says nothing about a device
// stream, so device backends keep their one workspace and their plan-generation rule instead.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace pagedattn::host {

// Set: any type with `size_t bytes() const`.
template <class Set>
class RunBufferPool {
 public:
  using Factory = std::function<std::unique_ptr<Set>()>;

  // A set owned by one run until the lease is destroyed.
  class Lease {
   public:
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    Lease(Lease&& other) noexcept
        : pool_(std::exchange(other.pool_, nullptr)), set_(std::exchange(other.set_, nullptr)) {}
    Lease& operator=(Lease&&) = delete;
    ~Lease() {
      if (pool_ != nullptr) pool_->release(set_);
    }
    Set& operator*() const { return *set_; }
    Set* operator->() const { return set_; }

   private:
    friend class RunBufferPool;
    Lease(RunBufferPool* pool, Set* set) : pool_(pool), set_(set) {}
    RunBufferPool* pool_;
    Set* set_;
  };

  RunBufferPool() = default;
  RunBufferPool(const RunBufferPool&) = delete;
  RunBufferPool& operator=(const RunBufferPool&) = delete;

  // Sets the factory and makes the first set (called once, by the builder).
  void start(Factory make) {
    make_ = std::move(make);
    std::unique_ptr<Set> first = make_();
    std::lock_guard<std::mutex> lock(mutex_);
    free_.reserve(1);
    free_.push_back(first.get());
    all_.push_back(std::move(first));
  }

  // A free set, or a new one when every set is leased (overlapping runs only).
  Lease acquire() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        Set* set = free_.back();
        free_.pop_back();
        return Lease(this, set);
      }
    }
    std::unique_ptr<Set> made = make_();  // outside the lock: may be large
    Set* set = made.get();
    std::lock_guard<std::mutex> lock(mutex_);
    all_.push_back(std::move(made));
    free_.reserve(all_.size());  // so that release() never allocates
    return Lease(this, set);
  }

  // Sets made so far (1 + the deepest overlap seen beyond one run).
  size_t num_sets() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return all_.size();
  }

  // Bytes of every set made so far.
  size_t bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t total = 0;
    for (const auto& set : all_) total += set->bytes();
    return total;
  }

 private:
  void release(Set* set) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(set);
  }

  Factory make_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Set>> all_;
  std::vector<Set*> free_;
};

}  // namespace pagedattn::host
