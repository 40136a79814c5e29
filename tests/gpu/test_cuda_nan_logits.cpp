// NaN logits and NaN values on the CUDA backend, every kernel a plan can take: the
// warp-specialized kernel (paged_attention_ws.cuh: its branch-free step for unmasked tiles and its
// masked step), the one-warpgroup wgmma and the mma.sync prefill paths, the decode path of the
// paged attention kernel and the decode-only kernel, and the split-KV combine. The rule, as
// REFERENCE (fp64): a NaN logit of a key a query row sees makes that whole row NaN, output and LSE
// (e^{NaN - m} is NaN); NaN in a slot no row sees (past a request's end in its last page, below a
// sliding window, a key causally after a prefill row's position) has no effect.
// Why: the kernels' running max is fmaxf, which drops NaN, so a NaN logit reaches the row only
// through its exponential; a masked step must select its keys out (a masked NaN times 0 is NaN),
// and the branch-free step, which applies no mask, must still carry a NaN of an unmasked tile
// into P, O and the row sum; the LSE comes from that row sum (l > 0 ? ... : -inf would turn a
// NaN row sum into -inf), and a split row's partial LSE into the combine's weights.
// A NaN value (element d of a key's V row) of a key a row sees makes that row's output element d
// NaN, the rest of the row and its LSE finite (REFERENCE: o_d = sum_k p_k v_kd / l; the LSE comes
// from the logits alone); a key the row cannot see must not reach it (docs/reliability.md, "NaN
// isolation"). Why these matter: 0 x NaN = NaN, and the kernels mask a key by its logit (-inf,
// so P = 0) yet still multiply its V row into P . V whenever another row of the item sees it.
// Keys outside an item's key range are zero-filled (past a request's end, below the first row's
// window, after the last row's position), so the keys at stake are those inside that range that
// some rows cannot see: in a causal diagonal tile the keys only the later rows of a chunk see, at
// a sliding window's lower edge the keys only the earlier rows see. The K cases cannot show this
// (a masked NaN logit is replaced by -inf before the exponential).
// NaN logits come from a NaN in a K cache element (bf16 0x7FC0 / 0xFFC0, f16 0x7E00 / 0xFE00,
// fp8 e4m3 0x7F / 0xFF, written into the cache after the context was written), in the step's key
// input (stored by the step's own cache write) or in a query element; NaN values the same way
// from the V cache and the step's value input. Scenarios:
//   prefill: causal chunks of 300, 200 and 64 tokens after 0, 700 and 1500 cached ones: NaN keys
//            in the middle of tiles every row of an item sees (the warp-specialized kernel's
//            branch-free step: tiles of 128 keys at D 64 / 128, 64 at D 256), in diagonal tiles,
//            keys only the later rows of a chunk see (the earlier rows stay finite), keys past a
//            request's end in its last page (no effect), NaN query elements; NaN values of a new
//            token's key in the middle of a chunk, which only the later rows of its item see (the
//            earlier rows of that item, in the same diagonal tile, must stay finite), of a cached
//            key every row sees, past a request's end (no effect);
//   decode:  one-token decodes: NaN in the only key, in a later tile of a long (split-KV)
//            request, in the first tile, in the token's own key, a NaN query (the only key, and
//            a split request), NaN past the end (no effect); NaN values in the only key, in the
//            token's own key, in a later tile of a split request, past the end (no effect);
//   spec-decode: decodes of 1 to 4 tokens (speculative rows: decode-path items of up to 16 rows,
//            kv-head pairs at fp8 D 64), whose last keys only the later tokens see: NaN values of
//            a token's own key (the earlier tokens of its item must stay finite), a NaN key of a
//            token's own, NaN values every row sees, past the end (no effect), a NaN query;
//   window-decode / window-prefill: sliding windows: NaN below a row's window (no effect), at
//            its first key, inside it for some rows of a chunk and below it for others; NaN values
//            the same: below (no effect; in the window's first page), at a row's first key,
//            inside for the earlier rows of a chunk and below the window of the later rows of the
//            same item (the window's lower edge).
// Caches bf16 (bf16 activations), f16 (f16 activations) and fp8 e4m3 (bf16 activations), head
// sizes 64, 128 and 256, 32 query heads over 8 KV heads (GQA 4), LSE returned. Each case runs
// REFERENCE once and the CUDA backend under the default kernel choice and the overrides
// (PAGEDATTN_CUDA_KERNEL, kernel_override.h) prefill=mma and prefill=wgmma (prefill scenarios),
// decode=decode and decode=unified (decode scenarios). Outputs and LSE are set to a sentinel
// before the call (the harness poisons with NaN, which could not be told from a NaN result) and
// must all be written: NaN in exactly the rows (logits) and elements (values) expected
// (REFERENCE must agree with the expectation too), elsewhere finite and within the other GPU
// tests' tolerance of REFERENCE (test_cuda_kernel_variants.cpp: the fp8 tolerance on the
// warp-specialized kernel's 8-bit path, the 16-bit one for fp8 caches elsewhere), as a whole and
// 4x that per row. One summary line per run (NaN rows: rows with a NaN element).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "../../src/backends/cuda/attention/cuda_backend_internal.h"
#include "../../src/backends/cuda/attention/kernel_selection.h"
#include "conformance/harness.h"
#include "conformance/nan_rule_case.h"
#include "gpu_test_util.h"

namespace pagedattn {
namespace {

using conformance::ConformanceCase;
using conformance::RequestShape;

constexpr int kHeads = 32, kKvHeads = 8, kGroup = kHeads / kKvHeads;
constexpr float kSentinel = -7777.f;  // no output or LSE reaches it

// One NaN: in the K or V cache (request req's cached key `pos`, KV head `head`, dim `dim`; pos <
// context_len or >= seq_len, slots the step does not write), in the step's key or value input
// (the request's token `pos`, its own key / value), or in the query (token `pos` of the request,
// query head `head`). `negative`: the sign bit of the NaN set.
struct NanSpot {
  enum Kind { key_cache, key_input, value_cache, value_input, query } kind;
  int req, pos, head, dim;
  bool negative = false;

  bool in_cache() const { return kind == key_cache || kind == value_cache; }
  bool in_value() const { return kind == value_cache || kind == value_input; }
};

enum class Kind { prefill, decode };

struct Scenario {
  const char* name;
  Kind kind;
  std::optional<int> window;
  std::vector<RequestShape> batch;  // (context, query tokens)
  std::vector<NanSpot> spots;
};

// KV head g's rows are query heads 4g .. 4g + 3. Block size 16.
const std::vector<Scenario>& scenarios() {
  static const std::vector<Scenario> s = {
      // Items of 128 rows = 32 tokens x 4 heads (64 rows = 16 tokens on the paths with 64-row items);
      // a tile is unmasked for an item when all its keys are <= the item's first position.
      {"prefill",
       Kind::prefill,
       std::nullopt,
       {{0, 300}, {700, 200}, {1500, 64}},
       {
           // Request 0, positions 0 .. 299 (keys from the key input only).
           {NanSpot::key_input, 0, 250, 1, 3},         // tokens 250 .. 299 see it: the diagonal
                                                       // tile of the item holding token 250 (its
                                                       // earlier rows stay finite), an unmasked
                                                       // tile of the later items
           {NanSpot::key_input, 0, 60, 2, 0, true},    // tokens 60 .. 299: the diagonal tile of the
                                                       // item holding token 60, the first tile of
                                                       // every item (the warp-specialized kernel's
                                                       // general step even where unmasked)
           {NanSpot::query, 0, 10, 20, 7},             // one row (token 10, head 20)
           {NanSpot::value_input, 0, 100, 0, 5},       // V: dim 5 of tokens 100 .. 299; the item
                                                       // holding token 100 also holds 96 .. 99,
                                                       // which must stay finite (diagonal tile)
           // Request 1, positions 700 .. 899; seq_len 900, last page 896 .. 911.
           {NanSpot::key_cache, 1, 300, 3, 17},        // every row: mid-tile, unmasked everywhere
           {NanSpot::key_input, 1, 150, 5, 63},        // position 850: tokens 150 .. 199 only
           {NanSpot::key_cache, 1, 903, 0, 1},         // past the end: no effect
           {NanSpot::key_cache, 1, 911, 6, 9, true},   // past the end: no effect
           {NanSpot::value_cache, 1, 400, 7, 50},      // V: dim 50 of every row
           {NanSpot::value_cache, 1, 905, 2, 11},      // V past the end: no effect
           // Request 2, positions 1500 .. 1563; seq_len 1564, last page 1552 .. 1567.
           {NanSpot::key_cache, 2, 1000, 6, 5},        // every row: mid-tile, unmasked everywhere
           {NanSpot::key_cache, 2, 1499, 4, 2},        // the last cached key: every row, in the
                                                       // diagonal tile of the 128-row items
           {NanSpot::key_input, 2, 63, 7, 40},         // the last token's own key: that token only
           {NanSpot::key_cache, 2, 1565, 0, 0, true},  // past the end: no effect
           {NanSpot::query, 2, 5, 1, 30, true},        // one row (token 5, head 1)
           {NanSpot::value_input, 2, 20, 5, 0, true},  // V: dim 0 of tokens 20 .. 63 (16 .. 19
                                                       // share its item and stay finite)
           {NanSpot::value_cache, 2, 1567, 3, 7},      // V past the end: no effect
       }},
      // Decodes of one token (the last visible key is the token's own, at position `context`).
      {"decode",
       Kind::decode,
       std::nullopt,
       {{0, 1}, {0, 1}, {100, 1}, {45, 1}, {1500, 1}, {2100, 1}, {700, 1}, {64, 1}},
       {
           {NanSpot::key_input, 0, 0, 1, 7},           // its only key, KV head 1
           {NanSpot::value_input, 0, 0, 6, 2},         // V of its only key: dim 2 of heads 24 .. 27
           {NanSpot::query, 1, 0, 3, 11},              // its only key, a NaN query (head 3)
           {NanSpot::key_cache, 2, 37, 0, 2},          // KV head 0
           {NanSpot::key_cache, 3, 46, 0, 5},          // past the end (keys 0 .. 45)
           {NanSpot::key_cache, 3, 47, 1, 0, true},    // past the end
           {NanSpot::value_cache, 3, 46, 3, 6},        // V past the end
           {NanSpot::key_cache, 4, 1200, 2, 33},       // a later tile of a long request (split-KV)
           {NanSpot::key_cache, 4, 3, 7, 1},           // its first tile, KV head 7
           {NanSpot::value_cache, 4, 1300, 5, 20, true},  // V, a later tile of the split request
           {NanSpot::key_cache, 5, 2105, 3, 4},        // past the end (keys 0 .. 2100)
           {NanSpot::value_cache, 5, 2110, 6, 13},     // V past the end
           {NanSpot::query, 5, 0, 17, 60, true},       // a NaN query in a long (split) request
           {NanSpot::key_input, 6, 0, 5, 63},          // its own key, the last tile
           {NanSpot::value_input, 6, 0, 1, 9},         // V of its own key
           {NanSpot::key_cache, 7, 63, 4, 8},          // the last cached key, KV head 4
       }},
      // Decodes of 1 to 4 tokens: token t of a request with context c sits at position c + t.
      {"spec-decode",
       Kind::decode,
       std::nullopt,
       {{100, 4}, {37, 3}, {500, 2}, {1300, 4}, {64, 1}},
       {
           {NanSpot::value_input, 0, 1, 2, 5},         // V: dim 5 of tokens 1 .. 3 (token 0 shares
                                                       // their item and stays finite)
           {NanSpot::key_input, 0, 2, 1, 3},           // tokens 2, 3 only
           {NanSpot::value_cache, 0, 50, 4, 9},        // V: dim 9 of every row of KV head 4
           {NanSpot::value_input, 1, 2, 6, 0, true},   // V: its last token only
           {NanSpot::value_cache, 1, 41, 3, 1},        // V past the end (page 32 .. 47): no effect
           {NanSpot::value_input, 2, 1, 0, 7},         // V: token 1 only (KV heads 0, 1 paired at
                                                       // fp8 D 64)
           {NanSpot::key_cache, 2, 200, 5, 2},         // every row of KV head 5
           {NanSpot::value_input, 3, 3, 7, 11},        // V: the last token of a long (split) request
           {NanSpot::value_cache, 3, 1000, 2, 4, true},  // V: dim 4 of every row of KV head 2
           {NanSpot::query, 4, 0, 9, 1},               // one row (head 9)
       }},
      // Window 40: a decode at position p sees [p - 39, p].
      {"window-decode",
       Kind::decode,
       40,
       {{86, 1}, {100, 1}, {150, 1}, {1000, 1}},
       {
           {NanSpot::key_cache, 0, 47, 1, 4},          // [47, 86]: its first key
           {NanSpot::key_cache, 0, 46, 0, 4},          // below the window
           {NanSpot::value_cache, 0, 46, 2, 3},        // V just below, in the window's first page
           {NanSpot::key_cache, 1, 20, 2, 0, true},    // below the window
           {NanSpot::key_cache, 1, 60, 3, 31},         // [61, 100]: just below
           {NanSpot::value_cache, 1, 61, 4, 12},       // V at its first key
           {NanSpot::value_cache, 1, 55, 5, 1, true},  // V below
           {NanSpot::key_cache, 2, 110, 4, 2},         // [111, 150]: just below
           {NanSpot::key_cache, 2, 130, 5, 3, true},   // inside
           {NanSpot::value_cache, 2, 140, 6, 0},       // V inside
           {NanSpot::key_cache, 2, 155, 0, 1},         // past the end (page 144 .. 159)
           {NanSpot::key_cache, 3, 500, 6, 1},         // far below the window
           {NanSpot::key_cache, 3, 960, 7, 1, true},   // [961, 1000]: just below
           {NanSpot::value_cache, 3, 960, 3, 0},       // V just below, in the window's first page
           {NanSpot::query, 3, 0, 0, 9},               // NaN query (head 0)
       }},
      // Window 100: a token at position p sees [p - 99, p].
      {"window-prefill",
       Kind::prefill,
       100,
       {{300, 100}, {0, 200}, {40, 1}},
       {
           // Request 0, positions 300 .. 399: token i sees [201 + i, 300 + i].
           {NanSpot::key_cache, 0, 150, 0, 0},         // below every row's window
           {NanSpot::key_cache, 0, 250, 1, 5},         // tokens 0 .. 49 only
           {NanSpot::key_input, 0, 80, 2, 6, true},    // position 380: tokens 80 .. 99
           {NanSpot::value_cache, 0, 200, 3, 1},       // V just below every row's window (page
                                                       // 192 .. 207, a tile token 0 sees)
           {NanSpot::value_cache, 0, 230, 4, 7},       // V: tokens 0 .. 29 (below for 30 .. 99)
           {NanSpot::value_cache, 0, 201, 6, 4, true}, // V at token 0's first key, below the
                                                       // window of tokens 1 .. 99
           // Request 1, positions 0 .. 199: token i sees [i - 99, i].
           {NanSpot::key_input, 1, 20, 3, 7},          // tokens 20 .. 119 (earlier: causal; later:
                                                       // below the window)
           {NanSpot::query, 1, 150, 30, 8},            // one row (token 150, head 30)
           {NanSpot::value_input, 1, 50, 5, 2},        // V: tokens 50 .. 149 (token 149's first
                                                       // key; earlier: causal; later: below)
           // Request 2, position 40, sees [0, 40].
           {NanSpot::key_cache, 2, 0, 4, 9},           // its first key
           {NanSpot::key_cache, 2, 45, 5, 9},          // past the end (page 32 .. 47)
       }},
  };
  return s;
}

// The kernel overrides a scenario runs under ("" = the default choice).
std::vector<const char*> variants(Kind kind) {
  if (kind == Kind::prefill) return {"", "prefill=mma", "prefill=wgmma"};
  return {"", "decode=decode", "decode=unified"};
}

// Stores `value` (as t's dtype stores it) at element `index` of t, in host or device memory.
void store_element(const Tensor& t, int64_t index, float value) {
  if (t.device() == Device::cpu) {
    store_f32(t.data(), t.dtype(), index, value);
    return;
  }
  unsigned char bytes[8] = {};
  store_f32(bytes, t.dtype(), 0, value);
  const size_t size = t.view().element_size();
  const cudaError_t err = cudaMemcpy(static_cast<char*>(t.data()) + index * static_cast<int64_t>(size), bytes, size,
                                     cudaMemcpyHostToDevice);
  ASSERT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
}

struct Outcome {
  std::vector<float> out;    // (tokens, kHeads, D)
  std::vector<float> lse;    // (kHeads, tokens)
  float out_sentinel = 0.f;  // the sentinel as stored in the output dtype
  std::string plan;          // CUDA: "<kernel>, N items, M combine"
  bool ws = false;           // the plan runs the warp-specialized kernel
};

Outcome run_case(const AttentionBackend& backend, Device device, const conformance::CaseInputs& inputs,
                 const std::vector<NanSpot>& spots) {
  Outcome outcome;
  conformance::PreparedRun run = conformance::prepare_run(backend, device, inputs);
  if (device == Device::cuda) synchronize_cuda();  // the context's cache write has landed
  const TensorView cache = run.kv_cache.view();  // (2, blocks, block_size, Hkv, D)
  const int block_size = inputs.c.block_size;
  const int d = inputs.c.head_size;
  for (const NanSpot& n : spots) {
    const float nan = n.negative ? -std::nanf("") : std::nanf("");
    const int64_t token = inputs.query_start_loc[static_cast<size_t>(n.req)] + n.pos;
    if (n.kind == NanSpot::query) {
      store_element(run.query, (token * kHeads + n.head) * d + n.dim, nan);
    } else if (n.in_cache()) {  // the K (index 0) or V (index 1) half of the cache
      const int64_t block =
          inputs.block_table[static_cast<size_t>(n.req * inputs.block_table_cols + n.pos / block_size)];
      const int64_t at = (n.in_value() ? 1 : 0) * cache.stride(0) + block * cache.stride(1) +
                         (n.pos % block_size) * cache.stride(2) + n.head * cache.stride(3) + n.dim * cache.stride(4);
      store_element(run.kv_cache, at, nan);  // bf16 / f16 quiet NaN, e4m3 0x7F / 0xFF
    } else {  // the step's key or value input, stored by its own cache write
      store_element(n.in_value() ? run.value : run.key, (token * kKvHeads + n.head) * d + n.dim, nan);
    }
  }
  gpu_test::fill_value(run.output, kSentinel);
  outcome.out_sentinel = gpu_test::as_stored(kSentinel, run.output.dtype());
  gpu_test::fill_value(run.output_lse, kSentinel);
  if (const auto* md = dynamic_cast<const cuda::CudaAttentionMetadata*>(run.step_metadata.get())) {
    outcome.plan = std::string(cuda::attention_kernel_name(md->kernel)) + ", " + std::to_string(md->num_work_items) +
                   " items, " + std::to_string(md->num_combine_items) + " combine";
    outcome.ws = md->kernel == cuda::AttentionKernel::ws;
  }
  conformance::execute(run);
  outcome.out = gpu_test::host_floats(run.output);
  outcome.lse = gpu_test::host_floats(run.output_lse);
  return outcome;
}

// Index of row (token, head) in (tokens, kHeads) order.
size_t row_index(int token, int head) { return static_cast<size_t>(token * kHeads + head); }

// The NaN a scenario expects: per output element (tokens, kHeads, D) and per row's LSE (tokens,
// kHeads). A NaN logit (K, query) makes a whole row NaN, output and LSE; a NaN value makes only
// its own dim of the rows that see its key NaN (REFERENCE: o_d = sum_k p_k v_kd / l, the LSE
// comes from the logits alone).
struct Expected {
  std::vector<uint8_t> out, lse;
  int rows = 0;  // rows with a NaN element

  bool row_has_nan(size_t row, int d) const {
    return std::any_of(out.begin() + static_cast<std::ptrdiff_t>(row) * d,
                       out.begin() + static_cast<std::ptrdiff_t>(row + 1) * d, [](uint8_t x) { return x != 0; });
  }
};

// A K or V NaN reaches every row that sees its key (the KV head's query heads), a query NaN its
// own row.
Expected expected_nan(const Scenario& s, const conformance::CaseInputs& in) {
  const int d = in.c.head_size;
  Expected e;
  e.out.assign(static_cast<size_t>(in.num_tokens) * kHeads * static_cast<size_t>(d), 0);
  e.lse.assign(static_cast<size_t>(in.num_tokens) * kHeads, 0);
  const auto mark = [&](size_t row, const NanSpot& n) {
    const size_t first = row * static_cast<size_t>(d);
    if (n.in_value()) {
      e.out[first + static_cast<size_t>(n.dim)] = 1;
      return;
    }
    std::fill_n(e.out.begin() + static_cast<std::ptrdiff_t>(first), d, uint8_t{1});
    e.lse[row] = 1;
  };
  for (const NanSpot& n : s.spots) {
    const int q0 = in.query_start_loc[static_cast<size_t>(n.req)];
    if (n.kind == NanSpot::query) {
      mark(row_index(q0 + n.pos, n.head), n);
      continue;
    }
    const int context = in.c.batch[static_cast<size_t>(n.req)].context_len;
    const int key = n.in_cache() ? n.pos : context + n.pos;
    for (int t = 0; t < in.query_len(n.req); ++t) {
      const int pos = context + t;
      const int lo = s.window ? pos - (*s.window - 1) : 0;
      if (key < lo || key > pos) continue;  // not seen
      for (int h = n.head * kGroup; h < (n.head + 1) * kGroup; ++h) mark(row_index(q0 + t, h), n);
    }
  }
  for (size_t row = 0; row < e.lse.size(); ++row) e.rows += e.row_has_nan(row, d) ? 1 : 0;
  return e;
}

struct CheckResult {
  int nan_rows = 0;         // rows that came out with a NaN element
  double out_rel = 0;       // ||out - ref|| / ||ref|| over the finite expected rows
  double lse_rel = 0;       // the same over their LSE
  double worst_row = 0;     // largest per-row relative error of those rows
};

// Checks `o` against the expected NaN elements and, elsewhere, against `ref` (tol: the norm
// tolerance of the whole; 4 tol per row, over its finite elements, and per LSE element). One
// failure line per request.
CheckResult check_run(const std::string& what, const Outcome& o, const Outcome& ref, const conformance::CaseInputs& in,
                      const Expected& want, double tol) {
  CheckResult res;
  const int d = in.c.head_size;
  const int64_t lse_stride = in.num_tokens;  // LSE (Hq, num_tokens)
  double d2 = 0, r2 = 0, ld2 = 0, lr2 = 0;
  for (int r = 0; r < in.num_reqs(); ++r) {
    int bad_rows = 0;
    std::string first;
    for (int t = in.query_start_loc[static_cast<size_t>(r)]; t < in.query_start_loc[static_cast<size_t>(r) + 1]; ++t) {
      for (int h = 0; h < kHeads; ++h) {
        const size_t row = row_index(t, h);
        const bool want_nan = want.lse[row] != 0;  // the whole row
        const size_t li = static_cast<size_t>(h) * static_cast<size_t>(lse_stride) + static_cast<size_t>(t);
        const float lse = o.lse[li], lse_ref = ref.lse[li];
        std::string bad;
        if (lse == kSentinel) {
          bad = "LSE not written";
        } else if (std::isnan(lse) != want_nan ||
                   (!want_nan && !(std::abs(lse - lse_ref) <= 4 * tol * std::max(1.f, std::abs(lse_ref))))) {
          bad = "LSE " + std::to_string(lse) + " (REFERENCE " + std::to_string(lse_ref) + ")";
        }
        if (!want_nan && std::isfinite(lse) && std::isfinite(lse_ref)) {
          ld2 += (double(lse) - lse_ref) * (double(lse) - lse_ref);
          lr2 += double(lse_ref) * lse_ref;
        }
        int bad_dims = 0, nan_dims = 0;
        double rd2 = 0, rr2 = 0;
        for (int x = 0; x < d; ++x) {
          const size_t i = row * static_cast<size_t>(d) + static_cast<size_t>(x);
          const float v = o.out[i], rv = ref.out[i];
          const bool want_nan_x = want.out[i] != 0;
          nan_dims += std::isnan(v) ? 1 : 0;
          std::string why;
          if (v == o.out_sentinel) {
            why = "not written";
          } else if (want_nan_x ? !std::isnan(v) : !std::isfinite(v)) {
            why = std::to_string(v) + " (REFERENCE " + std::to_string(rv) +
                  ", NaN expected: " + std::to_string(want_nan_x) + ")";
          } else if (!want_nan_x) {
            rd2 += (double(v) - rv) * (double(v) - rv);
            rr2 += double(rv) * rv;
          }
          if (!why.empty() && bad_dims++ == 0) bad += (bad.empty() ? "" : ", ") + std::string("dim ") + std::to_string(x) + ": " + why;
        }
        res.nan_rows += nan_dims > 0 ? 1 : 0;
        if (!want_nan && bad_dims == 0) {
          const double row_rel = rr2 > 0 ? std::sqrt(rd2 / rr2) : std::sqrt(rd2);
          res.worst_row = std::max(res.worst_row, row_rel);
          if (!(row_rel <= 4 * tol)) bad += (bad.empty() ? "" : ", ") + std::string("row rel error ") + std::to_string(row_rel);
          d2 += rd2;
          r2 += rr2;
        }
        if (bad.empty()) continue;
        if (bad_rows++ == 0) {
          const char* expect = want_nan ? "row" : want.row_has_nan(row, d) ? "value dims" : "none";
          first = "token " + std::to_string(t) + " head " + std::to_string(h) + " (NaN expected: " + expect + "): " + bad +
                  ", " + std::to_string(bad_dims) + " dims wrong";
        }
      }
    }
    if (bad_rows > 0) ADD_FAILURE() << what << ": request " << r << ": " << bad_rows << " rows wrong, first " << first;
  }
  res.out_rel = r2 > 0 ? std::sqrt(d2 / r2) : std::sqrt(d2);
  res.lse_rel = lr2 > 0 ? std::sqrt(ld2 / lr2) : std::sqrt(ld2);
  EXPECT_LE(res.out_rel, tol) << what << ": output rel error over the finite rows";
  EXPECT_LE(res.lse_rel, tol) << what << ": LSE rel error over the finite rows";
  return res;
}

struct CacheConfig {
  DType activations;
  const char* kv_cache_dtype;
};

void run_scenario(const char* name, uint64_t seed0) {
  const auto it = std::find_if(scenarios().begin(), scenarios().end(),
                               [name](const Scenario& s) { return std::string(s.name) == name; });
  ASSERT_TRUE(it != scenarios().end()) << name;
  const Scenario& s = *it;
  const AttentionBackend& backend = cuda_backend();
  const std::vector<CacheConfig> configs = {{DType::bf16, "auto"}, {DType::f16, "auto"}, {DType::bf16, "fp8_e4m3"}};
  uint64_t seed = seed0;
  for (const CacheConfig& cc : configs) {
    for (int d : {64, 128, 256}) {
      const ConformanceCase c =
          conformance::nan_rule_case(cc.activations, cc.kv_cache_dtype, d, kHeads, kKvHeads, s.window, s.batch);
      const std::string label = std::string(s.name) + " " + std::string(dtype_name(c.dtype)) + " kv=" + c.kv_cache_dtype +
                                " D=" + std::to_string(d);
      EXPECT_TRUE(conformance::unsupported_reasons(backend, Device::cuda, c).empty()) << label;
      const conformance::CaseInputs inputs = conformance::make_inputs(c, ++seed);
      ASSERT_EQ(inputs.c.batch.size(), c.batch.size()) << label;
      for (size_t r = 0; r < c.batch.size(); ++r) {  // the request indices are run order
        ASSERT_EQ(inputs.c.batch[r].context_len, c.batch[r].context_len) << label;
        ASSERT_EQ(inputs.c.batch[r].query_len, c.batch[r].query_len) << label;
      }
      for (const NanSpot& n : s.spots) {  // the scenario's own consistency
        const RequestShape& rs = c.batch[static_cast<size_t>(n.req)];
        if (n.in_cache()) {
          ASSERT_TRUE(n.pos < rs.context_len || n.pos >= rs.context_len + rs.query_len) << label << ": slot " << n.pos;
          ASSERT_LT(n.pos / c.block_size, inputs.block_table_cols) << label;
        } else {
          ASSERT_LT(n.pos, rs.query_len) << label;
        }
        ASSERT_LT(n.head, n.kind == NanSpot::query ? kHeads : kKvHeads) << label;
        ASSERT_LT(n.dim, d) << label;
      }
      const Expected want = expected_nan(s, inputs);
      const int expected = want.rows;
      const int rows = inputs.num_actual_tokens * kHeads;
      ASSERT_TRUE(expected > 0 && expected < rows) << label << ": " << expected << " of " << rows << " rows NaN";

      const Outcome reference = run_case(conformance::reference(), Device::cpu, inputs, s.spots);
      check_run(label + " REFERENCE", reference, reference, inputs, want, conformance::tolerance(c));

      ConformanceCase c16 = c;  // fp8 caches off the 8-bit wgmma path: the 16-bit cache's tolerance
      c16.kv_cache_dtype = "auto";
      for (const char* variant : variants(s.kind)) {
        const std::string what = label + " [" + (*variant ? variant : "default") + "]";
        Outcome cuda;
        try {
          const gpu_test::KernelOverrideScope guard(variant);
          cuda = run_case(backend, Device::cuda, inputs, s.spots);
        } catch (const std::exception& e) {
          ADD_FAILURE() << what << " threw: " << e.what();
          continue;
        }
        const double tol = c.fp8_kv() && !cuda.ws ? conformance::tolerance(c16) : conformance::tolerance(c);
        const CheckResult res = check_run(what, cuda, reference, inputs, want, tol);
        std::printf("[ nan ] %-44s %-16s %-28s NaN rows %d / %d (expected %d), rel error out %.2e lse %.2e, "
                    "worst row %.2e (tol %.0e)\n",
                    label.c_str(), *variant ? variant : "default", cuda.plan.c_str(), res.nan_rows, rows, expected,
                    res.out_rel, res.lse_rel, res.worst_row, tol);
      }
    }
  }
}

TEST(CudaNanLogits, PrefillRowsAreNanAsReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_scenario("prefill", 0x4A40);
}

TEST(CudaNanLogits, DecodeRowsAreNanAsReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_scenario("decode", 0x4A41);
}

TEST(CudaNanLogits, SpecDecodeRowsAreNanAsReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_scenario("spec-decode", 0x4A44);
}

TEST(CudaNanLogits, WindowDecodeRowsAreNanAsReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_scenario("window-decode", 0x4A42);
}

TEST(CudaNanLogits, WindowPrefillRowsAreNanAsReference) {
  PAGEDATTN_REQUIRE_GPU();
  run_scenario("window-prefill", 0x4A43);
}

}  // namespace
}  // namespace pagedattn
