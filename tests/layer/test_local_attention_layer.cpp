// Chunked local attention (Llama 4) through the Attention layer: a layer with
// attention_chunk_size = C must let a query at absolute position p see exactly the keys k with
// k <= p and floor(k / C) == floor(p / C), on every backend (DESIGN.md §4). The layer gets this
// from make_builder: a chunked_local_attention spec gives the local-attention builder, which
// plans the backend's ordinary causal attention over vLLM's virtual batches.
//
// Every case runs layer.forward (cache write + attention) on random inputs against an fp64
// oracle written here, and first checks that the chunked answer differs from plain causal
// attention (so a layer that ignores the chunk fails). Also: the builder's contract (no cascade,
// no CUDA graphs, the spec it was made for), a plan that outlives the caller's metadata, batches
// that split into more virtual requests than max_num_seqs, and the errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "pagedattn/error.h"
#include "pagedattn/layer.h"
#include "pagedattn/metadata.h"
#include "pagedattn/ops.h"
#include "pagedattn/selector.h"

namespace pagedattn {
namespace {

constexpr int kHeads = 4, kKvHeads = 2, kHeadSize = 32;

Tensor random_tensor(Shape shape, DType dtype, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  Tensor t(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) store_f32(t.data(), dtype, i, dist(rng));
  return t;
}

AttentionLayerParams local_params(const std::string& backend, int chunk, int block_size,
                                  DType dtype = DType::f32) {
  AttentionLayerParams p;
  p.num_heads = kHeads;
  p.num_kv_heads = kKvHeads;
  p.head_size = kHeadSize;
  p.dtype = dtype;
  p.block_size = block_size;
  p.attention_chunk_size = chunk;
  p.prefix = "model.layers.1.self_attn.attn";
  p.backend = backend;
  return p;
}

// One step: request r has num_computed[r] cached tokens and query_lens[r] new ones; every
// request's full K/V, the step's q/k/v, a shuffled block table and the metadata.
struct Step {
  std::vector<int> num_computed, query_lens;
  int block_size = 0, cols = 0;
  std::vector<int32_t> block_table;  // (num_reqs, cols)
  std::vector<Tensor> full_k, full_v;  // per request (seq_len, Hkv, D)
  Tensor query, key, value;  // (T, Hq, D), (T, Hkv, D), (T, Hkv, D)
  std::unique_ptr<OwnedCommonAttentionMetadata> common;

  int num_reqs() const { return static_cast<int>(query_lens.size()); }
  int seq_len(int r) const { return num_computed[r] + query_lens[r]; }
  int num_tokens() const { return static_cast<int>(query.shape()[0]); }
  int64_t slot(int r, int pos) const {
    return int64_t{block_table[static_cast<size_t>(r * cols + pos / block_size)]} * block_size +
           pos % block_size;
  }
};

int blocks_needed(const std::vector<int>& computed, const std::vector<int>& query_lens, int bs) {
  int total = 0;
  for (size_t r = 0; r < computed.size(); ++r) total += (computed[r] + query_lens[r] + bs - 1) / bs;
  return total;
}

// Builds the step and writes every request's context into `cache` (a previous step).
Step make_step(const Attention& layer, const Tensor& cache, int num_blocks,
               std::vector<int> num_computed, std::vector<int> query_lens, std::mt19937& rng) {
  const AttentionLayerParams& p = layer.params();
  Step s;
  s.num_computed = std::move(num_computed);
  s.query_lens = std::move(query_lens);
  s.block_size = p.block_size;
  for (int r = 0; r < s.num_reqs(); ++r) {
    s.cols = std::max(s.cols, (s.seq_len(r) + s.block_size - 1) / s.block_size);
  }
  std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  s.block_table.assign(static_cast<size_t>(s.num_reqs()) * s.cols, 0);
  size_t next = 0;
  for (int r = 0; r < s.num_reqs(); ++r) {
    for (int b = 0; b < (s.seq_len(r) + s.block_size - 1) / s.block_size; ++b) {
      s.block_table[static_cast<size_t>(r * s.cols + b)] = ids.at(next++);
    }
  }
  const int64_t row_k = int64_t{kKvHeads} * kHeadSize;
  const size_t esize = dtype_size(p.dtype);
  int total = 0;
  for (int r = 0; r < s.num_reqs(); ++r) total += s.query_lens[r];
  s.query = random_tensor(Shape{total, kHeads, kHeadSize}, p.dtype, rng);
  s.key = Tensor(Shape{total, kKvHeads, kHeadSize}, p.dtype);
  s.value = Tensor(Shape{total, kKvHeads, kHeadSize}, p.dtype);
  CommonAttentionMetadataArgs args;
  args.query_start_loc.push_back(0);
  int row = 0;
  for (int r = 0; r < s.num_reqs(); ++r) {
    s.full_k.push_back(random_tensor(Shape{s.seq_len(r), kKvHeads, kHeadSize}, p.dtype, rng));
    s.full_v.push_back(random_tensor(Shape{s.seq_len(r), kKvHeads, kHeadSize}, p.dtype, rng));
    const int ctx = s.num_computed[r];
    if (ctx > 0) {
      Tensor slots(Shape{ctx}, DType::i64);
      for (int i = 0; i < ctx; ++i) slots.data_as<int64_t>()[i] = s.slot(r, i);
      reshape_and_cache(s.full_k[r].view().narrow(0, 0, ctx), s.full_v[r].view().narrow(0, 0, ctx),
                        cache, slots, p.kv_cache_dtype, 1.f, 1.f);
    }
    for (int i = 0; i < s.query_lens[r]; ++i, ++row) {
      const int pos = ctx + i;
      std::memcpy(static_cast<char*>(s.key.data()) + row * row_k * esize,
                  static_cast<const char*>(s.full_k[r].data()) + pos * row_k * esize, row_k * esize);
      std::memcpy(static_cast<char*>(s.value.data()) + row * row_k * esize,
                  static_cast<const char*>(s.full_v[r].data()) + pos * row_k * esize, row_k * esize);
      args.slot_mapping.push_back(s.slot(r, pos));
    }
    args.query_start_loc.push_back(args.query_start_loc.back() + s.query_lens[r]);
    args.seq_lens.push_back(s.seq_len(r));
  }
  args.block_table = s.block_table;
  args.max_num_blocks_per_req = s.cols;
  s.common = std::make_unique<OwnedCommonAttentionMetadata>(
      make_common_attention_metadata(args, Device::cpu, num_blocks, s.block_size));
  return s;
}

// fp64 attention of the step; chunk > 0: chunked local (k <= p, k / chunk == p / chunk), else
// causal. out (T, Hq, D), lse (Hq, T).
void oracle(const Step& s, DType dtype, float scale, int chunk, std::vector<double>& out,
            std::vector<double>& lse) {
  const int total = s.num_tokens();
  out.assign(static_cast<size_t>(total) * kHeads * kHeadSize, 0.0);
  lse.assign(static_cast<size_t>(kHeads) * total, 0.0);
  int row = 0;
  for (int r = 0; r < s.num_reqs(); ++r) {
    for (int i = 0; i < s.query_lens[r]; ++i, ++row) {
      const int pos = s.num_computed[r] + i;
      const int first = chunk > 0 ? pos / chunk * chunk : 0;
      for (int h = 0; h < kHeads; ++h) {
        const int kvh = h / (kHeads / kKvHeads);
        std::vector<double> w;
        double m = -std::numeric_limits<double>::infinity();
        for (int j = first; j <= pos; ++j) {
          double dot = 0;
          for (int e = 0; e < kHeadSize; ++e) {
            dot += load_f64(s.query.data(), dtype, (int64_t{row} * kHeads + h) * kHeadSize + e) *
                   load_f64(s.full_k[r].data(), dtype, (int64_t{j} * kKvHeads + kvh) * kHeadSize + e);
          }
          w.push_back(dot * scale);
          m = std::max(m, w.back());
        }
        double sum = 0;
        for (double& x : w) sum += (x = std::exp(x - m));
        for (int e = 0; e < kHeadSize; ++e) {
          double acc = 0;
          for (int j = first; j <= pos; ++j) {
            acc += w[static_cast<size_t>(j - first)] *
                   load_f64(s.full_v[r].data(), dtype, (int64_t{j} * kKvHeads + kvh) * kHeadSize + e);
          }
          out[(static_cast<size_t>(row) * kHeads + h) * kHeadSize + e] = acc / sum;
        }
        lse[static_cast<size_t>(h) * total + row] = std::log(sum) + m;
      }
    }
  }
}

double relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  double err2 = 0, ref2 = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    err2 += (got[i] - want[i]) * (got[i] - want[i]);
    ref2 += want[i] * want[i];
  }
  return std::sqrt(err2 / ref2);
}

std::vector<double> to_f64(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = load_f64(t.data(), t.dtype(), i);
  return v;
}

struct LocalCase {
  const char* backend;
  DType dtype;
  int chunk, block_size;
  std::vector<int> num_computed, query_lens;
  const char* name;
};

void PrintTo(const LocalCase& c, std::ostream* os) { *os << c.name; }

class LocalAttentionLayer : public ::testing::TestWithParam<LocalCase> {};

TEST_P(LocalAttentionLayer, MatchesTheChunkedOracle) {
  const LocalCase c = GetParam();
  Attention layer(local_params(c.backend, c.chunk, c.block_size, c.dtype));
  ASSERT_EQ(layer.backend().name(), c.backend);
  const int num_blocks = blocks_needed(c.num_computed, c.query_lens, c.block_size) + 3;
  Tensor cache = layer.allocate_kv_cache(num_blocks);
  cache.fill_bytes(0x3C);
  std::mt19937 rng(7 + c.chunk + 31 * c.block_size);
  Step s = make_step(layer, cache, num_blocks, c.num_computed, c.query_lens, rng);

  std::vector<double> want_out, want_lse, causal_out, causal_lse;
  oracle(s, c.dtype, *layer.params().scale, c.chunk, want_out, want_lse);
  oracle(s, c.dtype, *layer.params().scale, 0, causal_out, causal_lse);
  // The case can tell the two apart: plain causal attention is far off the chunked answer.
  ASSERT_GT(relative_error(causal_out, want_out), 0.05) << "case does not exercise the chunk";

  // Limits as a serving engine sets them: fewer sequences than the batch has virtual requests.
  auto builder = layer.backend().make_builder(
      layer.kv_cache_spec(), layer.builder_config(s.num_reqs(), 512, 512), Device::cpu);
  std::shared_ptr<const AttentionMetadata> md = builder->build(0, s.common->common);
  EXPECT_EQ(md->num_actual_tokens, s.num_tokens());
  EXPECT_FALSE(md->use_cascade);

  Tensor out(Shape{s.num_tokens(), kHeads, kHeadSize}, c.dtype);
  out.fill_bytes(0xFF);  // NaN: every row must be written
  Tensor lse(Shape{kHeads, s.num_tokens()}, DType::f32);
  lse.fill_bytes(0xFF);
  const bool check_lse = std::string(c.backend) == "REFERENCE";
  layer.forward(s.query, s.key, s.value, cache, *md, out, check_lse ? lse.view() : TensorView{});

  const double tol = c.dtype == DType::f32 ? 1e-5 : (c.dtype == DType::f16 ? 2e-3 : 8e-3);
  EXPECT_LE(relative_error(to_f64(out), want_out), tol);
  if (check_lse) {
    for (size_t i = 0; i < want_lse.size(); ++i) {
      EXPECT_NEAR(lse.data_as<float>()[i], want_lse[i], 1e-4 * std::max(1.0, std::fabs(want_lse[i])))
          << "lse " << i;
    }
  }
}

// C > block size, C == block size, C a multiple of a small block size; prefill (80 tokens from
// position 0), decode at position 70, decodes at chunk edges, chunks of a prefill that start
// inside a chunk, and a mixed batch of all of them.
INSTANTIATE_TEST_SUITE_P(
    Grid, LocalAttentionLayer,
    ::testing::Values(
        LocalCase{"REFERENCE", DType::f32, 32, 16, {0}, {80}, "reference_prefill80_c32_bs16"},
        LocalCase{"REFERENCE", DType::f32, 32, 16, {70}, {1}, "reference_decode70_c32_bs16"},
        LocalCase{"REFERENCE", DType::f32, 32, 16, {70, 0, 20, 31, 63, 64},
                  {1, 80, 30, 2, 1, 1}, "reference_mixed_c32_bs16"},
        LocalCase{"REFERENCE", DType::bf16, 16, 16, {40, 0, 5, 47}, {1, 50, 27, 1},
                  "reference_mixed_c16_eq_bs16_bf16"},
        LocalCase{"REFERENCE", DType::f32, 64, 8, {100, 0, 60}, {1, 150, 9},
                  "reference_mixed_c64_bs8"},
        LocalCase{"CPU", DType::f32, 32, 16, {0}, {80}, "cpu_prefill80_c32_bs16"},
        LocalCase{"CPU", DType::f32, 32, 16, {70}, {1}, "cpu_decode70_c32_bs16"},
        LocalCase{"CPU", DType::bf16, 32, 16, {70, 0, 20, 31, 63, 64}, {1, 80, 30, 2, 1, 1},
                  "cpu_mixed_c32_bs16_bf16"},
        LocalCase{"CPU", DType::f16, 16, 16, {40, 0, 5, 47}, {1, 50, 27, 1},
                  "cpu_mixed_c16_eq_bs16_f16"}),
    [](const ::testing::TestParamInfo<LocalCase>& info) { return std::string(info.param.name); });

// ---- the builder's contract ----------------------------------------------------------------

TEST(LocalAttentionBuilder, NeverCascadesNorCapturesAndReportsTheChunkedSpec) {
  Attention layer(local_params("REFERENCE", 32, 16));
  const BuilderConfig config = layer.builder_config(64, 512, 8192);
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), config, Device::cpu);
  EXPECT_EQ(builder->kv_cache_spec(), layer.kv_cache_spec());
  EXPECT_EQ(builder->cudagraph_support(), CudaGraphSupport::never);
  EXPECT_FALSE(builder->supports_cascade());
  // A batch the FlashAttention heuristic sends down the cascade path for full attention...
  const std::vector<int32_t> query_lens(64, 1);
  auto full = layer.backend().make_builder(
      KVCacheSpec::full_attention(16, kKvHeads, kHeadSize, DType::f32), config, Device::cpu);
  ASSERT_TRUE(full->use_cascade_attention(4096, query_lens, kHeads, kKvHeads, false, false, false, 8));
  // ... never takes it with local attention (vLLM: use_local_attention=true).
  EXPECT_FALSE(builder->use_cascade_attention(4096, query_lens, kHeads, kKvHeads, false, false,
                                              false, 8));
}

// The plan owns what it needs: the caller frees its metadata before the forward. A cascade prefix
// offered anyway is ignored (the blocks are not even shared here): same answer, no cascade.
TEST(LocalAttentionBuilder, APlanOutlivesTheCallersMetadataAndIgnoresACascadePrefix) {
  for (const char* backend : {"REFERENCE", "CPU"}) {
    SCOPED_TRACE(backend);
    Attention layer(local_params(backend, 32, 16));
    const std::vector<int> computed{40, 20, 33}, query_lens{1, 30, 5};
    const int num_blocks = blocks_needed(computed, query_lens, 16) + 2;
    Tensor cache = layer.allocate_kv_cache(num_blocks);
    cache.fill_bytes(0);
    std::mt19937 rng(99);
    Step s = make_step(layer, cache, num_blocks, computed, query_lens, rng);
    std::vector<double> want_out, want_lse;
    oracle(s, DType::f32, *layer.params().scale, 32, want_out, want_lse);
    auto builder = layer.backend().make_builder(layer.kv_cache_spec(),
                                                layer.builder_config(4, 64, 128), Device::cpu);
    std::shared_ptr<const AttentionMetadata> md = builder->build(16, s.common->common);
    EXPECT_FALSE(md->use_cascade);
    EXPECT_EQ(md->common_prefix_len, 0);
    // Free the caller's metadata (a read of it after this is a use-after-free under ASan) and
    // the builder (a host plan needs neither).
    s.common.reset();
    builder.reset();
    Tensor out(Shape{s.num_tokens(), kHeads, kHeadSize}, DType::f32);
    out.fill_bytes(0xFF);
    layer.forward(s.query, s.key, s.value, cache, *md, out);
    EXPECT_LE(relative_error(to_f64(out), want_out), 1e-5);
  }
}

TEST(LocalAttentionBuilder, AnEmptyBatchAndPaddingRequestsPlanNothing) {
  for (const char* backend : {"REFERENCE", "CPU"}) {
    SCOPED_TRACE(backend);
    Attention layer(local_params(backend, 32, 16));
    auto builder = layer.backend().make_builder(layer.kv_cache_spec(),
                                                layer.builder_config(4, 64, 128), Device::cpu);
    CommonAttentionMetadataArgs empty;
    empty.query_start_loc = {0};
    empty.max_num_blocks_per_req = 2;
    const auto none = make_common_attention_metadata(empty, Device::cpu);
    std::shared_ptr<const AttentionMetadata> md = builder->build(0, none.common);
    EXPECT_EQ(md->num_reqs, 0);
    EXPECT_EQ(md->num_actual_tokens, 0);
    // A request with cached tokens and no new ones: one virtual request with no query.
    CommonAttentionMetadataArgs idle;
    idle.query_start_loc = {0, 0};
    idle.seq_lens = {40};
    idle.block_table = {3, 1, 2};
    idle.max_num_blocks_per_req = 3;
    const auto padded = make_common_attention_metadata(idle, Device::cpu);
    md = builder->build(0, padded.common);
    EXPECT_EQ(md->num_reqs, 1);
    EXPECT_EQ(md->num_actual_tokens, 0);
  }
}

// ---- errors -----------------------------------------------------------------------------------

void expect_error(const std::function<void()>& fn, const std::string& argument,
                  const std::string& in_message) {
  try {
    fn();
    ADD_FAILURE() << "expected an Error naming '" << argument << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(in_message), std::string::npos) << e.what();
  }
}

TEST(LocalAttentionBuilder, ChunksSmallerThanABlockOrNotWholeBlocksAreClearErrors) {
  // vLLM asserts attn_chunk_size % block_size == 0 (a virtual request's block table is whole
  // pages of its chunk): a chunk smaller than a block cannot be expressed.
  expect_error([] { Attention layer(local_params("REFERENCE", 8, 16)); }, "attention_chunk_size",
               "attention_chunk_size = 8 must be a positive multiple of block_size = 16");
  expect_error([] { Attention layer(local_params("CPU", 24, 16)); }, "attention_chunk_size",
               "attention_chunk_size = 24");
  // The same rule where a builder is made from a spec directly.
  const AttentionBackend& reference = *find_backend("REFERENCE");
  BuilderConfig config;
  config.num_heads = kHeads;
  for (int chunk : {8, 24}) {
    expect_error(
        [&] {
          (void)reference.make_builder(
              KVCacheSpec::chunked_local_attention(16, kKvHeads, kHeadSize, DType::f32, chunk),
              config, Device::cpu);
        },
        "spec.attention_chunk_size", "must be a multiple of block_size = 16");
  }
  // MLA layers have no chunk size: an MLA backend refuses the spec.
  expect_error(
      [&] {
        (void)find_backend("CPU_MLA")->make_builder(
            KVCacheSpec::chunked_local_attention(16, 1, 576, DType::bf16, 64), config, Device::cpu);
      },
      "spec", "MLA");
}

TEST(LocalAttentionBuilder, BatchesBeyondTheGroupsLimitsAreErrors) {
  Attention layer(local_params("REFERENCE", 32, 16));
  const int num_blocks = 40;
  Tensor cache = layer.allocate_kv_cache(num_blocks);
  std::mt19937 rng(5);
  Step s = make_step(layer, cache, num_blocks, {10, 50, 0}, {1, 1, 40}, rng);
  // Three requests against max_num_seqs = 2 (the virtual requests have their own, larger room).
  auto small = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(2, 64, 256),
                                            Device::cpu);
  expect_error([&] { (void)small->build(0, s.common->common); }, "common.num_reqs",
               "max_num_seqs = 2");
  auto short_model = layer.backend().make_builder(
      layer.kv_cache_spec(), layer.builder_config(8, 64, 48), Device::cpu);
  expect_error([&] { (void)short_model->build(0, s.common->common); }, "common.max_seq_len",
               "max_model_len = 48");
  // A block table narrower than a request needs (virtual tables would clip to its last column).
  CommonAttentionMetadataArgs narrow;
  narrow.query_start_loc = {0, 1};
  narrow.seq_lens = {51};
  narrow.block_table = {0, 1, 2};
  narrow.max_num_blocks_per_req = 3;
  narrow.slot_mapping = {40};
  const auto common = make_common_attention_metadata(narrow, Device::cpu);
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(8, 64, 256),
                                              Device::cpu);
  expect_error([&] { (void)builder->build(0, common.common); }, "common.block_table_tensor",
               "needs 4");
}

}  // namespace
}  // namespace pagedattn
