// NaN logits in the direct decode kernels (cpu_decode_avx2.h, cpu_decode_avx512.h; the driver in
// cpu_decode_direct.h), on every CPU kernel path this machine runs (cpu_kernel_paths.h). The rule,
// as REFERENCE (fp64) and the tile kernel: a NaN logit of a key a query row sees makes that whole
// row NaN, output and LSE (e^{NaN - m} is NaN); NaN in a slot no row sees (past a request's end in
// its last page, below a sliding window in the same 16-key chunk) has no effect.
// The case the direct kernels' lazy max used to lose: while a row's running max is still -inf, a
// chunk whose only visible logits are NaN (the `exceeds` compare is false for NaN, so m stayed
// -inf and the chunk took the "nothing visible yet" branch: weight 0 for the NaN key, the row 0 or
// the other keys' average). Cases, per request of one decode batch:
//   (a) the NaN key is the only key (0 cached tokens: the token's own key, from the key input);
//   (b) the NaN keys are the only visible keys of the first chunk the kernel reads (a sliding
//       window that starts at a chunk's last key, or its last three), later chunks finite; and a
//       NaN query element, which makes every logit of its row NaN (every chunk);
//   (c) a NaN key in a later chunk (m finite), in the cache or the token's own key;
//   (d) NaN only in slots past the request's end or below its window: no effect.
// NaN logits come from a NaN in a K cache element (bf16 0x7FC0 / 0xFFC0, f16 0x7E00 / 0xFE00,
// fp8 e4m3 0x7F / 0xFF), in the step's key input (stored by the cache write) or in a query
// element. Caches bf16, f16 and fp8 e4m3 (bf16 or f16 activations), head sizes 64 and 128,
// 16 query heads over 2 KV heads (GQA 8), one thread (every decode one head-fused item, which the
// direct kernel takes where the path has one: checked with its item counter). Each case runs with
// the direct kernel (PAGEDATTN_CPU_DECODE_KERNEL=auto), the tile kernel and REFERENCE; outputs and
// LSE are poisoned with a sentinel before the call and must all be written, NaN in exactly the
// elements expected (and REFERENCE must agree), within tolerance of REFERENCE elsewhere.
// REFERENCE itself gave 0 and LSE -inf for a row whose visible logits are ALL NaN (a one-key
// decode with a NaN key, a NaN query: its std::max dropped the NaN, leaving m = -inf); it now
// makes m NaN there too (reference_attention.cpp), as REFERENCE_MLA and the tile kernel do.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "../../src/backends/cpu/cpu_backend.h"
#include "../../src/backends/cpu/cpu_internal.h"
#include "conformance/env_guard.h"
#include "conformance/harness.h"
#include "conformance/nan_rule_case.h"
#include "cpu_kernel_paths.h"

namespace pagedattn::cpu {
namespace {

using conformance::EnvGuard;

constexpr int kHeads = 16, kKvHeads = 2, kGroup = kHeads / kKvHeads;
constexpr float kSentinel = -7777.f;  // no output or LSE reaches it

// One NaN: in the K cache (request req's cached key `pos`, KV head `head`, dim `dim`), in the
// step's key input (the token `pos` of the request, its own key), or in the query (token `pos`
// of the request, query head `head`). `negative`: the sign bit of the NaN set.
struct NanSpot {
  enum Kind { key_cache, key_input, query } kind;
  int req, pos, head, dim;
  bool negative = false;
};

struct Scenario {
  const char* name;
  std::optional<int> window;
  std::vector<conformance::RequestShape> batch;  // (context, query tokens)
  std::vector<NanSpot> spots;
};

// Decodes of one token (the last visible key is the token's own, at position `context`).
const std::vector<Scenario>& scenarios() {
  static const std::vector<Scenario> s = {
      {"causal",
       std::nullopt,
       {{0, 1}, {0, 1}, {100, 1}, {45, 1}, {300, 1}, {200, 1}, {64, 1}},
       {
           {NanSpot::key_input, 0, 0, 1, 7},          // (a) its only key, KV head 1
           {NanSpot::query, 1, 0, 3, 11},             // (a) its only key, a NaN query (head 3)
           {NanSpot::key_cache, 2, 37, 0, 2},         // (c) chunk [32, 48), KV head 0
           {NanSpot::key_cache, 3, 46, 0, 5},         // (d) past the end (keys 0 .. 45)
           {NanSpot::key_cache, 3, 47, 1, 0, true},   // (d) past the end
           {NanSpot::query, 4, 0, 12, 5, true},       // (b) NaN query: every chunk's logits NaN
           {NanSpot::key_input, 5, 0, 0, 63},         // (c) its own key, last chunk, KV head 0
           {NanSpot::key_cache, 6, 15, 1, 1},         // (c) last key of chunk [0, 16), KV head 1
           {NanSpot::key_cache, 6, 16, 0, 9, true},   // (c) first key of chunk [16, 32), head 0
       }},
      // Window 8: a decode at position p sees [p - 7, p].
      {"window",
       8,
       {{86, 1}, {86, 1}, {100, 1}, {120, 1}, {150, 1}},
       {
           {NanSpot::key_cache, 0, 79, 1, 4},         // (b) [79, 86]: 79 the only key of [64, 80)
           {NanSpot::key_cache, 0, 78, 0, 4},         // (d) below the window, same chunk
           {NanSpot::key_cache, 1, 79, 0, 0, true},   // (b) the same with KV head 0
           {NanSpot::key_cache, 1, 70, 1, 30},        // (d) below the window, same chunk
           {NanSpot::key_cache, 2, 93, 1, 2},         // (b) [93, 100]: 93 .. 95 of [80, 96),
           {NanSpot::key_cache, 2, 94, 1, 3, true},   //     all three NaN (KV head 1)
           {NanSpot::key_cache, 2, 95, 1, 4},
           {NanSpot::key_cache, 3, 112, 0, 1},        // (d) [113, 120]: below the window
           {NanSpot::key_cache, 3, 121, 1, 1},        // (d) past the end
           {NanSpot::key_cache, 3, 127, 0, 1, true},  // (d) past the end
           {NanSpot::query, 4, 0, 2, 9},              // (b) NaN query (head 2), [143, 150]
           {NanSpot::key_cache, 4, 148, 1, 6},        // (c) chunk [144, 160), KV head 1
       }},
  };
  return s;
}

struct Outcome {
  std::vector<float> out;     // (tokens, kHeads, D)
  std::vector<float> lse;     // (kHeads, tokens)
  float out_sentinel = 0.f;   // the sentinel as stored in the output dtype
  uint64_t direct_items = 0;  // items the run sent to the direct decode kernel
  int fused_items = 0;        // head-fused items of its plan
};

Outcome run_case(const AttentionBackend& backend, const conformance::CaseInputs& inputs,
                 const std::vector<NanSpot>& spots, DecodeKernel kernel) {
  set_decode_kernel_override(kernel);
  conformance::PreparedRun run = conformance::prepare_run(backend, Device::cpu, inputs);
  const TensorView cache = run.kv_cache.view();  // (2, blocks, block_size, Hkv, D)
  const DType cache_dtype = run.kv_cache.dtype();
  const int block_size = static_cast<int>(cache.size(2));
  const int d = static_cast<int>(cache.size(4));
  const auto* table = static_cast<const int32_t*>(run.step_common.block_table.data());
  const int64_t cols = run.step_common.block_table.view().size(1);
  const auto* q_loc = static_cast<const int32_t*>(run.step_common.query_start_loc.data());
  for (const NanSpot& n : spots) {
    const float nan = n.negative ? -std::nanf("") : std::nanf("");
    const int64_t token = q_loc[n.req] + n.pos;
    switch (n.kind) {
      case NanSpot::key_cache: {  // K half of the cache (index 0), written by the context step
        const int64_t block = table[n.req * cols + n.pos / block_size];
        const int64_t at = block * cache.stride(1) + (n.pos % block_size) * cache.stride(2) +
                           n.head * cache.stride(3) + n.dim * cache.stride(4);
        store_f32(run.kv_cache.data(), cache_dtype, at, nan);  // bf16 / f16 quiet NaN, e4m3 0x7F / 0xFF
        break;
      }
      case NanSpot::key_input:
        store_f32(run.key.data(), run.key.dtype(), (token * kKvHeads + n.head) * d + n.dim, nan);
        break;
      case NanSpot::query:
        store_f32(run.query.data(), run.query.dtype(), (token * kHeads + n.head) * d + n.dim, nan);
        break;
    }
  }
  // The harness poisons with NaN; a sentinel instead, so that NaN outputs can be told from
  // unwritten ones.
  Outcome outcome;
  for (int64_t i = 0; i < run.output.numel(); ++i)
    store_f32(run.output.data(), run.output.dtype(), i, kSentinel);
  outcome.out_sentinel = load_f32(run.output.data(), run.output.dtype(), 0);
  for (int64_t i = 0; i < run.output_lse.numel(); ++i)
    store_f32(run.output_lse.data(), DType::f32, i, kSentinel);
  if (const auto* md = dynamic_cast<const CpuAttentionMetadata*>(run.step_metadata.get())) {
    for (const WorkItem& item : md->items) outcome.fused_items += item.num_kv_heads > 1 ? 1 : 0;
  }
  const uint64_t before = direct_decode_items_run();
  conformance::execute(run);
  outcome.direct_items = direct_decode_items_run() - before;
  for (int64_t i = 0; i < run.output.numel(); ++i)
    outcome.out.push_back(load_f32(run.output.data(), run.output.dtype(), i));
  for (int64_t i = 0; i < run.output_lse.numel(); ++i)
    outcome.lse.push_back(load_f32(run.output_lse.data(), DType::f32, i));
  return outcome;
}

struct CacheConfig {
  DType activations;
  const char* kv_cache_dtype;
  DType cache;
};

class CpuDecodeNanLogits : public KernelPathTest {};

TEST_P(CpuDecodeNanLogits, NanLogitRowsAreNanAsReference) {
  const EnvGuard guard("PAGEDATTN_NUM_THREADS", "1");  // every decode one head-fused item
  const Isa isa = GetParam().emulated_amx ? Isa::amx : GetParam().isa;
  const std::vector<CacheConfig> configs = {{DType::bf16, "auto", DType::bf16},
                                            {DType::f16, "auto", DType::f16},
                                            {DType::bf16, "fp8_e4m3", DType::fp8_e4m3}};
  uint64_t seed = 4100;
  for (const Scenario& s : scenarios()) {
    for (const CacheConfig& cc : configs) {
      for (int d : {64, 128}) {
        const conformance::ConformanceCase c =
            conformance::nan_rule_case(cc.activations, cc.kv_cache_dtype, d, kHeads, kKvHeads, s.window, s.batch);
        const std::string what = std::string(s.name) + " " + c.describe();
        const conformance::CaseInputs inputs = conformance::make_inputs(c, ++seed);
        ASSERT_EQ(inputs.c.batch.size(), c.batch.size()) << what;
        for (size_t r = 0; r < c.batch.size(); ++r) {  // the request indices are run order
          ASSERT_EQ(inputs.c.batch[r].context_len, c.batch[r].context_len) << what;
          ASSERT_EQ(inputs.c.batch[r].query_len, c.batch[r].query_len) << what;
        }
        const int reqs = static_cast<int>(c.batch.size());
        const int tokens = inputs.num_actual_tokens;
        ASSERT_EQ(tokens, reqs);  // one-token decodes: token r is request r's

        // Expected NaN rows (token, head): a K NaN makes every row that sees its key NaN, a
        // query NaN its own row.
        std::vector<uint8_t> nan_row(static_cast<size_t>(tokens) * kHeads, 0);
        for (const NanSpot& n : s.spots) {
          if (n.kind == NanSpot::query) {
            nan_row[static_cast<size_t>(n.req) * kHeads + n.head] = 1;
            continue;
          }
          const int pos = c.batch[n.req].context_len;  // the token's position
          const int key = n.kind == NanSpot::key_input ? pos + n.pos : n.pos;
          const int lo = s.window ? pos - (*s.window - 1) : 0;
          if (key < lo || key > pos) continue;  // not seen
          for (int h = n.head * kGroup; h < (n.head + 1) * kGroup; ++h)
            nan_row[static_cast<size_t>(n.req) * kHeads + h] = 1;
        }

        const Outcome reference =
            run_case(conformance::reference(), inputs, s.spots, DecodeKernel::tile);
        // The direct kernel, on every path but scalar and every cache here: the avx512 and amx
        // paths in both forms (bf16 dot products; f32 FMA, which also takes their f16 caches).
        const bool both_forms = isa == Isa::avx512 || isa == Isa::amx;
        const Outcome direct =
            run_case(cpu_backend(), inputs, s.spots, both_forms ? DecodeKernel::dot : DecodeKernel::automatic);
        const Outcome direct_fma =
            both_forms ? run_case(cpu_backend(), inputs, s.spots, DecodeKernel::fma) : direct;
        const Outcome tile = run_case(cpu_backend(), inputs, s.spots, DecodeKernel::tile);
        clear_decode_kernel_override();

        for (const Outcome* o : {&direct, &direct_fma}) {
          EXPECT_EQ(o->fused_items, reqs) << what << ": every decode should be head-fused";
          EXPECT_EQ(o->direct_items, isa != Isa::scalar ? uint64_t(reqs) : 0u) << what;
        }
        EXPECT_EQ(tile.direct_items, 0u) << what;

        const double tol = cc.cache == DType::fp8_e4m3 ? 0.03 : 0.02;
        const struct {
          const char* name;
          const Outcome& o;
        } runs[] = {{"direct", direct}, {"direct fma", direct_fma}, {"tile", tile}, {"REFERENCE", reference}};
        for (const auto& run : runs) {
          for (int t = 0; t < tokens; ++t) {  // one failure line per request
            int bad_rows = 0;
            std::string first;
            for (int h = 0; h < kHeads; ++h) {
              const bool want_nan = nan_row[static_cast<size_t>(t) * kHeads + h] != 0;
              const size_t li = static_cast<size_t>(h) * tokens + t;
              const float lse = run.o.lse[li], lse_ref = reference.lse[li];
              std::string bad;
              if (lse == kSentinel) {
                bad = "LSE not written";
              } else if (std::isnan(lse) != want_nan ||
                         (!want_nan && !(std::abs(lse - lse_ref) <= tol + tol * std::abs(lse_ref)))) {
                bad = "LSE " + std::to_string(lse) + " (REFERENCE " + std::to_string(lse_ref) + ")";
              }
              int bad_dims = 0;
              for (int x = 0; x < d; ++x) {
                const size_t i = (static_cast<size_t>(t) * kHeads + h) * d + x;
                const float v = run.o.out[i], ref = reference.out[i];
                std::string why;
                if (v == run.o.out_sentinel) {
                  why = "not written";
                } else if (std::isnan(v) != want_nan ||
                           (!want_nan && !(std::abs(v - ref) <= tol + tol * std::abs(ref)))) {
                  why = std::to_string(v) + " (REFERENCE " + std::to_string(ref) + ")";
                }
                if (!why.empty() && bad_dims++ == 0) {
                  bad += (bad.empty() ? "" : ", ") + std::string("dim ") + std::to_string(x) +
                         ": " + why;
                }
              }
              if (bad.empty()) continue;
              if (bad_rows++ == 0) {
                first = "head " + std::to_string(h) + " (NaN expected: " +
                        std::to_string(want_nan) + "): " + bad + ", " + std::to_string(bad_dims) +
                        " dims wrong";
              }
            }
            if (bad_rows > 0) {
              ADD_FAILURE() << what << " " << run.name << ": request " << t << ": " << bad_rows
                            << " rows wrong, first " << first;
            }
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, CpuDecodeNanLogits, every_kernel_path(), kernel_path_name);

}  // namespace
}  // namespace pagedattn::cpu
