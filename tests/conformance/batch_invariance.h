// Batch-invariance harness (pagedattn/batch_invariance.h): runs a pool of requests through one
// layer of any backend, each request alone and in many random batches, and compares the output
// rows (and LSE) of every request bit for bit with its run alone.
//
// One pool = one scheduler step's worth of requests, each with its own pages (context written
// once, straight into the cache with the public cache ops) and its own new tokens (query, key,
// value; MLA: q, kv_c_normed, k_pe). A batch is a subset of the pool in some order: the builder
// plans it, the layer writes the new tokens (the same bytes to the same slots every time) and
// attends into outputs poisoned with NaN. Batches vary in size, composition, the position of each
// request, decode-only vs mixed, and BuilderConfig::num_sms (the CPU's thread count, the CUDA
// planner's SM count). Shared by the CPU tests and the GPU tests; works on any device.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "conformance/harness.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn::conformance::invariance {

struct InvarianceCase {
  std::string name;
  DType dtype = DType::bf16;
  std::string kv_cache_dtype = "auto";
  int head_size = 64;           // standard layers
  int num_heads = 8;
  int num_kv_heads = 2;         // standard layers
  int block_size = 16;
  std::optional<int> sliding_window;
  bool mla = false;             // an MLAAttention layer (decodes have query_len 1)
  MLADimensions mla_dims{64, 32, 16, 32};
  int64_t mla_workspace_tokens = 0;  // chunked-prefill workspace (0 = vLLM's rule)
  std::vector<RequestShape> pool;    // context_len cached tokens + query_len new ones
  int compositions = 50;        // batches each request must be checked in (besides alone; at
                                // most kSanitizedCompositions under ASan: checked_compositions)
  std::vector<int> num_sms = {0};    // BuilderConfig::num_sms, taken in turn batch after batch
  std::string describe() const;
};

struct InvarianceReport {
  int batches = 0;              // batches run (the runs alone not counted)
  int min_appearances = 0;      // fewest batches any request was checked in
  int decode_only_batches = 0;  // batches of decodes only (query_len <= the builder's threshold
                                // or 1), and the others
  int mixed_batches = 0;
  int64_t differing_requests = 0;  // (request, batch) pairs whose rows differ from the run alone
  std::vector<std::string> differences;  // the first few, described
  bool invariant() const { return differing_requests == 0; }
  std::string describe() const;
};

// The compositions a run of `c` checks each request in: c.compositions, capped at
// kSanitizedCompositions in an ASan build (sanitized_build.h; the Release run keeps them all).
inline constexpr int kSanitizedCompositions = 10;
int checked_compositions(const InvarianceCase& c);

// Runs `c` on `backend` (forced by name; an MLA backend for c.mla) on `device` with builders of
// BuilderConfig::batch_invariant = batch_invariant, from `seed`. Throws what the library throws
// (a case the backend cannot run is the caller's to skip).
InvarianceReport check_batch_invariance(const AttentionBackend& backend, Device device,
                                        const InvarianceCase& c, uint64_t seed,
                                        bool batch_invariant = true);

// GoogleTest expectations on check_batch_invariance(backend, device, c, seed): no request differs,
// each was checked in >= checked_compositions(c) batches, decode-only and mixed batches among them.
void expect_batch_invariant(const AttentionBackend& backend, Device device, const InvarianceCase& c,
                            uint64_t seed);

// The registered backend called `name` (Error naming "name" when there is none).
const AttentionBackend& registered_backend(const char* name);

// The mode computes the same attention: `backend` on `device` over the CI conformance grid (mla:
// the MLA grid, the larger one with full_mla_grid) against the fp64 oracle, with every builder in
// the mode (PAGEDATTN_BATCH_INVARIANT=1 for the call). Cases the backend rejects are skipped; a
// case that fails, or a plan that took the cascade path, is described in `failures`.
struct ModeConformance {
  int ran = 0;
  std::vector<std::string> failures;
};
ModeConformance conformance_in_the_mode(const AttentionBackend& backend, Device device, bool mla,
                                        bool full_mla_grid = false);

}  // namespace pagedattn::conformance::invariance
