// Cross-backend conformance harness (DESIGN.md §6): runs any registered backend on one case and
// compares it with the REFERENCE backend (fp64) on the same inputs.
//
// Plugging a backend in needs no edit here: run_case(backend, device, case, seed) works for any
// AttentionBackend on any Device. Device handling lives in one place (upload / download in
// harness.cpp): inputs are generated on the host and copied with Tensor::to.
//
// One case = one scheduler step of one attention layer:
//   1. the context (decoder: the cached tokens; encoder_decoder: the encoder K/V) is written
//      through the backend's own do_kv_cache_update, as ONE pseudo-request carrying every context
//      token (so backends that reorder batches need no special handling here);
//   2. the step (the new tokens) runs through an Attention layer forced to the backend (or its
//      impl directly when the backend object is not in the registry, e.g. a test double):
//      reshape_and_cache of the new keys/values, then attention, into outputs poisoned with 0xFF;
//   3. the REFERENCE does the same on its own cache; outputs (first num_actual_tokens rows), LSE
//      and the written cache entries are compared.
// Batch order: when the backend's builder asks for a reorder (reorder_batch), the case's
// requests are permuted first and both backends run the permuted batch.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "pagedattn/pagedattn.h"

namespace pagedattn::conformance {

// One request of a batch. decoder: context_len cached tokens + query_len new ones.
// encoder / encoder_only: context_len must be 0 (no cache). encoder_decoder: context_len is the
// encoder length (its K/V are cached in step 1), query_len the decoder tokens (<= context_len,
// as CommonAttentionMetadata requires seq_len >= query_len).
struct RequestShape {
  int context_len = 0;
  int query_len = 0;
};

enum class Distribution { uniform, normal };  // uniform(-1, 1) or normal(0, 1); never zeros

struct ConformanceCase {
  DType dtype = DType::f32;
  std::string kv_cache_dtype = "auto";
  int head_size = 64;
  int head_size_v = 0;  // 0 = head_size
  int num_heads = 4;
  int num_kv_heads = 4;
  int block_size = 16;
  KVCacheLayout layout = KVCacheLayout::NHD;
  AttentionType attn_type = AttentionType::decoder;
  std::optional<int> sliding_window;
  std::optional<float> soft_cap;
  bool alibi = false;
  bool sinks = false;
  bool return_lse = false;
  bool fp8_output = false;
  bool quant_query = false;          // an fp8_e4m3 query with q_scale (fp8 caches; "quant_query")
  bool per_head_kv_scales = false;  // fp8 caches: per-kv-head k/v scales instead of per tensor
  int cascade_prefix = 0;           // tokens shared by every request (multiple of block_size,
                                    // <= every context_len); passed to build() as
                                    // common_prefix_len
  int pad_tokens = 0;               // padded token rows after num_actual_tokens (slot -1)
  int num_speculative_tokens = 0;   // BuilderConfig::num_speculative_tokens of the builders
  Distribution distribution = Distribution::uniform;
  std::vector<RequestShape> batch;

  int value_head_size() const { return head_size_v > 0 ? head_size_v : head_size; }
  bool fp8_kv() const;
  // One line naming every field that differs from the defaults, e.g.
  // "decoder bf16 kv=fp8_e4m3 D=64 Hq=8 Hkv=2 bs=16 HND window=8 batch=[(17,1),(0,5)]".
  std::string describe() const;
  // The selector view of the case (what validate_configuration sees).
  SelectorConfig selector_config(Device device) const;
};

// DESIGN.md §5: f32 1e-5, f16 2e-3, bf16 8e-3; fp8 KV cache or fp8 output 6e-2.
double tolerance(const ConformanceCase& c);

// The CI grid (a few seconds for the REFERENCE) or, with env PAGEDATTN_FULL_GRID=1, the full
// grid (dtypes x kv dtypes x head sizes x GQA x block sizes x layouts x features x batches).
std::vector<ConformanceCase> conformance_grid();
std::vector<ConformanceCase> conformance_grid(bool full);
bool full_grid_requested();

// Everything generated for one (case, seed), on the host, in the activation dtype.
struct CaseInputs {
  ConformanceCase c;  // batch already in run order
  uint64_t seed = 0;
  int num_actual_tokens = 0;  // sum of query lens
  int num_tokens = 0;         // num_actual_tokens + pad_tokens (rows of query/key/value/output)
  std::vector<int32_t> query_start_loc;  // (num_reqs + 1,)
  std::vector<int32_t> seq_lens;         // (num_reqs,) decoder: context + query; encoder types:
                                         // query; encoder_decoder: encoder length
  int num_blocks = 0;
  int block_table_cols = 0;
  std::vector<int32_t> block_table;        // (num_reqs, block_table_cols): shuffled distinct ids,
                                           // shared leading ids for the cascade prefix, unused
                                           // columns point at spare blocks
  std::vector<int64_t> step_slot_mapping;  // (num_tokens,) new tokens' slots; -1 for padding
                                           // and for encoder types / cross steps
  std::vector<int64_t> context_slot_mapping;  // (num_context_tokens,) -1 where the shared prefix
                                              // was already written by request 0
  std::vector<int32_t> context_start;         // (num_reqs + 1,) rows of request r's context
  Tensor query;                               // (num_tokens, Hq, D); fp8_e4m3 when quant_query
  Tensor key, value;                  // (num_tokens, Hkv, D / Dv) new tokens; undefined for cross
  Tensor context_key, context_value;  // (num_context_tokens, Hkv, D / Dv); rows of request r are
                                      // [context_start[r], context_start[r+1]) = positions 0..
  float scale = 1.f;                  // softmax scale
  float k_scale = 1.f, v_scale = 1.f;
  std::vector<float> k_scale_per_head, v_scale_per_head;  // (Hkv,) when per_head_kv_scales
  std::vector<float> alibi_slopes, sinks;                 // (Hq,) when enabled
  float output_scale = 1.f;                               // fp8 output divisor
  float q_scale = 1.f;                                    // quant_query: query = e4m3(q / q_scale)
  uint64_t cache_fill_seed = 0;  // seed of the stale-data fill of every cache

  int num_reqs() const { return static_cast<int>(c.batch.size()); }
  int query_len(int r) const { return query_start_loc[r + 1] - query_start_loc[r]; }
};

// Generates the inputs of `c` (its batch in the given order) from `seed`.
CaseInputs make_inputs(const ConformanceCase& c, uint64_t seed);

struct RunOptions {
  std::optional<int> common_prefix_len;  // overrides c.cascade_prefix for build()
  std::optional<bool> causal;            // overrides CommonAttentionMetadata::causal of the step
                                         // (default: attn_type == decoder)
};

// What one backend produced, copied back to the host.
struct BackendOutputs {
  std::string backend_name;
  Tensor output;                // (num_tokens, Hq, Dv) activation dtype, or fp8_e4m3
  Tensor output_lse;            // (Hq, num_tokens) f32, when return_lse
  Tensor kv_cache;              // the whole cache as allocated (undefined for encoder types)
  bool standard_cache = false;  // kv_cache logical shape is the standard 5-D one
  bool used_cascade = false;
};

// Everything one backend needs for the step, on its device, after step 1 (context written) and
// with outputs poisoned; execute() runs step 2. Exposed so tests can call the impl directly
// with altered arguments (bad-input tests).
// A backend found in the registry runs through an Attention layer forced to it (the user's
// path); any other backend object (e.g. a test double) runs through its impl directly, with the
// same two calls the layer makes.
struct PreparedRun {
  const AttentionBackend* backend = nullptr;
  Device device = Device::cpu;
  AttentionType case_attn_type = AttentionType::decoder;
  std::unique_ptr<Attention> layer;         // registered backends
  std::unique_ptr<AttentionImpl> own_impl;  // unregistered backends
  LayerScales own_scales;                   // their scales
  std::unique_ptr<AttentionMetadataBuilder> builder;
  Tensor kv_cache;  // empty for encoder types
  Tensor query, key, value;
  Tensor output, output_lse, output_scale;
  Tensor k_scale_per_head, v_scale_per_head;
  OwnedCommonAttentionMetadata step_common;
  std::shared_ptr<const AttentionMetadata> step_metadata;

  AttentionImpl& impl() { return layer ? layer->impl() : *own_impl; }
  const AttentionImpl& impl_const() const { return layer ? layer->impl() : *own_impl; }
  LayerScales& scales() { return layer ? layer->scales() : own_scales; }
};

PreparedRun prepare_run(const AttentionBackend& backend, Device device, const CaseInputs& inputs,
                        const RunOptions& options = {});
void execute(PreparedRun& run);                  // Attention::forward of the step
BackendOutputs collect(const PreparedRun& run);  // copies outputs and cache to the host
BackendOutputs run_backend(const AttentionBackend& backend, Device device, const CaseInputs& inputs,
                           const RunOptions& options = {});

struct ConformanceResult {
  std::string backend_name;
  std::string case_description;
  uint64_t seed = 0;
  double output_rel_error = 0;  // ||out - ref|| / ||ref|| over the first num_actual_tokens rows
  double lse_rel_error = 0;     // same over the finite LSE entries (0 without LSE)
  double tolerance = 0;
  bool all_written = true;         // every output / LSE element of the live rows was written
  int64_t unwritten = 0;           // how many were not (NaN poison left, or inf/NaN produced)
  int64_t lse_inf_mismatches = 0;  // -inf in one LSE but not in the other
  bool cache_compared = false;     // false when the backend's cache shape is not the standard one
  int64_t cache_mismatches = 0;    // written cache entries that differ from the REFERENCE's
  bool used_cascade = false;       // the backend's plan took the cascade path
  bool passed() const;
  std::string describe() const;  // one line for failure messages
};

// Compares two outputs of the same inputs (`ref` is the oracle run).
ConformanceResult compare(const CaseInputs& inputs, const BackendOutputs& out,
                          const BackendOutputs& ref);

// The REFERENCE backend from the registry (throws when it is not registered).
const AttentionBackend& reference();

// Why `backend` cannot run `c` on `device` (empty = it can): validate_configuration's reasons,
// plus a missing "lse" capability when the case asks for the LSE. Everything else in a case is
// part of the contract (per-head KV scales, padding, empty requests, a cascade prefix that a
// backend without cascade simply ignores) and is not a reason to skip.
std::vector<std::string> unsupported_reasons(const AttentionBackend& backend, Device device,
                                             const ConformanceCase& c);

// Runs `backend` on `device` and the REFERENCE on the cpu over the same inputs and compares.
// The batch is permuted first when the backend's builder asks for it.
ConformanceResult run_case(const AttentionBackend& backend, Device device, const ConformanceCase& c,
                           uint64_t seed);

}  // namespace pagedattn::conformance
