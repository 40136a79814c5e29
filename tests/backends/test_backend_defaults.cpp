// The defaults of the backend interface: standard cache shape, stride order per layout
// (set_kv_cache_layout), allocation in physical order, and the builder defaults
// (use_cascade_attention, reorder_batch).
#include <gtest/gtest.h>

#include <optional>
#include <vector>

#include "backends/ops_test_util.h"
#include "pagedattn/backend.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/metadata.h"

namespace pagedattn {
namespace {

using testing_ops::expect_error;

// A backend that keeps every default (only the pure virtuals are defined). It is never
// selected or run: these tests call the inherited defaults directly.
class DefaultsBackend final : public AttentionBackend {
 public:
  std::string_view name() const override { return "DEFAULTS_UNDER_TEST"; }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams&) const override {
    throw Error("backend", "DEFAULTS_UNDER_TEST makes no impl");
  }
  std::unique_ptr<AttentionMetadataBuilder> make_backend_builder(
      const KVCacheSpec&, const BuilderConfig&, Device) const override {
    throw Error("backend", "DEFAULTS_UNDER_TEST makes no builder");
  }
  std::vector<KernelBlockSize> supported_kernel_block_sizes() const override {
    return {MultipleOf{1}};
  }
  std::vector<std::string> validate_configuration(const SelectorConfig&) const override {
    return {};
  }
  BackendCapabilities capabilities() const override { return {}; }
};

// A builder that keeps the cascade / reorder defaults with configurable switches.
class DefaultsBuilder final : public AttentionMetadataBuilder {
 public:
  DefaultsBuilder(bool cascade, int threshold)
      : AttentionMetadataBuilder(KVCacheSpec::full_attention(16, 2, 64, DType::bf16)),
        cascade_(cascade), threshold_(threshold) {}
  std::shared_ptr<const AttentionMetadata> build(int, const CommonAttentionMetadata&,
                                                 bool) override {
    return std::make_shared<AttentionMetadata>();
  }
  bool supports_cascade() const override { return cascade_; }
  int reorder_batch_threshold() const override { return threshold_; }

 private:
  bool cascade_;
  int threshold_;
};

class LayoutOverride {
 public:
  explicit LayoutOverride(KVCacheLayout layout) { set_kv_cache_layout(layout); }
  ~LayoutOverride() { set_kv_cache_layout(std::nullopt); }
};

TEST(BackendDefaults, KvCacheShape) {
  const DefaultsBackend backend;
  EXPECT_EQ(backend.kv_cache_shape(10, 16, 4, 128), (Shape{2, 10, 16, 4, 128}));
  EXPECT_EQ(backend.kv_cache_shape(0, 32, 1, 64, "fp8"), (Shape{2, 0, 32, 1, 64}));
  EXPECT_EQ(backend.kv_cache_shape(3, 1, 8, 72, "bfloat16"), (Shape{2, 3, 1, 8, 72}));
  expect_error([&] { backend.kv_cache_shape(-1, 16, 4, 128); }, "num_blocks");
  expect_error([&] { backend.kv_cache_shape(4, 0, 4, 128); }, "block_size");
  expect_error([&] { backend.kv_cache_shape(4, 16, 0, 128); }, "num_kv_heads");
  expect_error([&] { backend.kv_cache_shape(4, 16, 4, -8); }, "head_size");
  expect_error([&] { backend.kv_cache_shape(4, 16, 4, 128, "int8"); }, "kv_cache_dtype");
}

TEST(BackendDefaults, StrideOrderFollowsLayout) {
  const DefaultsBackend backend;
  {
    LayoutOverride nhd(KVCacheLayout::NHD);
    EXPECT_EQ(backend.kv_cache_stride_order(), (std::vector<int>{0, 1, 2, 3, 4}));
  }
  {
    LayoutOverride hnd(KVCacheLayout::HND);
    EXPECT_EQ(backend.kv_cache_stride_order(), (std::vector<int>{0, 1, 3, 2, 4}));
  }
}

TEST(BackendDefaults, AllocateKvCacheInPhysicalOrder) {
  const DefaultsBackend backend;
  const int64_t N = 6;
  const int B = 4, H = 3, D = 8;
  {
    LayoutOverride nhd(KVCacheLayout::NHD);
    Tensor cache = backend.allocate_kv_cache(N, B, H, D, DType::bf16, Device::cpu);
    EXPECT_EQ(cache.shape(), (Shape{2, N, B, H, D}));
    EXPECT_EQ(cache.dtype(), DType::bf16);
    EXPECT_EQ(cache.view().strides(), (Shape{N * B * H * D, B * H * D, H * D, D, 1}));
    EXPECT_EQ(cache.nbytes(), static_cast<size_t>(2 * N * B * H * D * 2));
  }
  {
    LayoutOverride hnd(KVCacheLayout::HND);
    Tensor cache = backend.allocate_kv_cache(N, B, H, D, DType::fp8_e4m3, Device::cpu);
    EXPECT_EQ(cache.shape(), (Shape{2, N, B, H, D}));
    EXPECT_EQ(cache.dtype(), DType::fp8_e4m3);
    // Pages of [H][B][D]: block_size stride D, head stride B*D.
    EXPECT_EQ(cache.view().strides(), (Shape{N * H * B * D, H * B * D, D, B * D, 1}));
    EXPECT_EQ(cache.nbytes(), static_cast<size_t>(2 * N * B * H * D));
  }
  expect_error([&] { backend.allocate_kv_cache(N, B, H, D, DType::i32, Device::cpu); },
               "storage_dtype");
}

TEST(BuilderDefaults, CascadeOnlyWhenSupported) {
  const DefaultsBuilder without(false, 0), with(true, 0);
  std::vector<int32_t> decodes(64, 1);
  std::vector<int32_t> prefills(16, 200);
  int agreed_true = 0;
  for (const int prefix : {0, 128, 256, 1024, 8192}) {
    for (const auto* lens : {&decodes, &prefills}) {
      for (const int num_sms : {8, 132}) {
        const bool heuristic =
            use_cascade_attention(prefix, *lens, 32, 8, false, false, false, num_sms);
        EXPECT_EQ(with.use_cascade_attention(prefix, *lens, 32, 8, false, false, false, num_sms),
                  heuristic);
        EXPECT_FALSE(
            without.use_cascade_attention(prefix, *lens, 32, 8, false, false, false, num_sms));
        agreed_true += heuristic ? 1 : 0;
      }
    }
  }
  EXPECT_GT(agreed_true, 0) << "no input exercised a positive cascade decision";
  // ALiBi / sliding window / local attention always disable it.
  EXPECT_FALSE(with.use_cascade_attention(8192, decodes, 32, 8, true, false, false, 132));
  EXPECT_FALSE(with.use_cascade_attention(8192, decodes, 32, 8, false, true, false, 132));
  EXPECT_FALSE(with.use_cascade_attention(8192, decodes, 32, 8, false, false, true, 132));
}

TEST(BuilderDefaults, ReorderBatch) {
  const std::vector<int32_t> mixed{3, 1, 2, 1, 5};
  const std::vector<int32_t> sorted{1, 1, 4, 7};
  EXPECT_FALSE(DefaultsBuilder(false, 0).reorder_batch(mixed).has_value());
  const auto reorder = DefaultsBuilder(false, 1).reorder_batch(mixed);
  ASSERT_TRUE(reorder.has_value());
  const BatchReorder direct = reorder_batch_to_split_decodes_and_prefills(mixed, 1);
  EXPECT_TRUE(reorder->modified);
  EXPECT_EQ(reorder->order, direct.order);
  // Every decode (<= 1 token) comes before every prefill after the permutation.
  bool seen_prefill = false;
  for (const int idx : reorder->order) {
    const bool decode = mixed[static_cast<size_t>(idx)] <= 1;
    EXPECT_FALSE(decode && seen_prefill);
    seen_prefill |= !decode;
  }
  EXPECT_FALSE(DefaultsBuilder(false, 1).reorder_batch(sorted).has_value());
  // Threshold 2 makes the 2-token request a decode too.
  const auto reorder2 = DefaultsBuilder(false, 2).reorder_batch(mixed);
  ASSERT_TRUE(reorder2.has_value());
  EXPECT_EQ(reorder2->order, reorder_batch_to_split_decodes_and_prefills(mixed, 2).order);
}

}  // namespace
}  // namespace pagedattn
