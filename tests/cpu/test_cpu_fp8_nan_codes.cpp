// The fp8 e4m3 NaN code (S.1111.111, 0x7F / 0xFF) in the K and V rows a decode reads, on every CPU
// kernel path this machine runs (cpu_kernel_paths.h): the direct decode kernels widen e4m3 with
// fast bit tricks (cpu_decode_avx2.h and cpu_decode_avx512_fma.h: a check and a NaN-exact
// recompute; cpu_decode_avx512.h: a table for the codes the shift cannot give), and must give NaN exactly where the tile kernel
// does. Head sizes 128 and 64, 6 query heads per KV head (register blocks of 4 rows: a 2-token
// decode's middle block holds rows of both tokens), 1- and 2-token decodes (a code in the second
// token's own K or V row is seen by that token's rows only: a ragged key of that middle block),
// codes in visible keys and in the masked slots past a request's end. A V code gives NaN in its
// dim of the rows that see its key, nothing else; a K code a NaN logit, so NaN in every dim of those
// rows (as REFERENCE: e^{NaN - m} is NaN; the CPU softmaxes used to give such a key weight 0 or
// the whole row NaN depending on where the NaN fell in their max reductions); codes past the end:
// no effect. Each case runs with the direct kernel (PAGEDATTN_CPU_DECODE_KERNEL=auto, or dot and
// fma on the avx512 and amx paths; every head-fused item must take it where the path has one), the tile kernel and REFERENCE: all three
// must give NaN in exactly the expected elements, and the direct and tile kernels' other elements
// must agree within bf16 tolerance.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../../src/backends/cpu/cpu_backend.h"
#include "../../src/backends/cpu/cpu_internal.h"
#include "conformance/env_guard.h"
#include "conformance/harness.h"
#include "cpu_kernel_paths.h"

namespace pagedattn::cpu {
namespace {

using conformance::EnvGuard;

constexpr int kHeads = 12, kKvHeads = 2, kGroup = kHeads / kKvHeads;

// One NaN code: in request `req`'s key `key`, KV head `head`, dim `dim`, of K (value = false) or V.
// `new_token` >= 0: the key is that query token's own (written by the step from the key / value
// input, whose NaN the cache write stores as the NaN code); else the code is written into the
// cache directly (`code`).
struct NanCode {
  int req, key, head, dim;
  bool value;
  int new_token;
  uint8_t code;
};

struct Outcome {
  std::vector<float> out;     // (tokens, kHeads, D) as f32
  uint64_t direct_items = 0;  // items the run sent to the direct decode kernel
  int fused_items = 0;        // head-fused items of its plan
};

// Runs the case on `backend` (CPU with the given decode kernel choice, or REFERENCE).
Outcome run_case(const AttentionBackend& backend, const conformance::CaseInputs& inputs,
                 const std::vector<NanCode>& codes, DecodeKernel kernel) {
  set_decode_kernel_override(kernel);
  conformance::PreparedRun run = conformance::prepare_run(backend, Device::cpu, inputs);
  const TensorView cache = run.kv_cache.view();  // (2, blocks, block_size, Hkv, D)
  const int block_size = static_cast<int>(cache.size(2));
  const auto* table = static_cast<const int32_t*>(run.step_common.block_table.data());
  const int64_t cols = run.step_common.block_table.view().size(1);
  const auto* q_loc = static_cast<const int32_t*>(run.step_common.query_start_loc.data());
  const int d = static_cast<int>(cache.size(4));
  for (const NanCode& n : codes) {
    if (n.new_token >= 0) {
      Tensor& t = n.value ? run.value : run.key;  // (T, Hkv, D)
      store_f32(t.data(), t.dtype(), (static_cast<int64_t>(q_loc[n.req] + n.new_token) * kKvHeads +
                                      n.head) * d + n.dim,
                std::nanf(""));
      continue;
    }
    const int64_t block = table[n.req * cols + n.key / block_size];
    const int64_t at = (n.value ? cache.stride(0) : 0) + block * cache.stride(1) +
                       (n.key % block_size) * cache.stride(2) + n.head * cache.stride(3) +
                       n.dim * cache.stride(4);
    static_cast<uint8_t*>(run.kv_cache.data())[at] = n.code;
  }
  Outcome outcome;
  if (const auto* md = dynamic_cast<const CpuAttentionMetadata*>(run.step_metadata.get())) {
    for (const WorkItem& item : md->items) outcome.fused_items += item.num_kv_heads > 1 ? 1 : 0;
  }
  const uint64_t before = direct_decode_items_run();
  conformance::execute(run);
  outcome.direct_items = direct_decode_items_run() - before;
  outcome.out.resize(static_cast<size_t>(run.output.numel()));
  for (int64_t i = 0; i < run.output.numel(); ++i) {
    outcome.out[i] = load_f32(run.output.data(), run.output.dtype(), i);
  }
  return outcome;
}

class CpuFp8NanCodes : public KernelPathTest {};

TEST_P(CpuFp8NanCodes, DirectKernelGivesNanWhereTheTileKernelDoes) {
  const EnvGuard guard("PAGEDATTN_NUM_THREADS", "1");  // every decode one head-fused item
  const bool has_direct = GetParam().isa != Isa::scalar;
  for (int d : {128, 64}) {
    conformance::ConformanceCase c;
    c.dtype = DType::bf16;
    c.kv_cache_dtype = "fp8_e4m3";
    c.head_size = d;
    c.num_heads = kHeads;
    c.num_kv_heads = kKvHeads;
    c.num_speculative_tokens = 1;  // 2-token decodes are decodes
    c.distribution = conformance::Distribution::normal;
    // (context, query tokens); block size 16: request 2 ends at key 46 of its page [32, 48),
    // request 3 at 132 of [128, 144).
    c.batch = {{100, 1}, {70, 2}, {45, 1}, {130, 2}, {300, 1}};
    const std::vector<NanCode> codes = {
        {0, 37, 1, 5, true, -1, 0x7F},       // V, visible: rows of head 1, dim 5
        {1, 3, 1, 0, true, -1, 0xFF},        // V, seen by both tokens
        {1, 71, 0, d - 1, false, 1, 0},      // K of token 1's own key (its head-0 rows only)
        {2, 16, 1, 17, false, -1, 0x7F},     // K, first key of a chunk, head 1
        {2, 47, 0, 3, false, -1, 0x7F},      // past the end: no effect
        {2, 46, 1, 3, true, -1, 0xFF},       // past the end: no effect
        {3, 131, 0, d / 2, true, 1, 0},      // V of token 1's own key: its head-0 rows, dim d/2
        {3, 140, 1, 9, false, -1, 0xFF},     // past the end: no effect
        {3, 135, 0, 9, true, -1, 0x7F},      // past the end: no effect
        {4, 255, 0, 40, false, -1, 0xFF},    // K, last key of a 16-key chunk, head 0
        {4, 299, 1, d - 2, true, -1, 0x7F},  // V, last cached key, head 1
    };
    const conformance::CaseInputs inputs = conformance::make_inputs(c, 900 + d);
    ASSERT_EQ(inputs.c.batch.size(), c.batch.size());
    for (size_t r = 0; r < c.batch.size(); ++r) {  // the request indices above are run order
      ASSERT_EQ(inputs.c.batch[r].context_len, c.batch[r].context_len);
      ASSERT_EQ(inputs.c.batch[r].query_len, c.batch[r].query_len);
    }
    // Expected NaN elements: (token, head, dim).
    const std::vector<int> q_len = {1, 2, 1, 2, 1};
    std::vector<int> first_token = {0};
    for (int q : q_len) first_token.push_back(first_token.back() + q);
    const int tokens = first_token.back();
    std::vector<uint8_t> expect_nan(static_cast<size_t>(tokens) * kHeads * d, 0);
    for (const NanCode& n : codes) {
      const int context = c.batch[n.req].context_len;
      for (int t = 0; t < q_len[n.req]; ++t) {
        const int pos = context + t;
        if (n.key > pos) continue;  // causal: not seen (slots past the end included)
        for (int h = n.head * kGroup; h < (n.head + 1) * kGroup; ++h) {
          for (int x = 0; x < d; ++x) {
            if (!n.value || x == n.dim) {
              expect_nan[(static_cast<size_t>(first_token[n.req] + t) * kHeads + h) * d + x] = 1;
            }
          }
        }
      }
    }
    const Outcome tile = run_case(cpu_backend(), inputs, codes, DecodeKernel::tile);
    const Outcome reference = run_case(conformance::reference(), inputs, codes, DecodeKernel::tile);
    EXPECT_EQ(tile.direct_items, 0u) << "D " << d;
    // The avx512 and amx paths' direct kernel in both forms (bf16 dot products, f32 FMA).
    const bool both_forms =
        GetParam().emulated_amx || GetParam().isa == Isa::avx512 || GetParam().isa == Isa::amx;
    const std::vector<DecodeKernel> forms =
        both_forms ? std::vector<DecodeKernel>{DecodeKernel::dot, DecodeKernel::fma}
                   : std::vector<DecodeKernel>{DecodeKernel::automatic};
    for (DecodeKernel form : forms) {
      const Outcome direct = run_case(cpu_backend(), inputs, codes, form);
      clear_decode_kernel_override();
      EXPECT_EQ(direct.fused_items, 5) << "D " << d << ": every decode should be head-fused";
      EXPECT_EQ(direct.direct_items, has_direct ? 5u : 0u) << "D " << d;
      int wrong = 0;
      for (size_t i = 0; i < expect_nan.size() && wrong < 10; ++i) {
        const std::string where = std::string(form == DecodeKernel::fma   ? "fma "
                                              : form == DecodeKernel::dot ? "dot "
                                                                          : "") +
                                  "D " + std::to_string(d) + " token " +
                                  std::to_string(i / (kHeads * d)) + " head " +
                                  std::to_string(i / d % kHeads) + " dim " + std::to_string(i % d);
        const bool nan_direct = std::isnan(direct.out[i]), nan_tile = std::isnan(tile.out[i]);
        const bool nan_reference = std::isnan(reference.out[i]);
        if (nan_direct != static_cast<bool>(expect_nan[i]) || nan_tile != nan_direct ||
            nan_reference != nan_direct) {
          ADD_FAILURE() << where << ": NaN expected " << static_cast<int>(expect_nan[i])
                        << ", direct " << direct.out[i] << ", tile " << tile.out[i]
                        << ", REFERENCE " << reference.out[i];
          ++wrong;
        } else if (!nan_direct &&
                   !(std::abs(direct.out[i] - tile.out[i]) <= 0.02f + 0.02f * std::abs(tile.out[i]))) {
          ADD_FAILURE() << where << ": direct " << direct.out[i] << ", tile " << tile.out[i];
          ++wrong;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, CpuFp8NanCodes, every_kernel_path(), kernel_path_name);

}  // namespace
}  // namespace pagedattn::cpu
