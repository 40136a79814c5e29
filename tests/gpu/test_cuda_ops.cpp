// The CUDA standalone ops against their host implementations (the same public entry points on
// cpu tensors): reshape_and_cache_flash must be bit-exact (every conversion is specified
// exactly), merge_attn_states within a few ulps (f32 math, expf on both sides). The merges'
// NaN rows (a NaN LSE: a NaN logit on that side) as the host's, with the DCP N-way merge kernel
// (dcp_detail::cuda_merge_states, which needs no second GPU) against merge_attn_states_n.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dcp/dcp_device.h"
#include "gpu_test_util.h"
#include "pagedattn/dcp.h"

namespace pagedattn {
namespace {

using gpu_test::random_host;

struct CacheWriteCase {
  DType input = DType::bf16;
  std::string kv_cache_dtype = "auto";
  int head_size = 128;
  int head_size_v = 128;
  int num_kv_heads = 4;
  int block_size = 16;
  KVCacheLayout layout = KVCacheLayout::NHD;
  bool per_head_scales = false;
  bool strided_input = false;  // rows not 16-byte aligned: the element-wise path
};

std::string describe(const CacheWriteCase& c) {
  return detail::concat(dtype_name(c.input), " kv=", c.kv_cache_dtype, " D=", c.head_size, " Dv=", c.head_size_v,
                        " Hkv=", c.num_kv_heads, " bs=", c.block_size, " ", kv_cache_layout_name(c.layout),
                        c.per_head_scales ? " per-head" : "", c.strided_input ? " strided" : "");
}

// key / value (N, Hkv, D) views; strided: narrowed out of a (N, Hkv, D + 1) tensor.
struct Rows {
  Tensor storage;
  TensorView view;
};
Rows make_rows(int64_t n, int hkv, int d, DType dtype, bool strided, uint64_t seed) {
  Rows r;
  r.storage = random_host(Shape{n, hkv, d + (strided ? 1 : 0)}, dtype, seed, -3.f, 3.f);
  r.view = r.storage.view().narrow(2, 0, d);
  return r;
}

void run_cache_write_case(const CacheWriteCase& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  constexpr int64_t kTokens = 37;
  constexpr int64_t kBlocks = 9;
  const DType storage = kv_cache_storage_dtype(c.kv_cache_dtype, c.input);
  const int cache_head = std::max(c.head_size, c.head_size_v);
  const Rows key = make_rows(kTokens, c.num_kv_heads, c.head_size, c.input, c.strided_input, seed);
  const Rows value = make_rows(kTokens, c.num_kv_heads, c.head_size_v, c.input, c.strided_input, seed + 1);

  // Slots: distinct, some -1; the device run also gets out-of-range slots (skipped there, -1
  // for the host oracle, which rejects them).
  std::vector<int64_t> slots(kBlocks * c.block_size);
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int64_t>(i);
  std::mt19937_64 rng(seed + 2);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(kTokens);
  std::vector<int64_t> device_slots = slots;
  for (int64_t t = 0; t < kTokens; t += 5) slots[t] = device_slots[t] = -1;
  device_slots[3] = kBlocks * c.block_size;       // one past the end
  device_slots[11] = kBlocks * c.block_size + 77;  // far out
  device_slots[12] = -5;
  slots[3] = slots[11] = slots[12] = -1;
  Tensor host_slots(Shape{kTokens}, DType::i64, Device::cpu);
  std::memcpy(host_slots.data(), slots.data(), sizeof(int64_t) * kTokens);
  Tensor dev_slots_host(Shape{kTokens}, DType::i64, Device::cpu);
  std::memcpy(dev_slots_host.data(), device_slots.data(), sizeof(int64_t) * kTokens);

  const Shape cache_shape{2, kBlocks, c.block_size, c.num_kv_heads, cache_head};
  Tensor host_cache = allocate_paged_cache(cache_shape, standard_kv_cache_stride_order(c.layout), storage);
  {  // stale bytes everywhere (any pattern: compared bytewise)
    std::mt19937_64 fill(seed + 3);
    auto* bytes = static_cast<uint8_t*>(host_cache.data());
    for (size_t i = 0; i < host_cache.nbytes(); ++i) bytes[i] = static_cast<uint8_t>(fill());
  }
  Tensor dev_cache = host_cache.to(Device::cuda);

  LayerScales host_scales;
  host_scales.k_scale = 0.37f;
  host_scales.v_scale = 1.9f;
  Tensor k_per_head, v_per_head, k_per_head_dev, v_per_head_dev;
  if (c.per_head_scales) {
    k_per_head = random_host(Shape{c.num_kv_heads}, DType::f32, seed + 4, 0.05f, 2.f);
    v_per_head = random_host(Shape{c.num_kv_heads}, DType::f32, seed + 5, 0.05f, 2.f);
    k_per_head_dev = k_per_head.to(Device::cuda);
    v_per_head_dev = v_per_head.to(Device::cuda);
    host_scales.k_scale_per_head = k_per_head;
    host_scales.v_scale_per_head = v_per_head;
  }
  LayerScales dev_scales = host_scales;
  if (c.per_head_scales) {
    dev_scales.k_scale_per_head = k_per_head_dev;
    dev_scales.v_scale_per_head = v_per_head_dev;
  }

  const KVCacheViews host_views = split_kv_cache(host_cache, c.head_size, c.head_size_v);
  reshape_and_cache_flash(key.view, value.view, host_views.key_cache, host_views.value_cache, host_slots,
                          c.kv_cache_dtype, host_scales);

  // Device inputs keep the host strides (copied densely, then viewed the same way).
  const Tensor key_dev_storage = key.storage.to(Device::cuda);
  const Tensor value_dev_storage = value.storage.to(Device::cuda);
  const TensorView key_dev = key_dev_storage.view().narrow(2, 0, c.head_size);
  const TensorView value_dev = value_dev_storage.view().narrow(2, 0, c.head_size_v);
  const Tensor dev_slots = dev_slots_host.to(Device::cuda);
  const KVCacheViews dev_views = split_kv_cache(dev_cache, c.head_size, c.head_size_v);
  reshape_and_cache_flash(key_dev, value_dev, dev_views.key_cache, dev_views.value_cache, dev_slots,
                          c.kv_cache_dtype, dev_scales);
  synchronize_cuda();

  const Tensor back = dev_cache.to(Device::cpu);
  ASSERT_EQ(back.nbytes(), host_cache.nbytes());
  const auto* a = static_cast<const uint8_t*>(back.data());
  const auto* b = static_cast<const uint8_t*>(host_cache.data());
  int64_t mismatches = 0;
  for (size_t i = 0; i < back.nbytes(); ++i) mismatches += a[i] != b[i];
  EXPECT_EQ(mismatches, 0) << "bytes of the cache differ from the host op's result";
}

TEST(CudaOps, ReshapeAndCacheMatchesHostBitExactly) {
  PAGEDATTN_REQUIRE_GPU();
  uint64_t seed = 100;
  const DType inputs[] = {DType::f32, DType::f16, DType::bf16};
  const char* caches[] = {"auto", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32"};
  for (DType input : inputs) {
    for (const char* cache : caches) {
      for (int variant = 0; variant < 2; ++variant) {
        CacheWriteCase c;
        c.input = input;
        c.kv_cache_dtype = cache;
        c.layout = variant == 0 ? KVCacheLayout::NHD : KVCacheLayout::HND;
        c.head_size = variant == 0 ? 128 : 80;
        c.head_size_v = variant == 0 ? 128 : 64;
        c.block_size = variant == 0 ? 16 : 32;
        c.num_kv_heads = variant == 0 ? 4 : 2;
        c.per_head_scales = variant == 1 && std::string(cache).starts_with("fp8");
        run_cache_write_case(c, seed++);
      }
    }
  }
}

TEST(CudaOps, ReshapeAndCacheElementwisePathMatchesHost) {
  PAGEDATTN_REQUIRE_GPU();
  uint64_t seed = 500;
  for (const char* cache : {"auto", "fp8_e4m3", "fp8_e5m2"}) {
    CacheWriteCase c;
    c.kv_cache_dtype = cache;
    c.strided_input = true;
    c.head_size = 96;
    c.head_size_v = 96;
    c.layout = KVCacheLayout::HND;
    run_cache_write_case(c, seed++);
  }
}

TEST(CudaOps, ReshapeAndCacheSaturatesAndKeepsNaN) {
  PAGEDATTN_REQUIRE_GPU();
  // Values far beyond the fp8 range, infinities and NaN: the device must round and saturate
  // exactly as the host conversions do.
  const float specials[] = {1e6f, -1e6f, 448.f, 449.f, 464.f, 57344.f, 61440.f, 1e-9f,
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(), 0.f, -0.f, 2.5e-3f, 3.1f, -7.77f};
  for (const char* cache : {"fp8_e4m3", "fp8_e5m2"}) {
    SCOPED_TRACE(cache);
    Tensor key(Shape{1, 1, 16}, DType::f32, Device::cpu);
    for (int i = 0; i < 16; ++i) key.data_as<float>()[i] = specials[i];
    Tensor slots(Shape{1}, DType::i64, Device::cpu);
    slots.data_as<int64_t>()[0] = 5;
    const DType storage = kv_cache_storage_dtype(cache, DType::f32);
    Tensor host_k = Tensor::zeros(Shape{2, 16, 1, 16}, storage);
    Tensor host_v = Tensor::zeros(Shape{2, 16, 1, 16}, storage);
    LayerScales scales;
    scales.k_scale = 0.5f;
    scales.v_scale = 2.f;
    reshape_and_cache_flash(key, key, host_k, host_v, slots, cache, scales);
    Tensor dev_k = Tensor::zeros(Shape{2, 16, 1, 16}, storage, Device::cuda);
    Tensor dev_v = Tensor::zeros(Shape{2, 16, 1, 16}, storage, Device::cuda);
    const Tensor key_dev = key.to(Device::cuda);
    const Tensor slots_dev = slots.to(Device::cuda);
    reshape_and_cache_flash(key_dev, key_dev, dev_k, dev_v, slots_dev, cache, scales);
    synchronize_cuda();
    const Tensor back_k = dev_k.to(Device::cpu), back_v = dev_v.to(Device::cpu);
    EXPECT_EQ(std::memcmp(back_k.data(), host_k.data(), host_k.nbytes()), 0);
    EXPECT_EQ(std::memcmp(back_v.data(), host_v.data(), host_v.nbytes()), 0);
  }
}

TEST(CudaOps, MergeAttnStatesMatchesHost) {
  PAGEDATTN_REQUIRE_GPU();
  constexpr int64_t T = 53, H = 6, D = 96;
  const float inf = std::numeric_limits<float>::infinity();
  uint64_t seed = 900;
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    for (int64_t ptwc : {int64_t{-1}, int64_t{30}}) {
      SCOPED_TRACE(detail::concat(dtype_name(dtype), " prefill_tokens_with_context=", ptwc));
      const Tensor prefix = random_host(Shape{T, H, D}, dtype, seed++);
      const Tensor suffix = random_host(Shape{T, H, D}, dtype, seed++);
      Tensor lp = random_host(Shape{H, T}, DType::f32, seed++, -6.f, 6.f);
      Tensor ls = random_host(Shape{H, T}, DType::f32, seed++, -6.f, 6.f);
      // Empty partial results: -inf, +inf (read as -inf), both.
      for (int64_t t = 0; t < T; t += 4) lp.data_as<float>()[(t % H) * T + t] = -inf;
      for (int64_t t = 1; t < T; t += 5) ls.data_as<float>()[(t % H) * T + t] = inf;
      for (int64_t t = 2; t < T; t += 7) {
        lp.data_as<float>()[(t % H) * T + t] = -inf;
        ls.data_as<float>()[(t % H) * T + t] = -inf;
      }
      Tensor host_out(Shape{T, H, D}, dtype, Device::cpu);
      Tensor host_lse(Shape{H, T}, DType::f32, Device::cpu);
      merge_attn_states(host_out, prefix, lp, suffix, ls, host_lse, ptwc);

      const Tensor prefix_dev = prefix.to(Device::cuda), suffix_dev = suffix.to(Device::cuda);
      const Tensor lp_dev = lp.to(Device::cuda), ls_dev = ls.to(Device::cuda);
      Tensor out_dev(Shape{T, H, D}, dtype, Device::cuda);
      Tensor lse_dev(Shape{H, T}, DType::f32, Device::cuda);
      out_dev.fill_bytes(0xFF);
      lse_dev.fill_bytes(0xFF);
      merge_attn_states(out_dev, prefix_dev, lp_dev, suffix_dev, ls_dev, lse_dev, ptwc);
      synchronize_cuda();
      const Tensor out = out_dev.to(Device::cpu), lse = lse_dev.to(Device::cpu);
      const double tol = dtype == DType::f32 ? 1e-6 : dtype == DType::f16 ? 1e-3 : 8e-3;
      EXPECT_LE(gpu_test::rel_error(out, host_out), tol);
      for (int64_t i = 0; i < H * T; ++i) {
        const float a = lse.data_as<float>()[i], b = host_lse.data_as<float>()[i];
        if (std::isinf(b)) {
          EXPECT_EQ(a, b) << "lse " << i;
        } else {
          EXPECT_NEAR(a, b, 1e-5 * (1 + std::fabs(b))) << "lse " << i;
        }
      }
    }
  }
}

// Elements equal as NaN patterns (NaN where the host has NaN, nowhere else) and within tol (relative
// to 1 + |expected|) elsewhere; infinities exactly.
void expect_same_with_nan(const Tensor& got, const Tensor& want, double tol, const char* what) {
  ASSERT_EQ(got.numel(), want.numel());
  int bad = 0;
  for (int64_t i = 0; i < got.numel() && bad < 8; ++i) {
    const float a = load_f32(got.data(), got.dtype(), i), b = load_f32(want.data(), want.dtype(), i);
    const bool ok = std::isnan(b) ? std::isnan(a)
                    : std::isinf(b) ? a == b
                                    : !std::isnan(a) && std::fabs(a - b) <= tol * (1 + std::fabs(b));
    if (!ok) {
      ++bad;
      ADD_FAILURE() << what << " element " << i << ": " << a << ", host " << b;
    }
  }
}

TEST(CudaOps, MergesKeepNanRowsAsTheHost) {
  PAGEDATTN_REQUIRE_GPU();
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  // LSE patterns of one row across the merged sides (two-way: the first two; N-way: all three).
  const std::vector<std::vector<float>> patterns = {
      {nan, -inf, -inf}, {-inf, nan, -inf}, {-inf, -inf, nan}, {nan, 1.f, 2.f},   {1.f, nan, -inf},
      {inf, nan, 0.5f},  {nan, inf, inf},   {-nan, 0.f, 0.f},  {nan, nan, nan},   {1.f, -inf, 2.f},
      {-inf, -inf, -inf}, {inf, -inf, 0.5f}, {inf, inf, inf},   {0.25f, 3.f, -1.f},
  };
  const int64_t H = 3, D = 40, P = static_cast<int64_t>(patterns.size()), T = 2 * P;
  uint64_t seed = 950;
  for (DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const double tol = dtype == DType::f32 ? 1e-5 : 8e-3;
    // Random LSEs, then pattern p on (head p % H, tokens p and P + p).
    Tensor lses = random_host(Shape{3, H, T}, DType::f32, seed++, -4.f, 4.f);
    for (int64_t p = 0; p < P; ++p) {
      for (int r = 0; r < 3; ++r) {
        lses.data_as<float>()[(r * H + p % H) * T + p] = patterns[p][r];
        lses.data_as<float>()[(r * H + (p + 1) % H) * T + P + p] = patterns[p][r];
      }
    }
    const Tensor outs = random_host(Shape{3, T, H, D}, dtype, seed++);
    const Tensor outs_dev = outs.to(Device::cuda), lses_dev = lses.to(Device::cuda);

    // Two-way: prefix = side 0, suffix = side 1.
    {
      Tensor host_out(Shape{T, H, D}, dtype, Device::cpu), host_lse(Shape{H, T}, DType::f32, Device::cpu);
      merge_attn_states(host_out, outs.view().select(0, 0), lses.view().select(0, 0), outs.view().select(0, 1),
                        lses.view().select(0, 1), host_lse, -1);
      Tensor out_dev(Shape{T, H, D}, dtype, Device::cuda), lse_dev(Shape{H, T}, DType::f32, Device::cuda);
      out_dev.fill_bytes(0x5A);
      lse_dev.fill_bytes(0x5A);
      merge_attn_states(out_dev, outs_dev.view().select(0, 0), lses_dev.view().select(0, 0),
                        outs_dev.view().select(0, 1), lses_dev.view().select(0, 1), lse_dev, -1);
      synchronize_cuda();
      expect_same_with_nan(out_dev.to(Device::cpu), host_out, tol, "two-way out");
      expect_same_with_nan(lse_dev.to(Device::cpu), host_lse, 1e-5, "two-way lse");
    }
    // N-way (N = 3): the DCP merge kernel against merge_attn_states_n.
    {
      std::vector<TensorView> ov, lv;
      for (int r = 0; r < 3; ++r) {
        ov.push_back(outs.view().select(0, r));
        lv.push_back(lses.view().select(0, r));
      }
      Tensor host_out(Shape{T, H, D}, dtype, Device::cpu), host_lse(Shape{H, T}, DType::f32, Device::cpu);
      merge_attn_states_n(ov, lv, host_out, host_lse);
      Tensor out_dev(Shape{T, H, D}, dtype, Device::cuda), lse_dev(Shape{H, T}, DType::f32, Device::cuda);
      out_dev.fill_bytes(0x5A);
      lse_dev.fill_bytes(0x5A);
      dcp_detail::cuda_merge_states(outs_dev, lses_dev, out_dev, lse_dev);
      synchronize_cuda();
      expect_same_with_nan(out_dev.to(Device::cpu), host_out, tol, "N-way out");
      expect_same_with_nan(lse_dev.to(Device::cpu), host_lse, 1e-5, "N-way lse");
      // The host merge itself: NaN rows exactly where a side's LSE is NaN.
      for (int64_t p = 0; p < P; ++p) {
        bool any_nan = false;
        for (float l : patterns[p]) any_nan = any_nan || std::isnan(l);
        EXPECT_EQ(std::isnan(host_lse.data_as<float>()[(p % H) * T + p]), any_nan) << "pattern " << p;
      }
    }
  }
}

}  // namespace
}  // namespace pagedattn
