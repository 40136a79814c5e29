// NaN in an MLA layer's inputs (issue 22 follow-up, data safety): CPU_MLA must give NaN in exactly
// the output and LSE elements REFERENCE_MLA (the fp64 oracle) gives NaN, and agree with it within
// DESIGN.md's tolerance everywhere else. The rule, as for the standard CPU backend
// (test_cpu_fp8_nan_codes.cpp, test_cpu_masked_nan.cpp):
//   - a NaN logit of a key a query row sees makes that whole row NaN (e^{NaN - m} is NaN). A NaN in
//     a latent row's kv_c part (cache row or this step's kv_c_normed) gives NaN logits and NaN
//     up-projected values for every head; in its k_pe part NaN logits for every head; so every row
//     that sees the key is NaN in every dim. A NaN in q[t, h] makes row (t, h) NaN, no other;
//   - a NaN in a slot no row sees (past a request's end in its last page, or a later token of the
//     same prefill: causal) has no effect.
// The cases are those where the CPU softmaxes used to drop the NaN: a row whose first tile's only
// visible logits are NaN (a one-key decode, the first token of a prefill, a context chunk of one
// key, a NaN query over a short context: the vector max reductions return their second operand
// when either is NaN, so the NaN left the running max and the row got weight 0), and an empty
// context merged with a NaN new-token result (merge_attn_states took max(-inf, NaN) = -inf for
// "both empty"). Plus the ordinary ones: NaN in the middle of a long decode (split-KV on 4
// threads), in a context chunk, masked slots. Three steps (decodes; prefills without context;
// decode + prefills with chunked context), f32 and bf16, on every CPU kernel path.
// Inputs are random (uniform, as the MLA harness), outputs and LSE are poisoned with a sentinel
// before the call and checked written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../../src/backends/cpu/cpu_mla_backend.h"
#include "conformance/mla_harness.h"
#include "cpu_kernel_paths.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn::cpu {
namespace {

// The small layer of the MLA unit tests (mla_harness: L 64, P 32, R 16, V 32, 4 heads, block 16).
constexpr int kHeads = 4, kL = 64, kP = 32, kR = 16, kV = 32, kBlockSize = 16;
constexpr float kSentinel = -7777.f;  // no output or LSE reaches it: |out| <= max |v| ~ 30

struct Request {
  int context, query;  // decodes (query 1) first
};

// One NaN written before the step.
struct Poison {
  enum Kind { cache, input, query } kind;
  int req;
  int pos;        // cache: key position of the request; input / query: its new token index
  int dim;        // cache / input: latent dim in [0, L + R) (kv_c part, then k_pe); query: [0, P + R)
  int head = -1;  // query only
};

struct Step {
  std::vector<Request> batch;
  std::vector<Poison> poisons;
};

struct Inputs {
  std::vector<int32_t> query_start_loc, seq_lens, block_table;
  std::vector<int64_t> slots;
  int cols = 0, num_blocks = 0, tokens = 0;
  Tensor weight, q, kv_c, k_pe, cache;  // cache: (num_blocks, block_size, L + R), the stale rows
};

Tensor uniform(Shape shape, DType dtype, std::mt19937& rng, float bound) {
  std::uniform_real_distribution<float> dist(-bound, bound);
  Tensor t(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) store_f32(t.data(), dtype, i, dist(rng));
  return t;
}

int64_t cache_index(const TensorView& cache, const Inputs& in, int req, int pos, int dim) {
  const int64_t block = in.block_table[static_cast<size_t>(req) * in.cols + pos / kBlockSize];
  return block * cache.stride(0) + (pos % kBlockSize) * cache.stride(1) + dim * cache.stride(2);
}

Inputs make_inputs(const Step& s, DType dtype, uint32_t seed) {
  Inputs in;
  std::mt19937 rng(seed);
  in.query_start_loc = {0};
  for (const Request& r : s.batch) {
    in.query_start_loc.push_back(in.query_start_loc.back() + r.query);
    in.seq_lens.push_back(r.context + r.query);
    in.cols = std::max(in.cols, (r.context + r.query + kBlockSize - 1) / kBlockSize);
  }
  in.tokens = in.query_start_loc.back();
  const int reqs = static_cast<int>(s.batch.size());
  in.num_blocks = reqs * in.cols + 2;
  std::vector<int32_t> pages(static_cast<size_t>(in.num_blocks));
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);
  in.block_table.assign(pages.begin(), pages.begin() + static_cast<int64_t>(reqs) * in.cols);
  for (int r = 0; r < reqs; ++r) {
    for (int j = 0; j < s.batch[r].query; ++j) {
      const int pos = s.batch[r].context + j;
      in.slots.push_back(int64_t{in.block_table[static_cast<size_t>(r) * in.cols + pos / kBlockSize]} *
                             kBlockSize + pos % kBlockSize);
    }
  }
  in.weight = uniform(Shape{kHeads * (kP + kV), kL}, dtype, rng, std::sqrt(3.f / kL));
  in.q = uniform(Shape{in.tokens, kHeads, kP + kR}, dtype, rng, 1.f);
  in.kv_c = uniform(Shape{in.tokens, kL}, dtype, rng, 1.f);
  in.k_pe = uniform(Shape{in.tokens, kR}, dtype, rng, 1.f);
  in.cache = uniform(Shape{in.num_blocks, kBlockSize, kL + kR}, dtype, rng, 1.f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const Poison& p : s.poisons) {
    const int64_t token = in.query_start_loc[p.req] + p.pos;
    switch (p.kind) {
      case Poison::cache:
        store_f32(in.cache.data(), dtype, cache_index(in.cache.view(), in, p.req, p.pos, p.dim), nan);
        break;
      case Poison::input:
        if (p.dim < kL) {
          store_f32(in.kv_c.data(), dtype, token * kL + p.dim, nan);
        } else {
          store_f32(in.k_pe.data(), dtype, token * kR + (p.dim - kL), nan);
        }
        break;
      case Poison::query:
        store_f32(in.q.data(), dtype, (token * kHeads + p.head) * (kP + kR) + p.dim, nan);
        break;
    }
  }
  return in;
}

struct Result {
  Tensor out;      // (T, H, V)
  Tensor lse;      // (H, T) f32
  int splits = 0;  // CPU_MLA: decode tokens whose keys were split (merge tasks of the plan)
};

// One step of an MLA layer forced to `backend`: plan, cache write, attention.
Result run_step(const char* backend, DType dtype, const Step& s, const Inputs& in) {
  MLAAttentionLayerParams p = conformance::mla::small_mla_layer_params(backend, dtype);
  MLAAttention layer(p);
  EXPECT_EQ(layer.backend().name(), backend);
  if (std::string(backend) == "CPU_MLA") EXPECT_EQ(layer.impl().prefill_backend_name(), "CPU");
  layer.process_weights_after_loading(in.weight);
  Tensor cache = layer.allocate_kv_cache(in.num_blocks);
  EXPECT_EQ(cache.shape(), in.cache.shape());
  EXPECT_EQ(cache.dtype(), in.cache.dtype());
  const TensorView cv = cache.view();
  for (int64_t b = 0; b < in.num_blocks; ++b) {
    for (int64_t t = 0; t < kBlockSize; ++t) {
      for (int64_t x = 0; x < kL + kR; ++x) {
        store_f32(cache.data(), dtype, b * cv.stride(0) + t * cv.stride(1) + x * cv.stride(2),
                  load_f32(in.cache.data(), dtype, (b * kBlockSize + t) * (kL + kR) + x));
      }
    }
  }
  CommonAttentionMetadataArgs args;
  args.query_start_loc = in.query_start_loc;
  args.seq_lens = in.seq_lens;
  args.block_table = in.block_table;
  args.max_num_blocks_per_req = in.cols;
  args.slot_mapping = in.slots;
  const OwnedCommonAttentionMetadata common = make_common_attention_metadata(args);
  // Workspace of 128 tokens: two prefills with context get 64-token chunks.
  BuilderConfig config = layer.builder_config(8, 256, 2048, 128);
  config.num_sms = 4;  // CPU_MLA: long decodes split (4 threads, partial rows merged)
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), config, Device::cpu);
  const auto plan = builder->build(0, common.common);
  Result r{Tensor(Shape{in.tokens, kHeads, kV}, dtype), Tensor(Shape{kHeads, in.tokens}, DType::f32)};
  if (const auto* cpu_plan = dynamic_cast<const CpuMlaMetadata*>(plan.get())) {
    r.splits = static_cast<int>(cpu_plan->merges.size());
  }
  for (int64_t i = 0; i < r.out.numel(); ++i) store_f32(r.out.data(), dtype, i, kSentinel);
  for (int64_t i = 0; i < r.lse.numel(); ++i) r.lse.data_as<float>()[i] = kSentinel;
  layer.forward(in.q, in.kv_c, in.k_pe, cache, *plan, r.out, r.lse);
  return r;
}

// (token, head) rows the rule makes NaN.
std::vector<uint8_t> expected_nan_rows(const Step& s, const Inputs& in) {
  std::vector<uint8_t> nan_row(static_cast<size_t>(in.tokens) * kHeads, 0);
  for (const Poison& p : s.poisons) {
    const Request& r = s.batch[p.req];
    const int first = in.query_start_loc[p.req];
    if (p.kind == Poison::query) {
      nan_row[static_cast<size_t>(first + p.pos) * kHeads + p.head] = 1;
      continue;
    }
    const int key = p.kind == Poison::cache ? p.pos : r.context + p.pos;
    for (int j = 0; j < r.query; ++j) {
      if (key > r.context + j) continue;  // not seen: causal, or past the request's end
      for (int h = 0; h < kHeads; ++h) nan_row[static_cast<size_t>(first + j) * kHeads + h] = 1;
    }
  }
  return nan_row;
}

double tolerance(DType dtype) { return dtype == DType::f32 ? 1e-5 : 8e-3; }  // DESIGN.md §5

// CPU_MLA and REFERENCE_MLA on the step: NaN exactly in the expected rows (every dim, and the
// LSE), both written everywhere, the rest within tolerance. Returns the number of NaN rows;
// `splits`: the decode tokens CPU_MLA's plan must split.
int check_step(const Step& s, DType dtype, uint32_t seed, int splits = 0) {
  const Inputs in = make_inputs(s, dtype, seed);
  const std::vector<uint8_t> expect = expected_nan_rows(s, in);
  const Result cpu = run_step("CPU_MLA", dtype, s, in);
  const Result ref = run_step("REFERENCE_MLA", dtype, s, in);
  EXPECT_EQ(cpu.splits, splits) << "split decode tokens";
  Tensor rounded(Shape{1}, dtype);  // the sentinel as the output dtype holds it
  store_f32(rounded.data(), dtype, 0, kSentinel);
  const float sentinel = load_f32(rounded.data(), dtype, 0);
  const std::string what = std::string(dtype_name(dtype)) + " seed " + std::to_string(seed);
  int wrong = 0, nan_rows = 0;
  double num = 0, den = 0, lse_diff = 0;
  for (int t = 0; t < in.tokens && wrong < 12; ++t) {
    for (int h = 0; h < kHeads && wrong < 12; ++h) {
      const bool want_nan = expect[static_cast<size_t>(t) * kHeads + h] != 0;
      nan_rows += want_nan ? 1 : 0;
      const std::string row = what + " token " + std::to_string(t) + " head " + std::to_string(h);
      for (int x = 0; x < kV; ++x) {
        const int64_t i = (static_cast<int64_t>(t) * kHeads + h) * kV + x;
        const float a = load_f32(cpu.out.data(), dtype, i), b = load_f32(ref.out.data(), dtype, i);
        if (a == sentinel || b == sentinel) {
          ADD_FAILURE() << row << " dim " << x << ": not written (CPU_MLA " << a
                        << ", REFERENCE_MLA " << b << ")";
          ++wrong;
          break;
        }
        if (std::isnan(a) != want_nan || std::isnan(b) != want_nan || (!want_nan && !std::isfinite(a))) {
          ADD_FAILURE() << row << " dim " << x << ": NaN expected " << want_nan << ", CPU_MLA " << a
                        << ", REFERENCE_MLA " << b;
          ++wrong;
          break;
        }
        if (!want_nan) {
          num += (static_cast<double>(a) - b) * (static_cast<double>(a) - b);
          den += static_cast<double>(b) * b;
        }
      }
      const int64_t li = static_cast<int64_t>(h) * in.tokens + t;
      const float la = cpu.lse.data_as<float>()[li], lb = ref.lse.data_as<float>()[li];
      if (la == kSentinel || lb == kSentinel || std::isnan(la) != want_nan ||
          std::isnan(lb) != want_nan || (!want_nan && !std::isfinite(la))) {
        ADD_FAILURE() << row << ": LSE NaN expected " << want_nan << ", CPU_MLA " << la
                      << ", REFERENCE_MLA " << lb;
        ++wrong;
      } else if (!want_nan) {
        lse_diff = std::max(lse_diff, std::abs(static_cast<double>(la) - lb) / (1.0 + std::abs(lb)));
      }
    }
  }
  const double rel = std::sqrt(num / std::max(den, 1e-30));
  EXPECT_LE(rel, tolerance(dtype)) << what << ": ||CPU_MLA - REFERENCE_MLA|| / ||REFERENCE_MLA|| "
                                   << "over the finite rows";
  EXPECT_LE(lse_diff, 10 * tolerance(dtype)) << what << ": LSE";
  EXPECT_GT(den, 0.0) << what << ": no finite rows compared";
  return nan_rows;
}

// Decodes: a one-key decode whose own new row has a NaN (its only key), NaN in the k_pe / kv_c
// part of a visible cache row (short, a few tiles, and in the second split of a 701-key decode),
// a NaN query head over 11 keys (every visible logit NaN, one short tile) and over 301 keys, and
// NaN in slots past the ends in their last pages (no effect).
Step decode_step() {
  return {{{0, 1}, {20, 1}, {150, 1}, {700, 1}, {10, 1}, {300, 1}},
          {{Poison::input, 0, 0, 3},
           {Poison::cache, 1, 7, kL + 2},
           {Poison::cache, 1, 21, kL + kR - 1},  // past the end (seq_len 21)
           {Poison::cache, 1, 25, 0},            // past the end
           {Poison::cache, 2, 149, 40},
           {Poison::cache, 2, 151, 0},           // past the end (seq_len 151)
           {Poison::cache, 2, 159, kL},          // past the end
           {Poison::cache, 3, 500, 10},          // second split
           {Poison::query, 4, 0, kP + 3, 2},     // q_pe of head 2: that row only
           {Poison::query, 5, 0, 0, 1},          // q_nope of head 1: that row only
           {Poison::cache, 5, 310, 1}}};         // past the end (seq_len 301)
}

// Prefills without context (new-token attention only, output written by the prefill kernel):
// NaN in the first token's k_pe (row 0 sees only that key), in token 65's kv_c of a 70-token
// prefill (rows 0..64 do not see it: causal, in the same 64-key tile as rows 64..69), a NaN
// query head of token 10 (all of its 11 logits NaN), a cache slot past the end (not read).
Step prefill_step() {
  return {{{0, 5}, {0, 70}},
          {{Poison::input, 0, 0, kL + 1},
           {Poison::cache, 0, 9, 4},  // past the end (seq_len 5)
           {Poison::input, 1, 65, 20},
           {Poison::query, 1, 10, 7, 3}}};
}

// A decode and prefills with chunked context (64-token chunks; context chunks merged with the
// new-token result): a prefill without context whose token 2 has a NaN (rows 2, 3: NaN new-token
// results merged with an empty context), NaN in a context row of a one-chunk context, NaN in the
// only key of a request's last context chunk (129 = 2 * 64 + 1), slots past the ends.
Step chunked_step() {
  return {{{33, 1}, {0, 4}, {50, 3}, {129, 2}},
          {{Poison::cache, 0, 40, 5},  // past the end (seq_len 34)
           {Poison::input, 1, 2, kL + 5},
           {Poison::cache, 2, 17, 60},
           {Poison::cache, 2, 55, 0},  // past the end (seq_len 53)
           {Poison::cache, 3, 128, 2}}};
}

class CpuMlaNan : public KernelPathTest {};

TEST_P(CpuMlaNan, DecodeNanRowsMatchReferenceMla) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    // token 0 (4 heads), token 1 (4), token 2 (4), token 3 (4), token 4 head 2, token 5 head 1
    EXPECT_EQ(check_step(decode_step(), dtype, 31, /*splits=*/1), 18);
  }
}

TEST_P(CpuMlaNan, PrefillNanRowsMatchReferenceMla) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    // request 0: 5 tokens x 4 heads; request 1: tokens 65..69 x 4 heads, token 10 head 3
    EXPECT_EQ(check_step(prefill_step(), dtype, 32), 20 + 20 + 1);
  }
}

TEST_P(CpuMlaNan, ChunkedContextNanRowsMatchReferenceMla) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    // request 1: tokens 2, 3; request 2: 3 tokens; request 3: 2 tokens (x 4 heads)
    EXPECT_EQ(check_step(chunked_step(), dtype, 33), (2 + 3 + 2) * 4);
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, CpuMlaNan, every_kernel_path(), kernel_path_name);

// merge_attn_states (the chunked prefill's last merge): an empty prefix (LSE -inf) merged with a
// NaN suffix is NaN, as e^{NaN - m}; two empty ones stay empty (0, LSE -inf).
TEST(CpuMlaNanMerge, EmptyPrefixAndNanSuffixIsNan) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // heads: (prefix lse, suffix lse) = (-inf, NaN), (NaN, -inf), (-inf, -inf), (1, NaN), (-inf, 0.5)
  const std::vector<std::pair<float, float>> lses = {{-inf, nan}, {nan, -inf}, {-inf, -inf}, {1.f, nan}, {-inf, 0.5f}};
  const int64_t H = static_cast<int64_t>(lses.size()), D = 16;
  std::mt19937 rng(7);
  Tensor prefix = uniform(Shape{1, H, D}, DType::f32, rng, 1.f);
  Tensor suffix = uniform(Shape{1, H, D}, DType::f32, rng, 1.f);
  Tensor lp(Shape{H, 1}, DType::f32), ls(Shape{H, 1}, DType::f32), lo(Shape{H, 1}, DType::f32);
  for (int64_t h = 0; h < H; ++h) {
    lp.data_as<float>()[h] = lses[h].first;
    ls.data_as<float>()[h] = lses[h].second;
    if (std::isnan(lses[h].first) || std::isnan(lses[h].second)) {
      for (int64_t x = 0; x < D; ++x) {  // a NaN LSE comes with a NaN row
        (std::isnan(lses[h].first) ? prefix : suffix).data_as<float>()[h * D + x] = nan;
      }
    }
    if (lses[h].first == -inf) {
      for (int64_t x = 0; x < D; ++x) prefix.data_as<float>()[h * D + x] = 0.f;  // empty
    }
  }
  Tensor out(Shape{1, H, D}, DType::f32);
  for (int64_t i = 0; i < out.numel(); ++i) out.data_as<float>()[i] = kSentinel;
  merge_attn_states(out, prefix, lp, suffix, ls, lo);
  for (int64_t h = 0; h < H; ++h) {
    const bool want_nan = std::isnan(lses[h].first) || std::isnan(lses[h].second);
    EXPECT_EQ(std::isnan(lo.data_as<float>()[h]), want_nan) << "head " << h << ": lse " << lo.data_as<float>()[h];
    for (int64_t x = 0; x < D; ++x) {
      const float o = out.data_as<float>()[h * D + x];
      if (std::isnan(o) != want_nan) {
        ADD_FAILURE() << "head " << h << " dim " << x << ": " << o << ", NaN expected " << want_nan;
        break;
      }
    }
  }
  EXPECT_EQ(lo.data_as<float>()[2], -inf);  // both empty
  for (int64_t x = 0; x < D; ++x) EXPECT_EQ(out.data_as<float>()[2 * D + x], 0.f);
  EXPECT_FLOAT_EQ(lo.data_as<float>()[4], 0.5f);  // empty prefix: the suffix alone
  for (int64_t x = 0; x < D; ++x) {
    EXPECT_FLOAT_EQ(out.data_as<float>()[4 * D + x], suffix.data_as<float>()[4 * D + x]);
  }
}

}  // namespace
}  // namespace pagedattn::cpu
