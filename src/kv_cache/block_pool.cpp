// BlockPool: a free list (a stack) and per-block reference counts. Every call validates all of
// its arguments before changing anything, so a failed call leaves the pool as it was.
#include <string>
#include <unordered_map>

#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"

namespace pagedattn {

namespace {

// Checks that every id is in range and allocated; when `removing`, also that the references a
// block loses in this call (it may appear several times) do not exceed its count.
void validate_blocks(std::span<const int32_t> blocks, const std::vector<int32_t>& ref_counts,
                     bool removing, const char* what) {
  const int64_t n = static_cast<int64_t>(ref_counts.size());
  std::unordered_map<int32_t, int32_t> taken;  // block -> references dropped so far in this call
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int32_t b = blocks[i];
    PAGEDATTN_CHECK(b >= 0 && b < n, "blocks", what, ": blocks[", i, "] = ", b,
                    " is out of range: expected a block id in [0, ", n, ")");
    const int32_t count = ref_counts[static_cast<size_t>(b)];
    PAGEDATTN_CHECK(count > 0, "blocks", what, ": blocks[", i, "] = ", b,
                    " is not allocated (reference count 0)");
    if (removing) {
      int32_t& dropped = taken[b];
      ++dropped;
      PAGEDATTN_CHECK(dropped <= count, "blocks", what, ": blocks[", i, "] = ", b,
                      " is freed more times than it is referenced (reference count ", count,
                      "): double free");
    }
  }
}

}  // namespace

BlockPool::BlockPool(int num_blocks) {
  PAGEDATTN_CHECK(num_blocks >= 0, "num_blocks", "num_blocks = ", num_blocks, " must be >= 0");
  ref_counts_.assign(static_cast<size_t>(num_blocks), 0);
  free_list_.reserve(static_cast<size_t>(num_blocks));
  // Stack: back() is handed out next, so push the highest id first.
  for (int b = num_blocks - 1; b >= 0; --b) free_list_.push_back(b);
}

std::vector<int32_t> BlockPool::allocate(int n) {
  PAGEDATTN_CHECK(n >= 0, "num_blocks", "allocate: num_blocks = ", n, " must be >= 0");
  PAGEDATTN_CHECK(n <= num_free_blocks(), "num_blocks", "allocate: num_blocks = ", n,
                  " exceeds the ", num_free_blocks(), " free blocks (of ", num_blocks(), ")");
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const int32_t b = free_list_.back();
    free_list_.pop_back();
    ref_counts_[static_cast<size_t>(b)] = 1;
    out.push_back(b);
  }
  return out;
}

void BlockPool::incref(std::span<const int32_t> blocks) {
  validate_blocks(blocks, ref_counts_, false, "incref");
  for (int32_t b : blocks) ++ref_counts_[static_cast<size_t>(b)];
}

void BlockPool::free(std::span<const int32_t> blocks) {
  validate_blocks(blocks, ref_counts_, true, "free");
  // Blocks that reach 0 go back on the stack in reverse, so that the first block freed is the
  // first handed out again (a freed run is reallocated in its original order).
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    if (--ref_counts_[static_cast<size_t>(*it)] == 0) free_list_.push_back(*it);
  }
}

int BlockPool::ref_count(int32_t block) const {
  PAGEDATTN_CHECK(block >= 0 && block < num_blocks(), "block", "ref_count: block = ", block,
                  " is out of range: expected [0, ", num_blocks(), ")");
  return ref_counts_[static_cast<size_t>(block)];
}

}  // namespace pagedattn
