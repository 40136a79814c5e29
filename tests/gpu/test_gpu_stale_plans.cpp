// CUDA plans live in their builder's device workspace: a plan is valid until the builder's next
// build() or its destruction (PlanStamp, backend.h). Every entry point that reads a plan refuses
// an older one with an Error naming "metadata", before any launch: the standard CUDA impl
// (forward, do_kv_cache_update) and CUDA_MLA (forward with decodes or prefills only,
// do_kv_cache_update, the prefill runners).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "../../src/backends/cuda/mla/mla_cuda_backend.h"
#include "gpu_test_util.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn {
namespace {

template <class Call>
void expect_metadata_error(const char* what, const Call& call) {
  try {
    call();
    ADD_FAILURE() << what << ": a stale plan was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "metadata") << what << ": " << e.what();
  }
}

OwnedCommonAttentionMetadata one_request(int query_len, int seq_len, int block_size) {
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0, query_len};
  args.seq_lens = {seq_len};
  args.max_num_blocks_per_req = (seq_len + block_size - 1) / block_size;
  for (int b = 0; b < args.max_num_blocks_per_req; ++b) args.block_table.push_back(b);
  for (int t = 0; t < query_len; ++t) args.slot_mapping.push_back(seq_len - query_len + t);
  return make_common_attention_metadata(args, Device::cuda);
}

TEST(CudaStalePlans, StandardPlanAfterNextBuildAndAfterTheBuilder) {
  PAGEDATTN_REQUIRE_GPU();
  AttentionLayerParams p;
  p.num_heads = 4;
  p.head_size = 64;
  p.num_kv_heads = 2;
  p.scale = 0.125f;
  p.dtype = DType::bf16;
  p.device = Device::cuda;
  p.backend = "CUDA";
  p.prefix = "layers.0.attn";
  Attention layer(p);
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(4, 64, 256),
                                              Device::cuda);
  OwnedCommonAttentionMetadata a = one_request(3, 40, 16), b = one_request(1, 60, 16);
  auto plan_a = builder->build(0, a.common);
  auto plan_b = builder->build(0, b.common);
  EXPECT_FALSE(plan_a->stamp.current());
  EXPECT_TRUE(plan_b->stamp.current());
  Tensor cache = layer.allocate_kv_cache(8);
  Tensor x(Shape{3, 4, 64}, DType::bf16, Device::cuda), kv(Shape{3, 2, 64}, DType::bf16, Device::cuda);
  Tensor out(Shape{3, 4, 64}, DType::bf16, Device::cuda);
  AttentionImpl& impl = layer.impl();
  expect_metadata_error("forward", [&] { impl.forward(layer.scales(), x, kv, kv, cache, *plan_a, out); });
  expect_metadata_error("do_kv_cache_update",
                        [&] { impl.do_kv_cache_update(layer.scales(), kv, kv, cache, *plan_a); });
  builder.reset();
  EXPECT_FALSE(plan_b->stamp.current());
  expect_metadata_error("forward after the builder", [&] {
    impl.forward(layer.scales(), x.view().narrow(0, 0, 1), kv, kv, cache, *plan_b,
                 out.view().narrow(0, 0, 1));
  });
}

TEST(CudaStalePlans, MlaPlansWithoutDecodesAreCheckedToo) {
  PAGEDATTN_REQUIRE_GPU();
  MLAAttentionLayerParams p;
  p.num_heads = 16;
  p.scale = 0.1f;
  p.kv_lora_rank = 512;
  p.qk_nope_head_dim = 128;
  p.qk_rope_head_dim = 64;
  p.qk_head_dim = 192;
  p.v_head_dim = 128;
  p.block_size = 64;
  p.dtype = DType::bf16;
  p.device = Device::cuda;
  p.backend = "CUDA_MLA";
  p.prefix = "layers.0.attn";
  MLAAttention layer(p);
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(4, 64, 256),
                                              Device::cuda);
  // Prefills only (with context, so the chunked-context device arrays are part of the plan).
  OwnedCommonAttentionMetadata a = one_request(8, 100, 64), b = one_request(5, 70, 64);
  auto plan_a = builder->build(0, a.common);
  auto plan_b = builder->build(0, b.common);
  const auto& mla_a = dynamic_cast<const MLAMetadata&>(*plan_a);
  ASSERT_EQ(mla_a.num_decodes, 0);
  ASSERT_TRUE(mla_a.prefill.has_value());
  EXPECT_FALSE(mla_a.stamp.current());
  EXPECT_FALSE(mla_a.prefill->stamp.current());
  EXPECT_TRUE(plan_b->stamp.current());
  Tensor cache = layer.allocate_kv_cache(4);
  Tensor q(Shape{8, 16, 192}, DType::bf16, Device::cuda), kv_c(Shape{8, 512}, DType::bf16, Device::cuda);
  Tensor k_pe(Shape{8, 64}, DType::bf16, Device::cuda), out(Shape{8, 16, 128}, DType::bf16, Device::cuda);
  MLAAttentionImpl& impl = layer.impl();
  expect_metadata_error("MLA forward",
                        [&] { impl.forward(layer.scales(), q, kv_c, k_pe, cache, *plan_a, out); });
  expect_metadata_error("MLA do_kv_cache_update",
                        [&] { impl.do_kv_cache_update(layer.scales(), kv_c, k_pe, cache, *plan_a); });
  // A prefill runner handed the stale plan's prefill part directly.
  MLAPrefillParams pp;
  pp.num_heads = 16;
  pp.scale = 0.1f;
  pp.kv_lora_rank = 512;
  pp.qk_nope_head_dim = 128;
  pp.qk_rope_head_dim = 64;
  pp.v_head_dim = 128;
  pp.device = Device::cuda;
  auto runner = cuda_mla_prefill_backend().create(pp);
  runner->prepare_metadata(*mla_a.prefill);
  Tensor k(Shape{8, 16, 192}, DType::bf16, Device::cuda);
  Tensor v(Shape{8, 16, 128}, DType::bf16, Device::cuda);
  expect_metadata_error("prefill runner",
                        [&] { runner->run_prefill_new_tokens(q, k, v, false, out); });
  builder.reset();
  expect_metadata_error("MLA forward after the builder", [&] {
    impl.forward(layer.scales(), q.view().narrow(0, 0, 5), kv_c.view().narrow(0, 0, 5),
                 k_pe.view().narrow(0, 0, 5), cache, *plan_b, out.view().narrow(0, 0, 5));
  });
}

}  // namespace
}  // namespace pagedattn
