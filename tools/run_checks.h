// `pagedattn run`'s checks of its options before any work: every RunOptions value against its
// documented limit (option_limits.h), then the memory the run will allocate against what the
// machine has, so that a run that cannot fit fails with the option to change, not with
// std::bad_alloc (or a machine swapping) after minutes of work.
#pragma once

#include <cstdint>

#include "simulation.h"

namespace pagedattn::cli {

// Throws UsageError naming the first option out of its range (or of its vocabulary: dtype,
// kv-cache dtype, backend, device). Includes the workload's own checks (generate_workload).
void validate_run_options(const RunOptions& options);

// What the run will allocate.
struct RunMemory {
  int num_layers = 0;
  int64_t page_bytes = 0;         // one block in every layer's cache
  int64_t num_blocks = 0;
  bool automatic_num_blocks = false;  // num_blocks came from --kv-cache-gib / the workload
  bool check = false;             // --check keeps a second set of caches on the host
  int64_t activation_bytes = 0;   // q/k/v pools and outputs (host, and the device's copy)
};

// Throws UsageError naming --num-blocks (or --kv-cache-gib when the count is automatic) when the
// caches do not fit the host memory (the device's, on cuda), with the most blocks that fit, and
// --max-num-batched-tokens when the activations alone do not. Unknown memory sizes pass.
void check_run_memory(const RunOptions& options, const RunMemory& memory);

// Bytes of physical memory of this host (0 when unknown).
int64_t host_memory_bytes();

}  // namespace pagedattn::cli
