// NaN logits on the CUDA_MLA backend (DeepSeek latent attention), every kernel a plan can take:
// the mma.sync latent decode kernel (16 heads a CTA at <= 32 heads, 64 at 128 heads with an fp8
// cache or under the override mla=mma), the Hopper wgmma decode kernel (128 heads, 16-bit cache,
// sm_90a), the split-KV combine, and the "CUDA" prefill kernel over the new tokens and over the
// context chunks with their LSE merges. The rule, as REFERENCE_MLA (fp64, un-absorbed): a NaN
// logit of a key a query row sees makes that whole row NaN, output and LSE (e^{NaN - m} is NaN);
// NaN in a slot no row sees (past a request's end in its last page, a key causally after a
// prefill row's position) has no effect.
// Why: the kernels' running max is fmaxf, which drops NaN, so a NaN logit reaches the row only
// through its exponential; a masked key must be selected out (its logit -inf) and its value row
// kept out of P·V (0 x NaN is NaN: the decode kernels zero-fill the rows past a segment's end,
// the prefill kernel's causal mask only sets logits); the LSE comes from the row sum
// (l > 0 ? ... : -inf would turn a NaN sum into -inf), a split row's partial LSE goes into the
// combine's weights and a context chunk's LSE into merge_attn_states.
// MLA has one latent KV head: a NaN in a key's latent row (kv_c, elements [0, 512), which also
// makes its value NaN, or the rope part k_pe, elements [512, 576)) reaches every query head of
// the rows that see the key; a NaN query element (q_nope [0, 128) or q_pe [128, 192)) only its
// own (token, head) row. NaN comes from the latent cache (bf16 quiet NaN, fp8 e4m3 0x7F / 0xFF,
// written into the cache after the context was written), from the step's kv_c / k_pe inputs
// (stored by the step's own cache write: decodes read their own key back from the cache) or from
// a query element. Scenarios:
//   decode: one-token decodes (block 64, the kernels' 64-key tiles): NaN in the only key, a NaN
//           query with one key, a cached key's rope part, past the end of a request's last page
//           (no effect), a later part of a long request (split-KV: the balanced plan cuts every
//           request of two tiles or more on a GPU with tens of SMs; the split counts are printed),
//           past the end of a split request (no effect), the token's own key (rope part) in the
//           last tile of a split request, a NaN query in a split request, the last cached key;
//   mixed:  a decode then prefill chunks after 0 to 100 cached tokens (block 16, a small
//           chunked-prefill workspace: the context comes in several chunks merged by LSE): NaN
//           keys in the new tokens that only the later rows of a chunk see (kv_c: its value row
//           too, and rope only: the earlier rows stay finite), a cached key in a later context
//           chunk (every row), keys past a request's end (no effect), NaN query elements.
// Each scenario runs at 16 and 128 heads with a bf16 latent cache and an fp8 e4m3 one (bf16
// activations, DeepSeek-V3 dims, LSE returned). Each case runs REFERENCE_MLA once and CUDA_MLA
// under the default kernel choice and PAGEDATTN_CUDA_KERNEL=mla=mma (kernel_override.h; the same
// kernel where the default is already mma.sync). Outputs and LSE are set to a sentinel before the
// call (the harness poisons with NaN, which could not be told from a NaN result) and must all be
// written: NaN in exactly the rows expected (REFERENCE must agree with the expectation too),
// elsewhere finite and within the other MLA GPU tests' tolerance of REFERENCE
// (conformance::mla::tolerance: bf16 8e-3, fp8 cache 6e-2) as a whole, and 4x that per row and
// LSE element. One summary line per run ("[ mla-nan ]"), one failure line per wrong request.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../../src/backends/cuda/mla/mla_cuda_backend.h"
#include "../../src/backends/cuda/mla/mla_decode.h"
#include "conformance/mla_harness.h"
#include "gpu_test_util.h"
#include "pagedattn/device.h"
#include "pagedattn/mla.h"

namespace pagedattn {
namespace {

namespace cm = conformance::mla;
namespace md = cuda::mla_decode;

constexpr int kL = 512, kP = 128, kR = 64, kV = 128;
constexpr int kRow = kL + kR;         // latent cache row
constexpr int kQ = kP + kR;           // query head
constexpr float kSentinel = -7777.f;  // no output or LSE reaches it
constexpr DType kAct = DType::bf16;

// The backend under test and its device.
constexpr const char* kBackend = "CUDA_MLA";
constexpr Device kDevice = Device::cuda;

// One NaN: in the latent cache (request req's cached row `pos`, element `dim` < 576; pos <
// context_len or >= seq_len, rows the step does not write), in the step's inputs (the request's
// token `pos`, its own key: kv_c for dim < 512, k_pe[dim - 512] above), or in the query (token
// `pos` of the request, head `head`, element `dim` < 192). `negative`: the sign bit set.
struct NanSpot {
  enum Kind { cache, input, query } kind;
  int req, pos, dim;
  int head = 0;
  bool negative = false;
};

struct Scenario {
  const char* name;
  int block_size;
  int64_t workspace_tokens;                 // chunked-prefill workspace (0 = vLLM's rule)
  std::vector<std::pair<int, int>> batch;   // (context, query tokens), decodes first
  std::vector<NanSpot> spots;
};

const Scenario& decode_scenario() {
  static const Scenario s = {
      "decode",
      64,
      0,
      {{0, 1}, {0, 1}, {40, 1}, {45, 1}, {260, 1}, {180, 1}, {130, 1}, {150, 1}, {64, 1}},
      {
          {NanSpot::input, 0, 0, 7},                    // its only key (kv_c)
          {NanSpot::query, 1, 0, 11, 3},                // its only key, a NaN query (q_nope, head 3)
          {NanSpot::cache, 2, 37, 520},                 // a cached key's rope part
          {NanSpot::cache, 3, 46, 5},                   // past the end (keys 0 .. 45, page 0 .. 63)
          {NanSpot::cache, 3, 63, 570, 0, true},        // past the end, the page's last row
          {NanSpot::cache, 4, 200, 100},                // tile 3 of 5: a later part of a split request
          {NanSpot::cache, 5, 181, 3},                  // past the end of a split request (keys 0 .. 180)
          {NanSpot::cache, 5, 191, 575, 0, true},       // past the end, the last page's last row
          {NanSpot::input, 6, 0, 530},                  // its own key's rope part (position 130, last tile)
          {NanSpot::query, 7, 0, 150, 15, true},        // a NaN query in a split request (q_pe, head 15)
          {NanSpot::cache, 8, 63, 0},                   // the last cached key (its own key in tile 2)
      }};
  return s;
}

const Scenario& mixed_scenario() {
  static const Scenario s = {
      "mixed",
      16,
      80,  // the least workspace (max_num_seqs * block_size): chunks of 16 context tokens each
      {{40, 1}, {0, 40}, {100, 30}, {70, 20}, {50, 10}},
      {
          {NanSpot::cache, 0, 10, 300},                 // the decode: a cached key
          // Request 1, positions 0 .. 39 (new tokens only).
          {NanSpot::input, 1, 25, 5},                   // kv_c: tokens 25 .. 39 (0 .. 24 stay finite)
          {NanSpot::query, 1, 5, 40, 3},                // one row (token 5, head 3)
          // Request 2, positions 100 .. 129.
          {NanSpot::cache, 2, 70, 540},                 // a later context chunk: every row
          // Request 3, positions 70 .. 89; seq_len 90, last page 80 .. 95.
          {NanSpot::input, 3, 12, 560},                 // rope only: tokens 12 .. 19
          {NanSpot::cache, 3, 95, 9},                   // past the end: no effect
          {NanSpot::query, 3, 3, 130, 10, true},        // one row (token 3, head 10, q_pe)
          // Request 4, positions 50 .. 59; seq_len 60, last page 48 .. 63.
          {NanSpot::cache, 4, 61, 2, 0, true},          // past the end: no effect
          {NanSpot::cache, 4, 63, 511},                 // past the end: no effect
          {NanSpot::input, 4, 7, 500},                  // kv_c: tokens 7 .. 9
          {NanSpot::query, 4, 0, 191, 0},               // one row (token 0, head 0, the last q_pe element)
      }};
  return s;
}

// The kernel overrides a case runs under ("" = the default choice).
constexpr const char* kVariants[] = {"", "mla=mma"};

// Everything one case feeds both backends, on the host: the latent cache holds the context rows
// (zeros elsewhere) and the scenario's cache NaNs; q / kv_c / k_pe hold its input NaNs.
struct StepInputs {
  int heads = 0, blocks = 0, cols = 0, tokens = 0, max_seq = 0;
  const char* kv_cache_dtype = "auto";
  std::vector<int> token_begin;  // first token of each request (+ the total)
  CommonAttentionMetadataArgs args;
  Tensor weight, q, kv_c, k_pe, cache;
  float k_scale = 1.f;
};

StepInputs make_step(const Scenario& s, int heads, const char* kv_cache_dtype, uint64_t seed) {
  StepInputs in;
  in.heads = heads;
  in.kv_cache_dtype = kv_cache_dtype;
  const int nreq = static_cast<int>(s.batch.size());
  in.token_begin = {0};
  for (const auto& [ctx, q] : s.batch) {
    in.token_begin.push_back(in.token_begin.back() + q);
    in.max_seq = std::max(in.max_seq, ctx + q);
  }
  in.tokens = in.token_begin.back();
  in.cols = (in.max_seq + s.block_size - 1) / s.block_size;
  in.blocks = nreq * in.cols + 2;
  std::vector<int32_t> perm(static_cast<size_t>(in.blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(static_cast<uint32_t>(seed)));
  in.args.query_start_loc.assign(in.token_begin.begin(), in.token_begin.end());
  in.args.max_num_blocks_per_req = in.cols;
  std::vector<int64_t> ctx_slots;
  for (int r = 0; r < nreq; ++r) {
    const auto [ctx, q] = s.batch[static_cast<size_t>(r)];
    in.args.seq_lens.push_back(ctx + q);
    for (int j = 0; j < in.cols; ++j) in.args.block_table.push_back(perm[static_cast<size_t>(r * in.cols + j)]);
    for (int pos = 0; pos < ctx + q; ++pos) {
      const int64_t slot = int64_t{perm[static_cast<size_t>(r * in.cols + pos / s.block_size)]} * s.block_size +
                           pos % s.block_size;
      (pos < ctx ? ctx_slots : in.args.slot_mapping).push_back(slot);
    }
  }
  const bool fp8 = std::string(kv_cache_dtype) != "auto";
  in.k_scale = fp8 ? 0.05f : 1.f;
  in.weight = gpu_test::random_host(Shape{int64_t{heads} * (kP + kV), kL}, kAct, seed + 1, -0.08f, 0.08f);
  in.q = gpu_test::random_host(Shape{in.tokens, heads, kQ}, kAct, seed + 2);
  in.kv_c = gpu_test::random_host(Shape{in.tokens, kL}, kAct, seed + 3);
  in.k_pe = gpu_test::random_host(Shape{in.tokens, kR}, kAct, seed + 4);
  in.cache = Tensor(Shape{in.blocks, s.block_size, kRow}, kv_cache_storage_dtype(kv_cache_dtype, kAct), Device::cpu);
  in.cache.fill_bytes(0);
  if (!ctx_slots.empty()) {
    const int64_t n = static_cast<int64_t>(ctx_slots.size());
    Tensor slots(Shape{n}, DType::i64, Device::cpu);
    std::copy(ctx_slots.begin(), ctx_slots.end(), slots.data_as<int64_t>());
    concat_and_cache_mla(gpu_test::random_host(Shape{n, kL}, kAct, seed + 5),
                         gpu_test::random_host(Shape{n, kR}, kAct, seed + 6), in.cache, slots, kv_cache_dtype,
                         in.k_scale);
  }
  // The NaNs, after the context was written.
  for (const NanSpot& n : s.spots) {
    const float nan = n.negative ? -std::nanf("") : std::nanf("");
    const int token = in.token_begin[static_cast<size_t>(n.req)] + n.pos;
    switch (n.kind) {
      case NanSpot::cache: {
        const int64_t block = in.args.block_table[static_cast<size_t>(n.req * in.cols + n.pos / s.block_size)];
        store_f32(in.cache.data(), in.cache.dtype(), (block * s.block_size + n.pos % s.block_size) * kRow + n.dim, nan);
        break;
      }
      case NanSpot::input:
        if (n.dim < kL) {
          store_f32(in.kv_c.data(), kAct, int64_t{token} * kL + n.dim, nan);
        } else {
          store_f32(in.k_pe.data(), kAct, int64_t{token} * kR + (n.dim - kL), nan);
        }
        break;
      case NanSpot::query:
        store_f32(in.q.data(), kAct, (int64_t{token} * heads + n.head) * kQ + n.dim, nan);
        break;
    }
  }
  return in;
}

struct Outcome {
  std::vector<float> out;    // (tokens, heads, V)
  std::vector<float> lse;    // (heads, tokens)
  float out_sentinel = 0.f;  // the sentinel as the output dtype stores it
  int context_chunks = 0;    // the plan's chunked-context chunks
};

// One step of an MLAAttention layer forced to `backend` on `device`: plan, cache write, forward
// into sentinel-filled output and LSE.
Outcome run_step(const char* backend, Device device, const Scenario& s, const StepInputs& in) {
  MLAAttention layer(gpu_test::deepseek_mla_params(in.heads, in.kv_cache_dtype, s.block_size, backend, device));
  layer.scales().k_scale = in.k_scale;
  layer.process_weights_after_loading(in.weight.to(device));
  Tensor cache = layer.allocate_kv_cache(in.blocks);
  cache.copy_from(in.cache);
  const int nreq = static_cast<int>(s.batch.size());
  auto builder = layer.backend().make_builder(
      layer.kv_cache_spec(), layer.builder_config(nreq, in.tokens + 8, in.max_seq + 64, s.workspace_tokens), device);
  const OwnedCommonAttentionMetadata common = make_common_attention_metadata(in.args, device, in.blocks, s.block_size);
  const auto plan = builder->build(0, common.common);
  Outcome o;
  if (const auto* m = dynamic_cast<const MLAMetadata*>(plan.get()); m && m->prefill && m->prefill->chunked_context) {
    o.context_chunks = m->prefill->chunked_context->num_chunks;
  }
  Tensor out(Shape{in.tokens, in.heads, kV}, kAct, device);
  Tensor lse(Shape{in.heads, in.tokens}, DType::f32, device);
  gpu_test::fill_value(out, kSentinel);
  gpu_test::fill_value(lse, kSentinel);
  layer.forward(in.q.to(device), in.kv_c.to(device), in.k_pe.to(device), cache, *plan, out, lse);
  if (device == Device::cuda) synchronize_cuda();
  o.out = gpu_test::host_floats(out);
  o.lse = gpu_test::host_floats(lse);
  o.out_sentinel = gpu_test::as_stored(kSentinel, kAct);
  return o;
}

// Expected NaN rows, (token, head) in (tokens, heads) order: a key NaN makes every head of the
// rows that see the key NaN, a query NaN its own row.
std::vector<uint8_t> expected_nan_rows(const Scenario& s, const StepInputs& in) {
  std::vector<uint8_t> nan_row(static_cast<size_t>(in.tokens) * in.heads, 0);
  for (const NanSpot& n : s.spots) {
    const int t0 = in.token_begin[static_cast<size_t>(n.req)];
    if (n.kind == NanSpot::query) {
      nan_row[static_cast<size_t>(t0 + n.pos) * in.heads + n.head] = 1;
      continue;
    }
    const auto [context, query_len] = s.batch[static_cast<size_t>(n.req)];
    const int key = n.kind == NanSpot::input ? context + n.pos : n.pos;
    for (int t = 0; t < query_len; ++t) {
      if (key > context + t) continue;  // causally after the row (or past the end)
      std::fill_n(nan_row.begin() + static_cast<std::ptrdiff_t>(t0 + t) * in.heads, in.heads, uint8_t{1});
    }
  }
  return nan_row;
}

struct RunStats {
  int nan_rows = 0;    // rows whose every output element came out NaN
  double out_rel = 0;  // ||out - ref|| / ||ref|| over the rows expected finite
  double lse_rel = 0;  // the same over their LSE
  double worst_row = 0;
};

// `got` against the expected NaN rows and, elsewhere, against `ref` (tol for the whole, 4 tol a
// row and an LSE element). One failure line per request with a wrong row.
RunStats check_outcome(const std::string& what, const Outcome& got, const Outcome& ref, const Scenario& s,
                       const StepInputs& in, const std::vector<uint8_t>& nan_row, double tol) {
  RunStats st;
  double diff2 = 0, ref2 = 0, lse_diff2 = 0, lse_ref2 = 0;
  for (size_t r = 0; r + 1 < in.token_begin.size(); ++r) {
    int wrong = 0;
    std::string first;
    for (int t = in.token_begin[r]; t < in.token_begin[r + 1]; ++t) {
      for (int h = 0; h < in.heads; ++h) {
        const size_t row = static_cast<size_t>(t) * in.heads + h;
        const bool want_nan = nan_row[row] != 0;
        std::string why;
        // The LSE, (heads, tokens).
        const float lse = got.lse[static_cast<size_t>(h) * in.tokens + t];
        const float lse_ref = ref.lse[static_cast<size_t>(h) * in.tokens + t];
        if (lse == kSentinel) {
          why = "LSE not written";
        } else if (want_nan != std::isnan(lse)) {
          why = "LSE " + std::to_string(lse);
        } else if (!want_nan) {
          lse_diff2 += (double{lse} - lse_ref) * (double{lse} - lse_ref);
          lse_ref2 += double{lse_ref} * lse_ref;
          if (!(std::abs(lse - lse_ref) <= 4 * tol * std::max(1.f, std::abs(lse_ref)))) {
            why = "LSE " + std::to_string(lse) + " vs REFERENCE " + std::to_string(lse_ref);
          }
        }
        // The output row.
        int unwritten = 0, nans = 0, non_finite = 0;
        double row_d2 = 0, row_r2 = 0;
        for (int x = 0; x < kV; ++x) {
          const size_t i = row * kV + static_cast<size_t>(x);
          const float v = got.out[i];
          unwritten += v == got.out_sentinel ? 1 : 0;
          nans += std::isnan(v) ? 1 : 0;
          non_finite += std::isfinite(v) ? 0 : 1;
          if (std::isfinite(v)) {
            row_d2 += (double{v} - ref.out[i]) * (double{v} - ref.out[i]);
            row_r2 += double{ref.out[i]} * ref.out[i];
          }
        }
        st.nan_rows += nans == kV ? 1 : 0;
        const auto add = [&why](const std::string& s2) { why += (why.empty() ? "" : ", ") + s2; };
        if (unwritten > 0) add(std::to_string(unwritten) + " elements not written");
        if (want_nan && nans < kV) add(std::to_string(kV - nans) + " elements not NaN");
        if (!want_nan && non_finite > 0) add(std::to_string(non_finite) + " elements not finite");
        if (!want_nan && non_finite == 0) {
          const double rel = row_r2 > 0 ? std::sqrt(row_d2 / row_r2) : std::sqrt(row_d2);
          st.worst_row = std::max(st.worst_row, rel);
          if (!(rel <= 4 * tol)) add("row rel error " + std::to_string(rel));
          diff2 += row_d2;
          ref2 += row_r2;
        }
        if (why.empty()) continue;
        if (wrong++ == 0) {
          first = "token " + std::to_string(t) + " head " + std::to_string(h) +
                  (want_nan ? " (NaN expected): " : " (finite expected): ") + why;
        }
      }
    }
    if (wrong > 0) {
      const auto [context, query_len] = s.batch[r];
      ADD_FAILURE() << what << ": request " << r << " (context " << context << ", " << query_len << " tokens): " << wrong
                    << " rows wrong, first " << first;
    }
  }
  st.out_rel = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  st.lse_rel = lse_ref2 > 0 ? std::sqrt(lse_diff2 / lse_ref2) : std::sqrt(lse_diff2);
  EXPECT_LE(st.out_rel, tol) << what << ": output rel error over the finite rows";
  EXPECT_LE(st.lse_rel, tol) << what << ": LSE rel error over the finite rows";
  return st;
}

// The scenario's own consistency: every cache NaN off the rows the step writes and inside the
// request's pages, every input / query NaN inside its tensor.
void check_spots(const Scenario& s, const StepInputs& in, const std::string& label) {
  for (const NanSpot& n : s.spots) {
    const auto [context, query_len] = s.batch[static_cast<size_t>(n.req)];
    if (n.kind == NanSpot::cache) {
      ASSERT_TRUE(n.pos < context || n.pos >= context + query_len) << label << ": cache row " << n.pos;
      ASSERT_LT(n.pos / s.block_size, (context + query_len + s.block_size - 1) / s.block_size) << label << ": " << n.pos;
      ASSERT_LT(n.dim, kRow) << label;
    } else {
      ASSERT_LT(n.pos, query_len) << label;
      ASSERT_LT(n.dim, n.kind == NanSpot::query ? kQ : kRow) << label;
      ASSERT_LT(n.head, in.heads) << label;
    }
  }
}

// The split-KV segments of each decode request under the plan a CUDA_MLA builder makes on this
// device (mla_cuda_backend.cpp plan_decode: the SMs shared by the head tiles), e.g. "1,1,5,3".
std::string decode_splits(const Scenario& s, int heads, DType cache_dtype) {
  int device = 0, sms = 1;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return "?";
  }
  const md::DecodeKernel kernel = md::resolve_decode_kernel(heads, cache_dtype);
  std::vector<int32_t> seq_lens;
  for (const auto& [ctx, q] : s.batch) {
    if (q == 1) seq_lens.push_back(ctx + 1);  // decodes come first
  }
  const md::Plan plan = md::make_plan(seq_lens, {}, std::max(1, sms / md::row_tiles(kernel, heads)), kernel);
  std::string text;
  for (const md::DecodeRequest& sp : plan.requests) text += (text.empty() ? "" : ",") + std::to_string(sp.num_splits);
  return text;
}

void run_scenario(const Scenario& s, uint64_t seed) {
  const AttentionBackend* backend = find_backend(kBackend);
  ASSERT_NE(backend, nullptr) << kBackend;
  for (const int heads : {16, 128}) {
    for (const char* kv : {"auto", "fp8_e4m3"}) {
      cm::MLACase c;  // the harness's view of the case: support and tolerance
      c.dtype = kAct;
      c.kv_cache_dtype = kv;
      c.dims = {kL, kP, kR, kV};
      c.num_heads = heads;
      c.block_size = s.block_size;
      const std::string label =
          std::string(s.name) + " H=" + std::to_string(heads) + " kv=" + kv + " bs=" + std::to_string(s.block_size);
      const std::vector<std::string> reasons = cm::unsupported_reasons(*backend, kDevice, c);
      EXPECT_TRUE(reasons.empty()) << label << ": " << (reasons.empty() ? "" : reasons.front());
      const double tol = cm::tolerance(c);
      const StepInputs in = make_step(s, heads, kv, seed += 10);
      check_spots(s, in, label);
      if (::testing::Test::HasFatalFailure()) return;
      const std::vector<uint8_t> nan_row = expected_nan_rows(s, in);
      const int rows = in.tokens * heads;
      const int expected = static_cast<int>(std::count(nan_row.begin(), nan_row.end(), uint8_t{1}));
      ASSERT_TRUE(expected > 0 && expected < rows) << label << ": " << expected << " of " << rows << " rows NaN";

      const Outcome ref = run_step("REFERENCE_MLA", Device::cpu, s, in);
      check_outcome(label + " REFERENCE", ref, ref, s, in, nan_row, tol);
      const std::string splits = decode_splits(s, heads, kv_cache_storage_dtype(kv, kAct));
      for (const char* variant : kVariants) {
        const std::string what = label + " [" + (*variant ? variant : "default") + "]";
        Outcome got;
        try {
          const gpu_test::KernelOverrideScope scope(variant);
          got = run_step(kBackend, kDevice, s, in);
        } catch (const std::exception& e) {
          ADD_FAILURE() << what << " threw: " << e.what();
          continue;
        }
        const RunStats st = check_outcome(what, got, ref, s, in, nan_row, tol);
        std::printf("[ mla-nan ] %-32s %-8s decode splits %-20s context chunks %d: NaN rows %d / %d (expected %d), "
                    "rel error out %.2e lse %.2e, worst row %.2e (tol %.0e)\n",
                    label.c_str(), *variant ? variant : "default", splits.c_str(), got.context_chunks, st.nan_rows,
                    rows, expected, st.out_rel, st.lse_rel, st.worst_row, tol);
      }
    }
  }
}

TEST(CudaMlaNanLogits, DecodeRowsAreNanAsReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_scenario(decode_scenario(), 0x3A50);
}

TEST(CudaMlaNanLogits, MixedRowsAreNanAsReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_scenario(mixed_scenario(), 0x3A60);
}

}  // namespace
}  // namespace pagedattn
