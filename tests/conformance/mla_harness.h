// MLA conformance harness: runs any MLA backend (+ a prefill backend) on random batches and
// compares it with REFERENCE_MLA (the fp64 oracle of the un-absorbed formula) on identical
// inputs and separate caches.
//
// One case = one scheduler step of one MLA layer:
//   1. random weights (kv_b_proj), activations, latent context rows, a shuffled block table;
//      each backend gets its own cache (stale random data), the context rows are written with
//      concat_and_cache_mla on the backend's device;
//   2. the step runs through an MLAAttention layer forced to the backend and prefill backend
//      (or, for a backend object that is not registered, e.g. a test double, through its impl
//      with the same calls the layer makes): plan (the backend's builder) -> cache write ->
//      forward into outputs poisoned with NaN;
//   3. REFERENCE_MLA does the same on the cpu; every element of the first num_actual_tokens
//      rows is checked written and finite, ‖out − ref‖/‖ref‖ and the LSE error are measured
//      against DESIGN.md's tolerances, and the written cache rows are compared byte for byte.
// A case with output_scale > 0 runs both with fused fp8 output (an fp8_e4m3 output and a float32
// (1,) output_scale; layers built with fp8_output = true) and compares the e4m3 values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/pagedattn.h"

namespace pagedattn::conformance::mla {

struct MLARequest {
  int context_len = 0;  // cached tokens before the step
  int query_len = 1;    // new tokens (1, or up to 1 + num_speculative_tokens: a decode); decodes first
};

struct MLACase {
  std::string name;                      // short label for reports
  DType dtype = DType::f32;
  std::string kv_cache_dtype = "auto";
  MLADimensions dims{64, 32, 16, 32};    // L, P, R, V
  int num_heads = 4;
  int block_size = 16;
  int64_t workspace_tokens = 0;          // chunked-prefill workspace; 0 = vLLM's rule
  bool return_lse = true;
  bool output_2d = false;                // output as (T, H * V)
  int pad_tokens = 0;                    // rows after num_actual_tokens (slot -1)
  float output_scale = 0.f;              // > 0: fp8_e4m3 output = saturate(o / output_scale)
  // > 0: the builders' num_speculative_tokens k: requests of up to 1 + k tokens are decodes (the
  // absorbed path, causal among their tokens), listed first.
  int num_speculative_tokens = 0;
  std::vector<MLARequest> batch;

  bool fp8_kv() const;
  bool fp8_output() const { return output_scale > 0.f; }
  DType output_dtype() const { return fp8_output() ? DType::fp8_e4m3 : dtype; }
  std::string describe() const;  // "bf16 kv=fp8 L=64 P=32 R=16 V=32 H=4 bs=16 W=32 [(40,1),(30,5)]"
};

// DESIGN.md §5: f32 1e-5, f16 2e-3, bf16 8e-3; an fp8 cache or fp8 output 6e-2.
double tolerance(const MLACase& c);

// The small MLA layer of the unit tests (DeepSeek's layout scaled down: latent 64, nope 32,
// rope 16, v 32; 4 heads, block 16; f32 on the cpu); callers change what their test is about.
MLAAttentionLayerParams small_mla_layer_params(const std::string& backend = "", DType dtype = DType::f32);
// A step for that layer's tests: a decode (seq_len 5) and a 2-token prefill over blocks {0, 1} and
// {2, 3} of 16 tokens, writing slots 4, 32 and 33; host arrays on the cpu.
OwnedCommonAttentionMetadata small_mla_step_metadata();

// The CI grid (small dims and DeepSeek dims; decode only, prefill only, 1 / 2 / many context
// chunks, mixed, fp8 caches, fp8 output, block sizes 16 and 64; a few seconds for REFERENCE_MLA
// vs itself), or the
// larger one (env PAGEDATTN_FULL_GRID=1 or full = true).
std::vector<MLACase> mla_grid(bool full);
std::vector<MLACase> mla_grid();

struct MLAResult {
  std::string backend_name, prefill_backend_name, case_description;
  bool skipped = false;            // the backend rejects the case (reasons below); counts as passed
  std::vector<std::string> skip_reasons;
  uint64_t seed = 0;
  double output_rel_error = 0, lse_rel_error = 0, tolerance = 0;
  int64_t unwritten = 0;           // NaN / inf left in the live output or LSE rows
  int64_t lse_inf_mismatches = 0;  // -inf in one LSE and not in the other
  int64_t cache_mismatches = 0;    // written cache elements that differ from the REFERENCE's
  bool passed() const;
  std::string describe() const;
};

// The selector view of a case (use_mla, head_size L + R, dims, heads, dtypes, block size,
// fp8_output).
SelectorConfig selector_config(const MLACase& c, Device device);
// Why `backend` cannot run `c` on `device` (empty = it can): validate_configuration's reasons and
// an unsupported kernel block size.
std::vector<std::string> unsupported_reasons(const AttentionBackend& backend, Device device,
                                             const MLACase& c);

// Runs `backend` (an MLA backend) with prefill backend `prefill_backend` ("" = selected) on
// `device` and REFERENCE_MLA on the cpu over the same inputs.
MLAResult run_mla_case(const AttentionBackend& backend, std::string_view prefill_backend,
                       Device device, const MLACase& c, uint64_t seed);

// What one backend wrote for the inputs of (case, seed) (host copies): output (T, H, V) or
// (T, H * V) in c.output_dtype(), lse (H, T) when c.return_lse, the cache after the step.
struct MLAOutputs {
  std::string backend_name, prefill_name;
  int64_t num_actual_tokens = 0;
  Tensor output, lse, cache;
};
// Runs `backend` alone on the inputs run_mla_case generates for (c, seed): the same seed gives
// the same inputs whatever c.output_scale, so a case and its fp8-output twin are comparable.
MLAOutputs run_mla_outputs(const AttentionBackend& backend, std::string_view prefill_backend,
                           Device device, const MLACase& c, uint64_t seed);

// An e4m3 output against an activation-dtype output of the same inputs quantized on the host,
// saturate_e4m3(float(act) / scale) (one f32 division: the quantize pass's arithmetic), over the
// first `elements` elements. Distances are in e4m3 steps (adjacent codes on the number line,
// +0 = -0).
struct QuantizedComparison {
  int64_t elements = 0;
  int64_t unwritten = 0;    // NaN left in the fp8 output (its poison 0x7F / 0xFF)
  int64_t mismatches = 0;   // elements whose codes differ
  int max_steps = 0;        // the largest distance
  int64_t saturated = 0;    // elements at +-448 in the fp8 output
  std::string describe() const;
};
QuantizedComparison compare_with_quantized(const Tensor& fp8, const Tensor& act, float scale,
                                           int64_t elements);

// Every case of `grid` with seeds seed, seed + 1, ...; a case the backend rejects
// (unsupported_reasons) is returned as skipped, with its reasons.
std::vector<MLAResult> run_mla_grid(const AttentionBackend& backend,
                                    std::string_view prefill_backend, Device device,
                                    const std::vector<MLACase>& grid, uint64_t seed = 1);

}  // namespace pagedattn::conformance::mla
