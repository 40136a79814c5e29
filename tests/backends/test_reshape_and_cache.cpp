// reshape_and_cache / reshape_and_cache_flash on the host: written values equal the core
// conversion of x / scale (fp8) or x (other caches), every other byte keeps its poison, slot -1
// and padding tokens are skipped, and every bad argument throws an Error naming it with the cache
// bytes unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "backends/ops_test_util.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/ops.h"

namespace pagedattn {
namespace {

using testing_ops::bytes_equal;
using testing_ops::expect_error;
using testing_ops::fill_uniform;
using testing_ops::random_tensor;
using testing_ops::snapshot;

constexpr int kNumKVHeads = 3;
constexpr int kNumBlocks = 5;
constexpr int kBlockSize = 4;

struct CacheCase {
  DType act;
  const char* kv_cache_dtype;
  KVCacheLayout layout;
  int head_size;
  int head_size_v;
  float k_scale;
  float v_scale;
};

std::string case_name(const CacheCase& c) {
  std::string s = std::string(dtype_name(c.act)) + "_" + c.kv_cache_dtype + "_" +
                  std::string(kv_cache_layout_name(c.layout)) + "_D" +
                  std::to_string(c.head_size) + "_Dv" + std::to_string(c.head_size_v);
  return s;
}

// Largest finite magnitude of a cache dtype (fp8 saturation bound).
float finite_max(DType dt) {
  switch (dt) {
    case DType::fp8_e4m3: return 448.f;
    case DType::fp8_e5m2: return 57344.f;
    default: return std::numeric_limits<float>::max();
  }
}

// Relative rounding bound of one conversion to `dt` (half an ulp, with margin).
float rounding_bound(DType dt) {
  switch (dt) {
    case DType::f32: return 1e-7f;
    case DType::f16: return 1.f / 2048;
    case DType::bf16: return 1.f / 256;
    case DType::fp8_e4m3: return 1.f / 16;
    case DType::fp8_e5m2: return 1.f / 8;
    default: return 0.f;
  }
}

// slot_mapping for `num_tokens` tokens: distinct random slots, a few -1.
Tensor make_slots(int num_tokens, std::mt19937& rng, int num_slots = kNumBlocks * kBlockSize) {
  std::vector<int64_t> all(static_cast<size_t>(num_slots));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  Tensor slots(Shape{num_tokens}, DType::i64);
  for (int t = 0; t < num_tokens; ++t) slots.data_as<int64_t>()[t] = all[static_cast<size_t>(t)];
  if (num_tokens > 2) slots.data_as<int64_t>()[1] = -1;
  if (num_tokens > 5) slots.data_as<int64_t>()[4] = -1;
  return slots;
}

// Expected cache: `poisoned` plus, for every live slot, convert(src / scale) written at the slot.
void apply_expected(const TensorView& src, const TensorView& cache_half, const Tensor& slots,
                    DType cache_dtype, float scale, const std::vector<float>& per_head) {
  const bool quantize = is_fp8(cache_dtype);
  const int64_t block_size = cache_half.size(1);
  for (int64_t t = 0; t < slots.numel(); ++t) {
    const int64_t slot = slots.data_as<int64_t>()[t];
    if (slot < 0) continue;
    const int64_t block = slot / block_size, offset = slot % block_size;
    for (int64_t h = 0; h < src.size(1); ++h) {
      const float s = per_head.empty() ? scale : per_head[static_cast<size_t>(h)];
      for (int64_t i = 0; i < src.size(2); ++i) {
        float x = load_f32(src.data(), src.dtype(), t * src.stride(0) + h * src.stride(1) + i);
        if (quantize) x = x / s;
        store_f32(cache_half.data(), cache_dtype,
                  block * cache_half.stride(0) + offset * cache_half.stride(1) +
                      h * cache_half.stride(2) + i * cache_half.stride(3),
                  x);
      }
    }
  }
}

// Independent check of the written values: decoding them gives x / scale within one rounding
// of the cache dtype, saturated at its finite max.
void check_decoded(const TensorView& src, const TensorView& cache_half, const Tensor& slots,
                   DType cache_dtype, float scale, int* saturated) {
  const bool quantize = is_fp8(cache_dtype);
  const float max = finite_max(cache_dtype);
  for (int64_t t = 0; t < slots.numel(); ++t) {
    const int64_t slot = slots.data_as<int64_t>()[t];
    if (slot < 0) continue;
    const int64_t block = slot / kBlockSize, offset = slot % kBlockSize;
    for (int64_t h = 0; h < src.size(1); ++h) {
      for (int64_t i = 0; i < src.size(2); ++i) {
        const double x =
            load_f64(src.data(), src.dtype(), t * src.stride(0) + h * src.stride(1) + i);
        const double want = quantize ? x / scale : x;
        const double got = load_f64(cache_half.data(), cache_dtype,
                                    block * cache_half.stride(0) + offset * cache_half.stride(1) +
                                        h * cache_half.stride(2) + i * cache_half.stride(3));
        if (std::fabs(want) > max) {
          ++*saturated;
          ASSERT_EQ(got, std::copysign(static_cast<double>(max), want)) << "t=" << t;
        } else {
          // fp8 subnormals: absolute bound of one subnormal step.
          const double abs_floor = cache_dtype == DType::fp8_e4m3   ? 1.0 / 512
                                   : cache_dtype == DType::fp8_e5m2 ? 1.0 / 65536
                                                                    : 0.0;
          ASSERT_LE(std::fabs(got - want), rounding_bound(cache_dtype) * std::fabs(want) + abs_floor)
              << "t=" << t << " h=" << h << " i=" << i;
        }
      }
    }
  }
}

void PrintTo(const CacheCase& c, std::ostream* os) { *os << case_name(c); }

class ReshapeAndCacheTest : public ::testing::TestWithParam<CacheCase> {};

TEST_P(ReshapeAndCacheTest, WritesConvertedValuesAndKeepsPoison) {
  const CacheCase c = GetParam();
  std::mt19937 rng(1234 + c.head_size * 7 + static_cast<int>(c.act) * 31 + c.head_size_v);
  const DType cache_dtype = kv_cache_storage_dtype(c.kv_cache_dtype, c.act);
  const int num_tokens = 9, num_slots = 7;  // tokens 7 and 8 are padding (no slot)
  Tensor key = random_tensor(Shape{num_tokens, kNumKVHeads, c.head_size}, c.act, rng);
  Tensor value = random_tensor(Shape{num_tokens, kNumKVHeads, c.head_size_v}, c.act, rng);
  Tensor slots = make_slots(num_slots, rng);
  const int head_dim = std::max(c.head_size, c.head_size_v);
  const std::vector<int> order = standard_kv_cache_stride_order(c.layout);
  const Shape cache_shape{2, kNumBlocks, kBlockSize, kNumKVHeads, head_dim};
  Tensor cache = allocate_paged_cache(cache_shape, order, cache_dtype);
  cache.fill_bytes(0xA7);
  Tensor expected = allocate_paged_cache(cache_shape, order, cache_dtype);
  expected.fill_bytes(0xA7);
  const KVCacheViews want = split_kv_cache(expected.view(), c.head_size, c.head_size_v);
  apply_expected(key.view(), want.key_cache, slots, cache_dtype, c.k_scale, {});
  apply_expected(value.view(), want.value_cache, slots, cache_dtype, c.v_scale, {});

  reshape_and_cache(key, value, cache, slots, c.kv_cache_dtype, c.k_scale, c.v_scale);

  ASSERT_EQ(cache.nbytes(), expected.nbytes());
  EXPECT_EQ(std::memcmp(cache.data(), expected.data(), cache.nbytes()), 0)
      << "cache bytes differ from convert(x / scale) at the live slots + poison elsewhere";
  const KVCacheViews got = split_kv_cache(cache.view(), c.head_size, c.head_size_v);
  int saturated = 0;
  check_decoded(key.view(), got.key_cache, slots, cache_dtype, c.k_scale, &saturated);
  check_decoded(value.view(), got.value_cache, slots, cache_dtype, c.v_scale, &saturated);
  if (is_fp8(cache_dtype) && c.k_scale < 0.01f) EXPECT_GT(saturated, 0) << "saturation not exercised";
}

INSTANTIATE_TEST_SUITE_P(
    Grid, ReshapeAndCacheTest,
    ::testing::Values(
        CacheCase{DType::f32, "auto", KVCacheLayout::NHD, 8, 8, 1.f, 1.f},
        CacheCase{DType::f32, "auto", KVCacheLayout::HND, 16, 8, 1.f, 1.f},
        CacheCase{DType::f16, "auto", KVCacheLayout::NHD, 8, 8, 1.f, 1.f},
        CacheCase{DType::f16, "auto", KVCacheLayout::HND, 8, 12, 1.f, 1.f},
        CacheCase{DType::bf16, "auto", KVCacheLayout::NHD, 16, 16, 1.f, 1.f},
        CacheCase{DType::bf16, "auto", KVCacheLayout::HND, 8, 8, 1.f, 1.f},
        CacheCase{DType::f32, "bfloat16", KVCacheLayout::NHD, 8, 8, 1.f, 1.f},
        CacheCase{DType::bf16, "float32", KVCacheLayout::HND, 8, 8, 1.f, 1.f},
        CacheCase{DType::f32, "float16", KVCacheLayout::HND, 8, 8, 1.f, 1.f},
        CacheCase{DType::bf16, "fp8", KVCacheLayout::NHD, 8, 8, 0.05f, 0.02f},
        CacheCase{DType::f16, "fp8_e4m3", KVCacheLayout::HND, 16, 8, 0.004f, 0.1f},
        CacheCase{DType::f32, "fp8_e4m3", KVCacheLayout::NHD, 8, 8, 0.003f, 1.5f},
        CacheCase{DType::bf16, "fp8_e5m2", KVCacheLayout::HND, 8, 8, 0.25f, 0.5f},
        CacheCase{DType::f32, "fp8_e5m2", KVCacheLayout::NHD, 8, 12, 0.00002f, 1.f}),
    [](const ::testing::TestParamInfo<CacheCase>& info) { return case_name(info.param); });

// Large enough for the multi-threaded host path (>= 2^16 elements).
TEST(ReshapeAndCache, LargeBatchMatchesExpectedBytes) {
  std::mt19937 rng(31337);
  const int num_tokens = 700, num_blocks = 64, block_size = 16, heads = 4, head_size = 64;
  Tensor key = random_tensor(Shape{num_tokens, heads, head_size}, DType::bf16, rng);
  Tensor value = random_tensor(Shape{num_tokens, heads, head_size}, DType::bf16, rng);
  Tensor slots = make_slots(num_tokens, rng, num_blocks * block_size);
  for (const KVCacheLayout layout : {KVCacheLayout::NHD, KVCacheLayout::HND}) {
    const std::vector<int> order = standard_kv_cache_stride_order(layout);
    const Shape shape{2, num_blocks, block_size, heads, head_size};
    Tensor cache = allocate_paged_cache(shape, order, DType::fp8_e4m3);
    cache.fill_bytes(0x81);
    Tensor expected = allocate_paged_cache(shape, order, DType::fp8_e4m3);
    expected.fill_bytes(0x81);
    const KVCacheViews want = split_kv_cache(expected.view(), head_size, head_size);
    apply_expected(key.view(), want.key_cache, slots, DType::fp8_e4m3, 0.02f, {});
    apply_expected(value.view(), want.value_cache, slots, DType::fp8_e4m3, 0.03f, {});
    reshape_and_cache(key, value, cache, slots, "fp8", 0.02f, 0.03f);
    EXPECT_EQ(std::memcmp(cache.data(), expected.data(), cache.nbytes()), 0)
        << kv_cache_layout_name(layout);
  }
}

TEST(ReshapeAndCacheFlash, PerHeadScalesReplaceTensorScales) {
  std::mt19937 rng(77);
  const int num_tokens = 6;
  Tensor key = random_tensor(Shape{num_tokens, kNumKVHeads, 8}, DType::bf16, rng);
  Tensor value = random_tensor(Shape{num_tokens, kNumKVHeads, 8}, DType::bf16, rng);
  Tensor slots = make_slots(num_tokens, rng);
  const std::vector<int> order = standard_kv_cache_stride_order(KVCacheLayout::HND);
  const Shape shape{2, kNumBlocks, kBlockSize, kNumKVHeads, 8};
  Tensor cache = allocate_paged_cache(shape, order, DType::fp8_e4m3);
  cache.fill_bytes(0x5A);
  Tensor expected = allocate_paged_cache(shape, order, DType::fp8_e4m3);
  expected.fill_bytes(0x5A);
  const std::vector<float> k_heads{0.01f, 0.2f, 3.f}, v_heads{0.5f, 0.004f, 0.05f};
  Tensor k_scale(Shape{kNumKVHeads}, DType::f32), v_scale(Shape{kNumKVHeads}, DType::f32);
  std::copy(k_heads.begin(), k_heads.end(), k_scale.data_as<float>());
  std::copy(v_heads.begin(), v_heads.end(), v_scale.data_as<float>());
  LayerScales scales;
  scales.k_scale = 123.f;  // ignored: the per-head scales replace it
  scales.v_scale = 0.001f;
  scales.k_scale_per_head = k_scale;
  scales.v_scale_per_head = v_scale;
  const KVCacheViews want = split_kv_cache(expected.view(), 8, 8);
  apply_expected(key.view(), want.key_cache, slots, DType::fp8_e4m3, 0.f, k_heads);
  apply_expected(value.view(), want.value_cache, slots, DType::fp8_e4m3, 0.f, v_heads);
  const KVCacheViews views = split_kv_cache(cache.view(), 8, 8);
  reshape_and_cache_flash(key, value, views.key_cache, views.value_cache, slots, "fp8", scales);
  EXPECT_EQ(std::memcmp(cache.data(), expected.data(), cache.nbytes()), 0);
}

TEST(ReshapeAndCacheFlash, SeparateKeyAndValueCachesAndEmptySlotMapping) {
  std::mt19937 rng(5);
  Tensor key = random_tensor(Shape{4, 2, 8}, DType::f16, rng);
  Tensor value = random_tensor(Shape{4, 2, 4}, DType::f16, rng);
  Tensor key_cache(Shape{3, 2, 2, 8}, DType::f16), value_cache(Shape{3, 2, 2, 4}, DType::f16);
  key_cache.fill_bytes(0xEE);
  value_cache.fill_bytes(0xEE);
  const auto k_before = snapshot(key_cache), v_before = snapshot(value_cache);
  Tensor no_slots(Shape{0}, DType::i64);
  reshape_and_cache_flash(key, value, key_cache, value_cache, no_slots, "auto");
  EXPECT_TRUE(bytes_equal(key_cache, k_before));
  EXPECT_TRUE(bytes_equal(value_cache, v_before));

  Tensor slots(Shape{4}, DType::i64);
  const int64_t slot_values[] = {5, -1, 0, 3};
  std::copy(std::begin(slot_values), std::end(slot_values), slots.data_as<int64_t>());
  reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto");
  for (int t = 0; t < 4; ++t) {
    const int64_t s = slot_values[t];
    if (s < 0) continue;
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 8; ++i) {
        EXPECT_EQ(key_cache.data_as<uint16_t>()[(s * 2 + h) * 8 + i],
                  key.data_as<uint16_t>()[(t * 2 + h) * 8 + i]);
      }
      for (int i = 0; i < 4; ++i) {
        EXPECT_EQ(value_cache.data_as<uint16_t>()[(s * 2 + h) * 4 + i],
                  value.data_as<uint16_t>()[(t * 2 + h) * 4 + i]);
      }
    }
  }
  // Slots 1, 2 and 4 were never named: still poison.
  for (const int64_t s : {1, 2, 4}) {
    for (int e = 0; e < 2 * 8; ++e) EXPECT_EQ(key_cache.data_as<uint16_t>()[s * 16 + e], 0xEEEE);
  }
}

// ---- bad inputs: Error naming the argument, cache untouched ---------------------------------

class ReshapeAndCacheErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937 rng(99);
    key = random_tensor(Shape{5, kNumKVHeads, 8}, DType::bf16, rng);
    value = random_tensor(Shape{5, kNumKVHeads, 8}, DType::bf16, rng);
    cache = allocate_paged_cache(Shape{2, kNumBlocks, kBlockSize, kNumKVHeads, 8},
                                 standard_kv_cache_stride_order(KVCacheLayout::NHD), DType::bf16);
    cache.fill_bytes(0x3C);
    fp8_cache = allocate_paged_cache(Shape{2, kNumBlocks, kBlockSize, kNumKVHeads, 8},
                                     standard_kv_cache_stride_order(KVCacheLayout::HND),
                                     DType::fp8_e4m3);
    fp8_cache.fill_bytes(0x3C);
    slots = Tensor(Shape{5}, DType::i64);
    const int64_t s[] = {0, 7, -1, 19, 3};
    std::copy(std::begin(s), std::end(s), slots.data_as<int64_t>());
    before = snapshot(cache);
    fp8_before = snapshot(fp8_cache);
  }

  // The valid call succeeds (so each failure below is due to the one bad argument).
  void expect_untouched() {
    EXPECT_TRUE(bytes_equal(cache, before)) << "cache modified by a rejected call";
    EXPECT_TRUE(bytes_equal(fp8_cache, fp8_before)) << "fp8 cache modified by a rejected call";
  }
  void expect_rejected(const std::function<void()>& fn, const std::string& argument) {
    expect_error(fn, argument);
    expect_untouched();
  }

  Tensor key, value, cache, fp8_cache, slots;
  std::vector<uint8_t> before, fp8_before;
};

TEST_F(ReshapeAndCacheErrors, ValidCallsSucceed) {
  Tensor scratch = allocate_paged_cache(cache.shape(), standard_kv_cache_stride_order(KVCacheLayout::NHD),
                                        DType::bf16);
  EXPECT_NO_THROW(reshape_and_cache(key, value, scratch, slots, "auto"));
  Tensor scratch8 = allocate_paged_cache(fp8_cache.shape(),
                                         standard_kv_cache_stride_order(KVCacheLayout::HND),
                                         DType::fp8_e4m3);
  EXPECT_NO_THROW(reshape_and_cache(key, value, scratch8, slots, "fp8", 0.1f, 0.2f));
}

TEST_F(ReshapeAndCacheErrors, KeyDtype) {
  Tensor k32(Shape{5, kNumKVHeads, 8}, DType::i32);
  k32.fill_bytes(1);
  expect_rejected([&] { reshape_and_cache(k32, value, cache, slots, "auto"); }, "key");
  Tensor k8(Shape{5, kNumKVHeads, 8}, DType::fp8_e4m3);
  k8.fill_bytes(1);
  expect_rejected([&] { reshape_and_cache(k8, value, fp8_cache, slots, "fp8"); }, "key");
}

TEST_F(ReshapeAndCacheErrors, ValueDtypeDiffersFromKey) {
  std::mt19937 rng(1);
  Tensor v16 = random_tensor(Shape{5, kNumKVHeads, 8}, DType::f16, rng);
  expect_rejected([&] { reshape_and_cache(key, v16, cache, slots, "auto"); }, "value");
}

TEST_F(ReshapeAndCacheErrors, Shapes) {
  expect_rejected([&] { reshape_and_cache(key.view().select(1, 0), value, cache, slots, "auto"); },
                  "key");
  expect_rejected([&] { reshape_and_cache(key, value.view().narrow(1, 0, 2), cache, slots, "auto"); },
                  "value");
  expect_rejected([&] { reshape_and_cache(key, value.view().narrow(0, 0, 4), cache, slots, "auto"); },
                  "value");
  expect_rejected([&] { reshape_and_cache(key, value, cache.view().select(0, 0), slots, "auto"); },
                  "kv_cache");
  // Head size larger than the cache's last dim.
  std::mt19937 rng(2);
  Tensor k16 = random_tensor(Shape{5, kNumKVHeads, 16}, DType::bf16, rng);
  expect_rejected([&] { reshape_and_cache(k16, value, cache, slots, "auto"); }, "kv_cache");
  // Cache with other heads.
  const KVCacheViews halves = split_kv_cache(cache, 8, 8);
  expect_rejected([&] {
    reshape_and_cache_flash(key, value, halves.key_cache.narrow(2, 0, 2), halves.value_cache,
                            slots, "auto");
  }, "key_cache");
  expect_rejected([&] {
    reshape_and_cache_flash(key, value, halves.key_cache, halves.value_cache.narrow(3, 0, 4),
                            slots, "auto");
  }, "value_cache");
  expect_rejected([&] {
    reshape_and_cache_flash(key, value, halves.key_cache, halves.value_cache.narrow(0, 0, 4),
                            slots, "auto");
  }, "value_cache");
}

TEST_F(ReshapeAndCacheErrors, CacheDtypeMismatch) {
  // bf16 cache but kv_cache_dtype says fp8.
  expect_rejected([&] { reshape_and_cache(key, value, cache, slots, "fp8"); }, "key_cache");
  // fp8_e4m3 cache but kv_cache_dtype says e5m2 / auto.
  expect_rejected([&] { reshape_and_cache(key, value, fp8_cache, slots, "fp8_e5m2"); }, "key_cache");
  expect_rejected([&] { reshape_and_cache(key, value, fp8_cache, slots, "auto"); }, "key_cache");
  // Value cache alone of another dtype.
  const KVCacheViews halves = split_kv_cache(cache, 8, 8);
  const KVCacheViews halves8 = split_kv_cache(fp8_cache, 8, 8);
  expect_rejected([&] {
    reshape_and_cache_flash(key, value, halves.key_cache, halves8.value_cache, slots, "auto");
  }, "value_cache");
  expect_rejected([&] { reshape_and_cache(key, value, cache, slots, "int8"); }, "kv_cache_dtype");
}

TEST_F(ReshapeAndCacheErrors, SlotOutOfRangeAfterValidSlots) {
  // The bad slot is the last one: nothing before it may have been written.
  slots.data_as<int64_t>()[4] = kNumBlocks * kBlockSize;
  expect_rejected([&] { reshape_and_cache(key, value, cache, slots, "auto"); }, "slot_mapping");
  try {
    reshape_and_cache(key, value, cache, slots, "auto");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("slot_mapping[4] = 20"), std::string::npos) << e.what();
  }
  slots.data_as<int64_t>()[4] = -2;
  expect_rejected([&] { reshape_and_cache(key, value, fp8_cache, slots, "fp8"); }, "slot_mapping");
}

TEST_F(ReshapeAndCacheErrors, SlotMappingDtypeAndLength) {
  Tensor slots32(Shape{5}, DType::i32);
  slots32.fill_bytes(0);
  expect_rejected([&] { reshape_and_cache(key, value, cache, slots32, "auto"); }, "slot_mapping");
  Tensor long_slots(Shape{6}, DType::i64);
  for (int i = 0; i < 6; ++i) long_slots.data_as<int64_t>()[i] = i;
  expect_rejected([&] { reshape_and_cache(key, value, cache, long_slots, "auto"); }, "slot_mapping");
  Tensor slots2d(Shape{5, 1}, DType::i64);
  for (int i = 0; i < 5; ++i) slots2d.data_as<int64_t>()[i] = i;
  expect_rejected([&] { reshape_and_cache(key, value, cache, slots2d, "auto"); }, "slot_mapping");
  expect_rejected([&] { reshape_and_cache(key, value, cache, TensorView{}, "auto"); }, "slot_mapping");
}

TEST_F(ReshapeAndCacheErrors, Scales) {
  expect_rejected([&] { reshape_and_cache(key, value, fp8_cache, slots, "fp8", -1.f, 1.f); },
                  "k_scale");
  expect_rejected([&] { reshape_and_cache(key, value, fp8_cache, slots, "fp8", 0.f, 1.f); },
                  "k_scale");
  expect_rejected([&] {
    reshape_and_cache(key, value, fp8_cache, slots, "fp8", 1.f,
                      std::numeric_limits<float>::quiet_NaN());
  }, "v_scale");
  expect_rejected([&] {
    reshape_and_cache(key, value, fp8_cache, slots, "fp8", 1.f,
                      std::numeric_limits<float>::infinity());
  }, "v_scale");
  const KVCacheViews halves = split_kv_cache(fp8_cache, 8, 8);
  Tensor per_head(Shape{kNumKVHeads}, DType::f32);
  for (int h = 0; h < kNumKVHeads; ++h) per_head.data_as<float>()[h] = 0.5f;
  per_head.data_as<float>()[2] = 0.f;
  LayerScales scales;
  scales.k_scale_per_head = per_head;
  expect_rejected([&] {
    reshape_and_cache_flash(key, value, halves.key_cache, halves.value_cache, slots, "fp8", scales);
  }, "k_scale_per_head");
  Tensor wrong_len(Shape{kNumKVHeads + 1}, DType::f32);
  for (int h = 0; h <= kNumKVHeads; ++h) wrong_len.data_as<float>()[h] = 1.f;
  LayerScales scales2;
  scales2.v_scale_per_head = wrong_len;
  expect_rejected([&] {
    reshape_and_cache_flash(key, value, halves.key_cache, halves.value_cache, slots, "fp8", scales2);
  }, "v_scale_per_head");
  Tensor f16_scale(Shape{kNumKVHeads}, DType::f16);
  f16_scale.fill_bytes(0x3C);
  LayerScales scales3;
  scales3.v_scale_per_head = f16_scale;
  expect_rejected([&] {
    reshape_and_cache_flash(key, value, halves.key_cache, halves.value_cache, slots, "fp8", scales3);
  }, "v_scale_per_head");
}

TEST_F(ReshapeAndCacheErrors, MixedDevices) {
  // A value view labelled cuda (never dereferenced: rejected before any access).
  const TensorView cuda_value(value.data(), DType::bf16, value.shape(), Device::cuda);
  expect_rejected([&] { reshape_and_cache(key, cuda_value, cache, slots, "auto"); }, "value");
  const TensorView cuda_slots(slots.data(), DType::i64, slots.shape(), Device::cuda);
  expect_rejected([&] { reshape_and_cache(key, value, cache, cuda_slots, "auto"); },
                  "slot_mapping");
}

#if !PAGEDATTN_HAS_CUDA
TEST_F(ReshapeAndCacheErrors, CudaTensorsWithoutCuda) {
  const auto on_cuda = [](const TensorView& v) {
    return TensorView(v.data(), v.dtype(), v.shape(), v.strides(), Device::cuda);
  };
  try {
    reshape_and_cache(on_cuda(key), on_cuda(value), on_cuda(cache), on_cuda(slots), "auto");
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("built without CUDA"), std::string::npos) << e.what();
  }
  expect_untouched();
}
#endif

}  // namespace
}  // namespace pagedattn
