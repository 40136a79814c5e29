// CPU MLA: the CPU MLA prefill backend against the REFERENCE prefill backend (causal new tokens
// with LSE, context chunks including empty ones, f32 / f16 / bf16, small and DeepSeek dims), the
// CPU_MLA decode plan (splits cover every key once), the backend's selector reasons, and bad
// input (an Error naming the argument, nothing written).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../../src/backends/cpu/cpu_internal.h"
#include "../../src/backends/cpu/cpu_mla_backend.h"
#include "../../src/backends/cpu/cpu_mla_prefill.h"
#include "cpu_kernel_paths.h"
#include "conformance/mla_harness.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn::cpu {
namespace {

float to_float(DType dtype, const void* base, int64_t i) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(base)[i];
    case DType::f16: return f16_bits_to_f32(static_cast<const uint16_t*>(base)[i]);
    default: return bf16_bits_to_f32(static_cast<const uint16_t*>(base)[i]);
  }
}

void store_float(DType dtype, void* base, int64_t i, float x) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(base)[i] = x; break;
    case DType::f16: static_cast<uint16_t*>(base)[i] = f32_to_f16_bits(x); break;
    default: static_cast<uint16_t*>(base)[i] = f32_to_bf16_bits(x); break;
  }
}

// Contiguous tensor of normal(0, 1) values (never zeros: a test that sees zeros proves nothing).
Tensor random_tensor(Shape shape, DType dtype, std::mt19937& rng) {
  Tensor t(shape, dtype);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (int64_t i = 0; i < t.numel(); ++i) store_float(dtype, t.data(), i, dist(rng));
  return t;
}

Tensor poisoned(Shape shape, DType dtype) {
  Tensor t(shape, dtype);
  t.fill_bytes(0xFF);  // NaN in every float dtype
  return t;
}

double tolerance(DType dtype) {
  return dtype == DType::f32 ? 1e-5 : dtype == DType::f16 ? 2e-3 : 8e-3;
}

// ‖a − b‖ / ‖b‖ over every element; NaN anywhere in `a` (an element not written) fails.
double relative_error(const Tensor& a, const Tensor& b) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = to_float(a.dtype(), a.data(), i), y = to_float(b.dtype(), b.data(), i);
    if (std::isnan(x)) return std::numeric_limits<double>::infinity();
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Largest |a − b| of two LSE tensors (f32), equal infinities count as 0; NaN fails.
double lse_max_diff(const Tensor& a, const Tensor& b) {
  double worst = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const float x = a.data_as<float>()[i], y = b.data_as<float>()[i];
    if (std::isnan(x)) return std::numeric_limits<double>::infinity();
    if (std::isinf(x) || std::isinf(y)) {
      if (x != y) return std::numeric_limits<double>::infinity();
      continue;
    }
    worst = std::max(worst, std::abs(static_cast<double>(x) - y));
  }
  return worst;
}

// Every kernel path (cpu_kernel_paths.h), as test_cpu_conformance.cpp.
class CpuMlaPath : public KernelPathTest {};

INSTANTIATE_TEST_SUITE_P(Paths, CpuMlaPath, every_kernel_path(), kernel_path_name);

struct PrefillShape {
  int num_heads, nope, rope, v;
  std::vector<int32_t> query_lens, context_lens;
  int chunk = 0;  // tokens per prefill per context chunk (0 = no context)
};

// The prefill plan of a step, built by hand as MLACommonMetadataBuilder would.
MLAPrefillMetadata make_prefill_metadata(const PrefillShape& s) {
  MLAPrefillMetadata md;
  const int n = static_cast<int>(s.query_lens.size());
  md.num_prefills = n;
  md.query_start_loc.assign(1, 0);
  int max_context = 0;
  for (int i = 0; i < n; ++i) {
    md.query_start_loc.push_back(md.query_start_loc.back() + s.query_lens[i]);
    md.seq_lens.push_back(s.query_lens[i] + s.context_lens[i]);
    md.context_lens.push_back(s.context_lens[i]);
    md.max_query_len = std::max(md.max_query_len, s.query_lens[i]);
    md.max_seq_len = std::max(md.max_seq_len, md.seq_lens.back());
    max_context = std::max(max_context, s.context_lens[i]);
  }
  md.num_prefill_tokens = md.query_start_loc.back();
  if (max_context > 0) {
    MLAChunkedContextMetadata& cc = md.chunked_context.emplace();
    cc.max_context_chunk = s.chunk;
    cc.num_chunks = (max_context + s.chunk - 1) / s.chunk;
    cc.cu_seq_lens.assign(static_cast<size_t>(cc.num_chunks) * (n + 1), 0);
    for (int c = 0; c < cc.num_chunks; ++c) {
      int32_t running = 0, longest = 0;
      for (int i = 0; i < n; ++i) {
        const int start = c * s.chunk;
        const int len = std::max(0, std::min(s.context_lens[i], start + s.chunk) - start);
        cc.chunk_starts.push_back(start);
        cc.chunk_seq_lens.push_back(len);
        running += len;
        cc.cu_seq_lens[c * (n + 1) + i + 1] = running;
        longest = std::max(longest, len);
      }
      cc.chunk_total_tokens.push_back(running);
      cc.max_seq_lens.push_back(longest);
    }
    cc.workspace_tokens = *std::max_element(cc.chunk_total_tokens.begin(), cc.chunk_total_tokens.end());
  }
  return md;
}

MLAPrefillParams prefill_params(const PrefillShape& s, DType dtype) {
  MLAPrefillParams p;
  p.num_heads = s.num_heads;
  p.scale = 1.f / std::sqrt(static_cast<float>(s.nope + s.rope));
  p.kv_lora_rank = 512;
  p.qk_nope_head_dim = s.nope;
  p.qk_rope_head_dim = s.rope;
  p.v_head_dim = s.v;
  p.dtype = dtype;
  p.device = Device::cpu;
  return p;
}

const MLAPrefillBackendClass& reference_prefill() {
  const MLAPrefillBackendClass* ref = find_mla_prefill_backend("REFERENCE");
  if (ref == nullptr) throw Error("REFERENCE", "the REFERENCE MLA prefill backend is not registered");
  return *ref;
}

// Runs new tokens (with LSE) and every context chunk on CPU and REFERENCE; compares.
void check_prefill(const PrefillShape& s, DType dtype, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << active_kernels().name << " dtype " << dtype_name(dtype) << " H " << s.num_heads
                                    << " P+R " << s.nope + s.rope << " V " << s.v << " seed " << seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const MLAPrefillMetadata md = make_prefill_metadata(s);
  const MLAPrefillParams params = prefill_params(s, dtype);
  auto cpu = cpu_mla_prefill_backend_class().create(params);
  auto ref = reference_prefill().create(params);
  cpu->prepare_metadata(md);
  ref->prepare_metadata(md);
  const int64_t tp = md.num_prefill_tokens, h = s.num_heads, d = s.nope + s.rope;
  // q with a padded head stride (token/head strides are free), k and v contiguous.
  Tensor q_storage = random_tensor(Shape{tp, h, d + 16}, dtype, rng);
  const TensorView q = q_storage.view().narrow(2, 0, d);
  Tensor k = random_tensor(Shape{tp, h, d}, dtype, rng);
  Tensor v = random_tensor(Shape{tp, h, s.v}, dtype, rng);

  Tensor out = poisoned(Shape{tp, h, s.v}, dtype), lse = poisoned(Shape{h, tp}, DType::f32);
  Tensor ref_out(Shape{tp, h, s.v}, dtype), ref_lse(Shape{h, tp}, DType::f32);
  cpu->run_prefill_new_tokens(q, k, v, true, out, lse);
  ref->run_prefill_new_tokens(q, k, v, true, ref_out, ref_lse);
  EXPECT_LE(relative_error(out, ref_out), tolerance(dtype)) << "new tokens: out";
  EXPECT_LE(lse_max_diff(lse, ref_lse), dtype == DType::f32 ? 1e-4 : 1e-2) << "new tokens: lse";

  // Without LSE: the output alone, the LSE tensor untouched.
  Tensor out2 = poisoned(Shape{tp, h, s.v}, dtype);
  Tensor untouched = poisoned(Shape{h, tp}, DType::f32);
  cpu->run_prefill_new_tokens(q, k, v, false, out2, untouched);
  EXPECT_LE(relative_error(out2, ref_out), tolerance(dtype)) << "new tokens without lse";
  for (int64_t i = 0; i < untouched.numel(); ++i) {
    ASSERT_TRUE(std::isnan(untouched.data_as<float>()[i])) << "lse written without being asked";
  }

  if (!md.chunked_context) return;
  const MLAChunkedContextMetadata& cc = *md.chunked_context;
  for (int c = 0; c < cc.num_chunks; ++c) {
    SCOPED_TRACE(::testing::Message() << "chunk " << c);
    const int64_t rows = std::max<int64_t>(1, cc.chunk_total_tokens[c]);
    Tensor ck = random_tensor(Shape{rows, h, d}, dtype, rng);
    Tensor cv = random_tensor(Shape{rows, h, s.v}, dtype, rng);
    Tensor cout = poisoned(Shape{tp, h, s.v}, dtype), clse = poisoned(Shape{h, tp}, DType::f32);
    Tensor rout(Shape{tp, h, s.v}, dtype), rlse(Shape{h, tp}, DType::f32);
    const auto [o, l] = cpu->run_prefill_context_chunk(c, q, ck, cv, cout, clse);
    EXPECT_EQ(o.data(), cout.data());
    EXPECT_EQ(l.data(), clse.data());
    ref->run_prefill_context_chunk(c, q, ck, cv, rout, rlse);
    EXPECT_LE(relative_error(cout, rout), tolerance(dtype));
    EXPECT_LE(lse_max_diff(clse, rlse), dtype == DType::f32 ? 1e-4 : 1e-2);
    // Prefills whose chunk is empty: out 0, lse -inf (checked directly, not only vs REFERENCE).
    const int n = md.num_prefills;
    for (int i = 0; i < n; ++i) {
      if (cc.chunk_seq_lens[c * n + i] != 0) continue;
      for (int t = md.query_start_loc[i]; t < md.query_start_loc[i + 1]; ++t) {
        for (int64_t hh = 0; hh < h; ++hh) {
          EXPECT_EQ(clse.data_as<float>()[hh * tp + t], -std::numeric_limits<float>::infinity());
          for (int e = 0; e < s.v; ++e) {
            ASSERT_EQ(to_float(dtype, cout.data(), (t * h + hh) * s.v + e), 0.f);
          }
        }
      }
    }
  }
}

TEST_P(CpuMlaPath, PrefillNewTokensAndChunksMatchReference) {
  // Small dims (P+R 48, V 32), ragged requests, a q tile boundary (130 > 128 tokens), context
  // split in chunks of 32 with empty chunks for the shorter contexts.
  const PrefillShape small{3, 32, 16, 32, {5, 130, 17}, {40, 0, 97}, 32};
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) check_prefill(small, dtype, 11);
  // DeepSeek dims (P 128, R 64, V 128), two heads: one chunk, one prefill without context.
  const PrefillShape deepseek{2, 128, 64, 128, {33, 9}, {0, 70}, 64};
  for (DType dtype : {DType::f32, DType::bf16}) check_prefill(deepseek, dtype, 12);
  // One prefill, many chunks (context 200 in chunks of 16).
  const PrefillShape many{1, 48, 16, 64, {24}, {200}, 16};
  check_prefill(many, DType::bf16, 13);
}

TEST(CpuMlaPrefill, BadInputNamesTheArgumentAndWritesNothing) {
  const PrefillShape s{2, 32, 16, 32, {4, 6}, {0, 0}, 0};
  const MLAPrefillParams params = prefill_params(s, DType::f32);
  auto cpu = cpu_mla_prefill_backend_class().create(params);
  std::mt19937 rng(3);
  Tensor q = random_tensor(Shape{10, 2, 48}, DType::f32, rng);
  Tensor k = random_tensor(Shape{10, 2, 48}, DType::f32, rng);
  Tensor v = random_tensor(Shape{10, 2, 32}, DType::f32, rng);
  Tensor out = poisoned(Shape{10, 2, 32}, DType::f32), lse = poisoned(Shape{2, 10}, DType::f32);
  auto expect_error = [&](const char* argument, auto&& call) {
    try {
      call();
      ADD_FAILURE() << "no Error for " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
    for (int64_t i = 0; i < out.numel(); ++i) ASSERT_TRUE(std::isnan(out.data_as<float>()[i]));
  };
  expect_error("prefill_metadata", [&] { cpu->run_prefill_new_tokens(q, k, v, true, out, lse); });
  const MLAPrefillMetadata md = make_prefill_metadata(s);
  cpu->prepare_metadata(md);
  Tensor bad_q = random_tensor(Shape{10, 2, 64}, DType::f32, rng);
  expect_error("q", [&] { cpu->run_prefill_new_tokens(bad_q, k, v, true, out, lse); });
  Tensor bf16_k = random_tensor(Shape{10, 2, 48}, DType::bf16, rng);
  expect_error("k", [&] { cpu->run_prefill_new_tokens(q, bf16_k, v, true, out, lse); });
  Tensor short_lse = poisoned(Shape{2, 9}, DType::f32);
  expect_error("lse", [&] { cpu->run_prefill_new_tokens(q, k, v, true, out, short_lse); });
  expect_error("chunk_idx", [&] { cpu->run_prefill_context_chunk(0, q, k, v, out, lse); });
  Tensor scale({1}, DType::f32);
  scale.data_as<float>()[0] = 1.f;
  expect_error("output_scale", [&] { cpu->run_prefill_new_tokens(q, k, v, true, out, lse, scale); });

  MLAPrefillParams bad = params;
  bad.v_head_dim = 40;
  try {
    cpu_mla_prefill_backend_class().create(bad);
    ADD_FAILURE() << "v_head_dim 40 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "v_head_dim");
  }
}

TEST(CpuMlaPrefill, ClassReasons) {
  const MLAPrefillBackendClass& cls = cpu_mla_prefill_backend_class();
  EXPECT_EQ(cls.get_name(), "CPU");
  EXPECT_EQ(cls.device(), Device::cpu);
  MLAPrefillSelectorConfig config;
  config.mla_dimensions = {512, 128, 64, 128};
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    config.dtype = dtype;
    EXPECT_TRUE(cls.validate_configuration(device_capability(Device::cpu), config).empty());
  }
  config.mla_dimensions = {512, 120, 64, 100};  // P+R 184, V 100: not multiples of 16
  const auto reasons = cls.validate_configuration(device_capability(Device::cpu), config);
  ASSERT_EQ(reasons.size(), 2u);
  EXPECT_NE(reasons[0].find("184"), std::string::npos) << reasons[0];
  EXPECT_NE(reasons[1].find("v_head_dim = 100"), std::string::npos) << reasons[1];
}

// ---- decode plan ---------------------------------------------------------------------------

TEST(CpuMlaDecodePlan, SplitsCoverEveryKeyOnce) {
  for (int threads : {1, 2, 8}) {
    for (const std::vector<int32_t>& seq_lens :
         {std::vector<int32_t>{1}, {4096}, {300, 5000, 17}, std::vector<int32_t>(40, 700)}) {
      CpuMlaDecodeWorkspace ws;
      ws.num_threads = threads;
      ws.num_heads = 16;
      ws.max_rows = 16;
      ws.head_size = 576;
      ws.head_size_v = 512;
      ws.partial_capacity_rows = threads > 1 ? 2 * kItemsPerThread * threads * 16 : 0;
      CpuMlaMetadata plan;
      const int n = static_cast<int>(seq_lens.size());
      plan.num_decodes = n;
      plan.decode.seq_lens = seq_lens;
      plan.decode.query_start_loc.resize(n + 1);
      for (int r = 0; r <= n; ++r) plan.decode.query_start_loc[r] = r;
      for (int r = 0; r < n; ++r) plan.decode_first_pos.push_back(seq_lens[r] - 1);
      plan_mla_decode(plan, ws);
      EXPECT_LE(plan.partial_rows_used, ws.partial_capacity_rows);
      if (threads > 1 && n == 1 && seq_lens[0] >= 2 * kMinSplitKeys) EXPECT_FALSE(plan.merges.empty());
      for (int r = 0; r < n; ++r) {
        std::vector<int> covered(seq_lens[r], 0);
        int final_items = 0, split_items = 0;
        for (const WorkItem& item : plan.items) {
          if (item.req_begin != r) continue;
          EXPECT_EQ(item.tok_begin, r);
          EXPECT_EQ(item.tok_end, r + 1);
          EXPECT_LE(item.kv_end, seq_lens[r]);
          for (int j = item.kv_begin; j < item.kv_end; ++j) ++covered[j];
          (item.partial_base < 0 ? final_items : split_items) += 1;
        }
        EXPECT_TRUE(final_items == 1 ? split_items == 0 : split_items >= 2) << "request " << r;
        for (int j = 0; j < seq_lens[r]; ++j) ASSERT_EQ(covered[j], 1) << "request " << r << " key " << j;
      }
    }
  }
}


// ---- decode kernel vs an fp64 loop (the layer path vs REFERENCE_MLA: the MLA harness tests) ----

struct DecodeShape {
  int heads, rank, rope, block_size, threads;
  std::vector<int32_t> seq_lens;
};

void check_latent_decode(const DecodeShape& s, DType activation, DType cache_dtype, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << active_kernels().name << " act " << dtype_name(activation) << " cache "
                                    << dtype_name(cache_dtype) << " H " << s.heads << " L "
                                    << s.rank << " R " << s.rope << " block " << s.block_size
                                    << " threads " << s.threads << " seed " << seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const int n = static_cast<int>(s.seq_lens.size());
  const int latent = s.rank + s.rope, h = s.heads;
  const MLADimensions dims{s.rank, 32, s.rope, 32};
  CpuMlaMetadata plan;
  plan.num_decodes = plan.decode.num_decodes = n;
  plan.num_decode_tokens = plan.decode.num_decode_tokens = n;
  plan.decode.seq_lens = s.seq_lens;
  plan.block_size = s.block_size;
  plan.cpu_workspace = make_mla_decode_workspace(s.threads, h, dims);
  int64_t cols = 0;
  for (int32_t len : s.seq_lens) cols = std::max<int64_t>(cols, (len + s.block_size - 1) / s.block_size);
  plan.decode_block_table_cols = cols;
  // Pages shuffled over a pool with spare blocks.
  const int64_t num_blocks = n * cols + 3;
  std::vector<int32_t> pool(static_cast<size_t>(num_blocks));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  plan.decode_block_table.assign(pool.begin(), pool.begin() + n * cols);
  for (int r = 0; r <= n; ++r) plan.decode.query_start_loc.push_back(r);
  for (int r = 0; r < n; ++r) plan.decode_first_pos.push_back(s.seq_lens[r] - 1);
  plan_mla_decode(plan, *plan.cpu_workspace);

  // Cache: random values stored in the cache dtype (fp8: x / k_scale saturated).
  const float k_scale = is_fp8(cache_dtype) ? 0.37f : 1.f;
  Tensor cache(Shape{num_blocks, s.block_size, latent}, cache_dtype);
  std::vector<double> cache_value(static_cast<size_t>(cache.numel()));  // what a read gives
  std::normal_distribution<float> dist(0.f, 1.f);
  for (int64_t i = 0; i < cache.numel(); ++i) {
    const float x = dist(rng);
    if (cache_dtype == DType::fp8_e4m3) {
      const uint8_t bits = f32_to_fp8_e4m3_bits(x / k_scale);
      static_cast<uint8_t*>(cache.data())[i] = bits;
      cache_value[i] = static_cast<double>(fp8_e4m3_bits_to_f32(bits)) * k_scale;
    } else {
      store_float(cache_dtype, cache.data(), i, x);
      cache_value[i] = to_float(cache_dtype, cache.data(), i);
    }
  }
  Tensor q = random_tensor(Shape{n, h, latent}, activation, rng);
  Tensor out = poisoned(Shape{n, h, s.rank}, activation), lse = poisoned(Shape{h, n}, DType::f32);
  const float scale = 1.f / std::sqrt(192.f);
  run_latent_decode(plan, q, cache, activation, scale, k_scale, out, lse);

  Tensor ref_out(Shape{n, h, s.rank}, DType::f32), ref_lse(Shape{h, n}, DType::f32);
  for (int r = 0; r < n; ++r) {
    const int len = s.seq_lens[r];
    for (int hh = 0; hh < h; ++hh) {
      std::vector<double> logits(len);
      double m = -INFINITY;
      for (int j = 0; j < len; ++j) {
        const int64_t row = (static_cast<int64_t>(plan.decode_block_table[r * cols + j / s.block_size]) *
                                 s.block_size + j % s.block_size) * latent;
        double dot = 0;
        for (int d = 0; d < latent; ++d) dot += to_float(activation, q.data(), (r * h + hh) * latent + d) * cache_value[row + d];
        logits[j] = scale * dot;
        m = std::max(m, logits[j]);
      }
      double sum = 0;
      std::vector<double> acc(s.rank, 0.0);
      for (int j = 0; j < len; ++j) {
        const double p = std::exp(logits[j] - m);
        sum += p;
        const int64_t row = (static_cast<int64_t>(plan.decode_block_table[r * cols + j / s.block_size]) *
                                 s.block_size + j % s.block_size) * latent;
        for (int d = 0; d < s.rank; ++d) acc[d] += p * cache_value[row + d];
      }
      for (int d = 0; d < s.rank; ++d) ref_out.data_as<float>()[(r * h + hh) * s.rank + d] = static_cast<float>(acc[d] / sum);
      ref_lse.data_as<float>()[hh * n + r] = static_cast<float>(m + std::log(sum));
    }
  }
  const double tol = is_fp8(cache_dtype) ? 6e-2 : tolerance(activation);
  EXPECT_LE(relative_error(out, ref_out), tol);
  EXPECT_LE(lse_max_diff(lse, ref_lse), activation == DType::f32 && !is_fp8(cache_dtype) ? 1e-4 : 2e-2);
  if (s.threads > 1 && n == 1 && s.seq_lens[0] >= 2 * kMinSplitKeys) EXPECT_FALSE(plan.merges.empty());
}

TEST_P(CpuMlaPath, LatentDecodeMatchesFp64) {
  // DeepSeek latent (L 512, R 64), 16 heads: a batch (no split) and one long request (split-KV).
  const DecodeShape batch{16, 512, 64, 64, 2, {1, 77, 300, 64}};
  const DecodeShape split{16, 512, 64, 16, 4, {1500}};
  for (DType act : {DType::f32, DType::bf16}) {
    check_latent_decode(batch, act, act, 21);
    check_latent_decode(split, act, act, 22);
  }
  check_latent_decode(batch, DType::f16, DType::f16, 23);
  check_latent_decode(split, DType::bf16, DType::fp8_e4m3, 24);
  check_latent_decode(batch, DType::f16, DType::fp8_e4m3, 25);
  // Small dims (L 64, R 32), 3 heads, block 32, one thread.
  const DecodeShape small{3, 64, 32, 32, 1, {5, 129, 40}};
  for (DType act : {DType::f32, DType::f16, DType::bf16}) check_latent_decode(small, act, act, 26);
}


// ---- the layer vs REFERENCE_MLA (MLA conformance harness) --------------------------------------

namespace mla_conf = conformance::mla;

SelectorConfig selector_config(const mla_conf::MLACase& c) {
  SelectorConfig config;
  config.use_mla = true;
  config.mla_dimensions = c.dims;
  config.head_size = c.dims.latent_head_size();
  config.num_heads = c.num_heads;
  config.dtype = c.dtype;
  config.kv_cache_dtype = c.kv_cache_dtype;
  config.block_size = c.block_size;
  config.device = Device::cpu;
  config.fp8_output = c.fp8_output();  // the grid's fp8-output cases: CPU_MLA rejects them
  return config;
}

// Cases aimed at the CPU decode plan, 16 heads: one long decode (split-KV + merge) and decodes
// with an fp8 cache next to a chunked prefill (3 context chunks). DeepSeek dims or small ones
// (REFERENCE_MLA up-projects every key for every head: DeepSeek dims cost it ~2M MACs a key).
std::vector<mla_conf::MLACase> cpu_cases(bool deepseek) {
  mla_conf::MLACase split;
  split.name = deepseek ? "cpu-deepseek-split-kv" : "cpu-small-split-kv";
  split.dtype = DType::bf16;
  split.dims = deepseek ? MLADimensions{512, 128, 64, 128} : MLADimensions{64, 32, 16, 32};
  split.num_heads = 16;
  split.block_size = 64;
  split.batch = {{540, 1}};
  mla_conf::MLACase fp8 = split;
  fp8.name = deepseek ? "cpu-deepseek-fp8-mixed" : "cpu-small-fp8-mixed";
  fp8.kv_cache_dtype = "fp8";
  fp8.block_size = 16;
  fp8.workspace_tokens = 48;
  fp8.batch = {{260, 1}, {17, 1}, {100, 5}};
  return {split, fp8};
}

// Runs every case CPU_MLA accepts (cases it rejects — block size 1, dims that are not multiples
// of 16: full grid only — are skipped by its reasons), forcing the CPU prefill backend wherever
// its dims allow; returns how many ran.
int run_cases(const std::vector<mla_conf::MLACase>& cases, uint64_t seed) {
  int run = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const mla_conf::MLACase& c = cases[i];
    if (!cpu_mla_backend().validate_configuration(selector_config(c)).empty()) continue;
    MLAPrefillSelectorConfig prefill_config;
    prefill_config.dtype = c.dtype;
    prefill_config.mla_dimensions = c.dims;
    const bool cpu_prefill = cpu_mla_prefill_backend_class()
                                 .validate_configuration(device_capability(Device::cpu), prefill_config)
                                 .empty();
    const mla_conf::MLAResult result =
        mla_conf::run_mla_case(cpu_mla_backend(), cpu_prefill ? "CPU" : "", Device::cpu, c, seed + i);
    EXPECT_TRUE(result.passed()) << active_kernels().name << ": " << result.describe();
    if (cpu_prefill) EXPECT_EQ(result.prefill_backend_name, "CPU");
    ++run;
  }
  return run;
}

// The harness grid (decode only; new tokens only; new tokens + 1, 2, 7 chunks; mixed; fp8;
// DeepSeek dims with 16 heads; the full grid with PAGEDATTN_FULL_GRID=1) and the CPU cases on
// the path dispatch picks.
TEST(CpuMla, LayerMatchesReferenceMlaOnTheGrid) {
  std::vector<mla_conf::MLACase> grid = mla_conf::mla_grid();
  for (const auto& c : cpu_cases(true)) grid.push_back(c);
  const int run = run_cases(grid, 100);
  std::printf("CPU_MLA vs REFERENCE_MLA: %d of %zu cases run (the rest rejected by CPU_MLA)\n", run,
              grid.size());
  EXPECT_GE(run, 16);
}

// The CPU cases (small dims) on every kernel path.
TEST_P(CpuMlaPath, LayerMatchesReferenceMla) { EXPECT_EQ(run_cases(cpu_cases(false), 200), 2); }

// ---- backend --------------------------------------------------------------------------------

SelectorConfig deepseek_config() {
  SelectorConfig c;
  c.use_mla = true;
  c.mla_dimensions = {512, 128, 64, 128};
  c.head_size = 576;
  c.num_heads = 16;
  c.dtype = DType::bf16;
  c.block_size = 64;
  c.device = Device::cpu;
  return c;
}

TEST(CpuMlaBackend, SelectorReasons) {
  const AttentionBackend& b = cpu_mla_backend();
  EXPECT_EQ(b.name(), "CPU_MLA");
  ASSERT_NE(b.as_mla(), nullptr);
  for (const char* cache : {"auto", "fp8", "fp8_e4m3", "bfloat16"}) {
    SelectorConfig c = deepseek_config();
    c.kv_cache_dtype = cache;
    EXPECT_TRUE(b.validate_configuration(c).empty()) << cache;
  }
  for (int block : {16, 32, 128}) {
    SelectorConfig c = deepseek_config();
    c.block_size = block;
    EXPECT_TRUE(b.validate_configuration(c).empty()) << block;
  }
  auto single_reason = [&](SelectorConfig c, const char* needle) {
    const auto reasons = b.validate_configuration(c);
    ASSERT_EQ(reasons.size(), 1u) << needle;
    EXPECT_NE(reasons[0].find(needle), std::string::npos) << reasons[0];
    EXPECT_EQ(reasons[0].back(), '.') << reasons[0];
  };
  SelectorConfig c = deepseek_config();
  c.block_size = 24;
  single_reason(c, "block_size = 24");
  c = deepseek_config();
  c.use_mla = false;
  single_reason(c, "use_mla = false");
  c = deepseek_config();
  c.device = Device::cuda;
  single_reason(c, "device = cuda");
  c = deepseek_config();
  c.mla_dimensions = {504, 128, 72, 128};  // latent 576 but kv_lora_rank 504 is not a multiple of 16
  single_reason(c, "kv_lora_rank = 504");
  c = deepseek_config();
  c.mla_dimensions = {512, 128, 136, 128};
  c.head_size = 648;  // > 576
  single_reason(c, "head_size = 648");
  // The standard CPU backend points MLA users here.
  const auto cpu_reasons = find_backend("CPU")->validate_configuration(deepseek_config());
  bool mentions = false;
  for (const auto& r : cpu_reasons) mentions |= r.find("CPU_MLA") != std::string::npos;
  EXPECT_TRUE(mentions);
  // The selector picks it for an MLA layer on the cpu.
  EXPECT_EQ(get_attn_backend(576, DType::bf16, "auto", 64, true, false, false,
                             AttentionType::decoder, Device::cpu).name(), "CPU_MLA");
}

TEST(CpuMlaBackend, BuilderAndImplChecks) {
  const AttentionBackend& b = cpu_mla_backend();
  BuilderConfig config;
  config.num_heads = 16;
  config.mla_dimensions = {512, 128, 64, 128};
  config.max_num_seqs = 8;
  config.max_num_batched_tokens = 256;
  config.max_model_len = 1024;
  const KVCacheSpec spec = KVCacheSpec::mla(64, 576, DType::bf16);
  auto builder = b.make_builder(spec, config, Device::cpu);
  EXPECT_GT(builder->workspace_bytes(), 0u);
  EXPECT_EQ(builder->reorder_batch_threshold(), 1);
  try {
    b.make_builder(KVCacheSpec::mla(24, 576, DType::bf16), config, Device::cpu);
    ADD_FAILURE() << "block size 24 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "spec.block_size");
  }
  MLAImplParams p;
  p.num_heads = 16;
  p.scale = 0.1f;
  p.dims = {512, 128, 64, 128};
  p.dtype = DType::bf16;
  p.block_size = 64;
  EXPECT_NO_THROW(b.as_mla()->make_mla_impl(p));
  p.dims = {500, 128, 64, 128};
  try {
    b.as_mla()->make_mla_impl(p);
    ADD_FAILURE() << "kv_lora_rank 500 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "dims");
  }
}


// A decode whose block table points past the cache: an Error naming the metadata, raised before
// the output is written (the layer path: plan, cache write, forward).
TEST(CpuMlaBackend, DecodeBlockOutOfRangeIsAnErrorAndWritesNothing) {
  MLAAttentionLayerParams p = conformance::mla::small_mla_layer_params("CPU_MLA");
  p.prefix = "layers.0.attn";
  MLAAttention layer(p);
  ASSERT_EQ(layer.backend().name(), "CPU_MLA");
  std::mt19937 rng(5);
  Tensor weight = random_tensor(Shape{4 * (32 + 32), 64}, DType::f32, rng);
  layer.process_weights_after_loading(weight);
  Tensor cache = layer.allocate_kv_cache(4);
  // One decode at position 19: block 0 of its row is 7 (the cache has 4), its slot is valid.
  auto common = make_common_attention_metadata({.query_start_loc = {0, 1}, .seq_lens = {20},
                                                 .block_table = {7, 1}, .max_num_blocks_per_req = 2,
                                                 .slot_mapping = {16 + 3}});
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(4, 64, 256),
                                              Device::cpu);
  auto metadata = builder->build(0, common.common);
  Tensor q = random_tensor(Shape{1, 4, 48}, DType::f32, rng);
  Tensor kv_c = random_tensor(Shape{1, 64}, DType::f32, rng), k_pe = random_tensor(Shape{1, 16}, DType::f32, rng);
  Tensor out = poisoned(Shape{1, 4, 32}, DType::f32);
  try {
    layer.forward(q, kv_c, k_pe, cache, *metadata, out);
    ADD_FAILURE() << "block 7 of a 4-block cache accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "metadata") << e.what();
    EXPECT_NE(std::string(e.what()).find("block_table[0][0] = 7"), std::string::npos) << e.what();
  }
  for (int64_t i = 0; i < out.numel(); ++i) ASSERT_TRUE(std::isnan(out.data_as<float>()[i]));
}

}  // namespace
}  // namespace pagedattn::cpu
