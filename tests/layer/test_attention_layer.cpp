// The Attention layer without running attention: parameter validation (one error per
// argument), scale default, backend selection, KV-cache specs, cache allocation, selector /
// builder configs, get_per_layer_parameters + infer_global_hyperparameters, and the
// StaticForwardContext's checks of kv_sharing_target_layer_name.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "pagedattn/error.h"
#include "pagedattn/layer.h"
#include "pagedattn/mla.h"
#include "pagedattn/selector.h"

namespace pagedattn {
namespace {

AttentionLayerParams valid_params(const std::string& name = "model.layers.0.self_attn.attn") {
  AttentionLayerParams p;
  p.num_heads = 8;
  p.head_size = 32;
  p.num_kv_heads = 2;
  p.dtype = DType::f32;
  p.block_size = 16;
  p.prefix = name;
  return p;
}

void expect_param_error(const std::function<void(AttentionLayerParams&)>& edit,
                        const std::string& argument) {
  AttentionLayerParams p = valid_params();
  edit(p);
  try {
    Attention layer(p);
    ADD_FAILURE() << "expected an Error naming '" << argument << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(argument), std::string::npos) << e.what();
  }
}

TEST(AttentionLayer, ValidParamsConstruct) {
  const Attention layer(valid_params());
  EXPECT_EQ(layer.name(), "model.layers.0.self_attn.attn");
  EXPECT_FLOAT_EQ(layer.params().scale.value(), 1.f / std::sqrt(32.f));
}

TEST(AttentionLayer, ExplicitScaleIsKept) {
  AttentionLayerParams p = valid_params();
  p.scale = 0.125f;
  EXPECT_EQ(Attention(p).params().scale, 0.125f);
}

// Unset scale / num_kv_heads take vLLM's defaults (resolved in params()); an explicit 0 is an
// Error naming the argument (it used to mean "default" silently), as in Python.
TEST(AttentionLayer, UnsetMeansDefaultAndZeroIsAnError) {
  AttentionLayerParams p = valid_params();
  p.num_kv_heads.reset();
  const Attention mha(p);
  EXPECT_EQ(mha.params().num_kv_heads, 8);
  EXPECT_EQ(mha.kv_cache_spec().num_kv_heads, 8);
  expect_param_error([](auto& q) { q.scale = 0.f; }, "scale");
  expect_param_error([](auto& q) { q.scale = -0.f; }, "scale");
  expect_param_error([](auto& q) { q.num_kv_heads = 0; }, "num_kv_heads");
  try {
    AttentionLayerParams q = valid_params();
    q.scale = 0.f;
    Attention layer(q);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("scale = 0 must be a finite value > 0"), std::string::npos)
        << e.what();
  }
}

TEST(AttentionLayer, ConstructionErrorsNameTheArgument) {
  expect_param_error([](auto& p) { p.num_heads = 0; }, "num_heads");
  expect_param_error([](auto& p) { p.num_heads = -4; }, "num_heads");
  expect_param_error([](auto& p) { p.head_size = 0; }, "head_size");
  expect_param_error([](auto& p) { p.head_size_v = -1; }, "head_size_v");
  expect_param_error([](auto& p) { p.num_kv_heads = 3; }, "num_kv_heads");
  expect_param_error([](auto& p) { p.num_kv_heads = -1; }, "num_kv_heads");
  expect_param_error([](auto& p) { p.scale = -0.5f; }, "scale");
  expect_param_error([](auto& p) { p.scale = std::nanf(""); }, "scale");
  expect_param_error([](auto& p) { p.alibi_slopes = {0.5f, 0.25f}; }, "alibi_slopes");
  expect_param_error([](auto& p) { p.alibi_slopes.assign(8, INFINITY); }, "alibi_slopes");
  expect_param_error([](auto& p) { p.sinks = {1.f, 2.f, 3.f}; }, "sinks");
  expect_param_error([](auto& p) { p.sinks.assign(8, NAN); }, "sinks");
  expect_param_error([](auto& p) { p.sliding_window = 0; }, "sliding_window");
  expect_param_error([](auto& p) {
    p.sliding_window = 64;
    p.attn_type = AttentionType::encoder_decoder;
  }, "sliding_window");
  expect_param_error([](auto& p) { p.logits_soft_cap = 0.f; }, "logits_soft_cap");
  expect_param_error([](auto& p) { p.logits_soft_cap = -30.f; }, "logits_soft_cap");
  expect_param_error([](auto& p) { p.block_size = 0; }, "block_size");
  expect_param_error([](auto& p) { p.kv_cache_dtype = "int8"; }, "kv_cache_dtype");
  expect_param_error([](auto& p) { p.dtype = DType::i32; }, "dtype");
  expect_param_error([](auto& p) { p.dtype = DType::fp8_e4m3; }, "dtype");
  expect_param_error([](auto& p) { p.attention_chunk_size = 40; }, "attention_chunk_size");
  expect_param_error([](auto& p) { p.attention_chunk_size = 0; }, "attention_chunk_size");
  expect_param_error([](auto& p) {
    p.attention_chunk_size = 64;
    p.sliding_window = 32;
  }, "attention_chunk_size");
  expect_param_error([](auto& p) {
    p.attention_chunk_size = 64;
    p.attn_type = AttentionType::encoder_only;
  }, "attention_chunk_size");
  expect_param_error([](auto& p) { p.kv_sharing_target_layer_name = ""; },
                     "kv_sharing_target_layer_name");
  expect_param_error([](auto& p) { p.kv_sharing_target_layer_name = p.prefix; },
                     "kv_sharing_target_layer_name");
  expect_param_error([](auto& p) {
    p.kv_sharing_target_layer_name = "model.layers.0.attn";
    p.attn_type = AttentionType::encoder_only;
  }, "kv_sharing_target_layer_name");
  expect_param_error([](auto& p) { p.backend = "NO_SUCH_BACKEND"; }, "backend");
}

TEST(AttentionLayer, SelectsTheSelectorsBackend) {
  const char* env = std::getenv("PAGEDATTN_BACKEND");
  const Attention layer(valid_params());
  if (env == nullptr || *env == '\0') {
    EXPECT_EQ(&layer.backend(), &get_attn_backend(layer.selector_config()));
  }
  AttentionLayerParams forced = valid_params();
  forced.backend = "reference";
  Attention reference_layer(forced);
  EXPECT_EQ(reference_layer.backend().name(), "REFERENCE");
  EXPECT_EQ(reference_layer.impl().params().num_heads, 8);
  EXPECT_EQ(reference_layer.impl().params().kv_heads(), 2);
  EXPECT_FLOAT_EQ(reference_layer.impl().params().scale, 1.f / std::sqrt(32.f));
}

TEST(AttentionLayer, SelectorConfigCarriesTheFeatures) {
  AttentionLayerParams p = valid_params();
  p.alibi_slopes.assign(8, 0.5f);
  p.sinks.assign(8, 1.f);
  p.sliding_window = 128;
  p.logits_soft_cap = 30.f;
  p.kv_cache_dtype = "fp8";
  p.head_size_v = 16;
  p.backend = "REFERENCE";
  const Attention layer(p);
  const SelectorConfig c = layer.selector_config();
  EXPECT_EQ(c.head_size, 32);
  EXPECT_EQ(c.head_size_v, 16);
  EXPECT_EQ(c.dtype, DType::f32);
  EXPECT_EQ(c.kv_cache_dtype, "fp8");
  EXPECT_EQ(c.block_size, 16);
  EXPECT_TRUE(c.has_sink);
  EXPECT_TRUE(c.use_alibi);
  EXPECT_TRUE(c.use_sliding_window);
  EXPECT_TRUE(c.use_logits_soft_cap);
  EXPECT_FALSE(c.use_mla);
  EXPECT_EQ(c.attn_type, AttentionType::decoder);
  EXPECT_EQ(c.device, Device::cpu);
  EXPECT_FALSE(c.fp8_output);
  // A layer that will pass output_scale asks the selector for fused fp8 output.
  AttentionLayerParams q = valid_params();
  q.fp8_output = true;
  const Attention fp8_layer(q);
  EXPECT_TRUE(fp8_layer.selector_config().fp8_output);
  EXPECT_EQ(fp8_layer.backend().name(), "CPU");

  const BuilderConfig b = layer.builder_config(32, 2048, 4096);
  EXPECT_EQ(b.num_heads, 8);
  EXPECT_EQ(b.num_kv_heads, 2);
  EXPECT_EQ(b.head_size, 32);
  EXPECT_EQ(b.head_size_v, 16);
  EXPECT_EQ(b.max_num_seqs, 32);
  EXPECT_EQ(b.max_num_batched_tokens, 2048);
  EXPECT_EQ(b.max_model_len, 4096);
  EXPECT_EQ(b.sliding_window, 128);
  EXPECT_TRUE(b.use_alibi);
  try {
    (void)layer.builder_config(0, 2048, 4096);
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "max_num_seqs");
  }
}

TEST(AttentionLayer, KvCacheSpecKinds) {
  {
    const Attention layer(valid_params());
    const KVCacheSpec spec = layer.kv_cache_spec();
    EXPECT_EQ(spec, KVCacheSpec::full_attention(16, 2, 32, DType::f32));
    EXPECT_EQ(layer.kv_cache_storage_dtype(), DType::f32);
  }
  {
    AttentionLayerParams p = valid_params();
    p.sliding_window = 256;
    p.kv_cache_dtype = "fp8";
    const Attention layer(p);
    EXPECT_EQ(layer.kv_cache_spec(),
              KVCacheSpec::sliding_window_attention(16, 2, 32, DType::fp8_e4m3, 256));
    EXPECT_EQ(layer.kv_cache_storage_dtype(), DType::fp8_e4m3);
  }
  {
    AttentionLayerParams p = valid_params();
    p.attention_chunk_size = 64;
    p.kv_cache_dtype = "fp8_e5m2";
    const Attention layer(p);
    EXPECT_EQ(layer.kv_cache_spec(),
              KVCacheSpec::chunked_local_attention(16, 2, 32, DType::fp8_e5m2, 64));
  }
  {
    AttentionLayerParams p = valid_params();
    p.attn_type = AttentionType::encoder_decoder;
    p.dtype = DType::bf16;
    p.head_size_v = 16;
    const Attention layer(p);
    EXPECT_EQ(layer.kv_cache_spec(), KVCacheSpec::cross_attention(16, 2, 32, DType::bf16, 16));
  }
  {
    AttentionLayerParams p = valid_params();
    p.kv_cache_dtype = "bfloat16";
    p.head_size_v = 32;  // == head_size: same spec as the default
    const Attention layer(p);
    EXPECT_EQ(layer.kv_cache_spec(), KVCacheSpec::full_attention(16, 2, 32, DType::bf16));
  }
  for (const AttentionType t : {AttentionType::encoder, AttentionType::encoder_only}) {
    AttentionLayerParams p = valid_params();
    p.attn_type = t;
    const Attention layer(p);
    try {
      (void)layer.kv_cache_spec();
      ADD_FAILURE() << "encoder layers have no cache spec";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "attn_type");
      EXPECT_NE(std::string(e.what()).find("no KV cache"), std::string::npos) << e.what();
    }
    EXPECT_THROW((void)layer.allocate_kv_cache(4), Error);
  }
}

TEST(AttentionLayer, AllocateKvCacheUsesBackendShapeAndMaxHeadSize) {
  AttentionLayerParams p = valid_params();
  p.head_size_v = 48;
  p.kv_cache_dtype = "fp8";
  p.dtype = DType::bf16;
  p.backend = "REFERENCE";
  const Attention layer(p);
  const Tensor cache = layer.allocate_kv_cache(7);
  EXPECT_EQ(cache.shape(), layer.backend().kv_cache_shape(7, 16, 2, 48, "fp8"));
  EXPECT_EQ(cache.dtype(), DType::fp8_e4m3);
  EXPECT_EQ(cache.device(), Device::cpu);
  EXPECT_GE(cache.nbytes(), static_cast<size_t>(2 * 7 * 16 * 2 * 48));
}

TEST(PerLayerParameters, CollectAndInferGlobal) {
  AttentionLayerParams a = valid_params("layers.0.attn");
  a.sliding_window = 128;
  a.logits_soft_cap = 30.f;
  AttentionLayerParams b = a;
  b.prefix = "layers.1.attn";
  const Attention la(a), lb(b);
  const auto per_layer = get_per_layer_parameters({&la, &lb});
  ASSERT_EQ(per_layer.size(), 2u);
  const PerLayerParameters want{127, 30.f, 1.f / std::sqrt(32.f)};
  EXPECT_EQ(per_layer.at("layers.0.attn"), want);
  EXPECT_EQ(per_layer.at("layers.1.attn"), want);
  EXPECT_EQ(infer_global_hyperparameters(per_layer), want);

  AttentionLayerParams c = valid_params("layers.2.attn");  // no window, no cap
  const Attention lc(c);
  const auto mixed = get_per_layer_parameters({&la, &lb, &lc});
  EXPECT_EQ(mixed.at("layers.2.attn"), (PerLayerParameters{-1, std::nullopt, 1.f / std::sqrt(32.f)}));
  try {
    (void)infer_global_hyperparameters(mixed);
    ADD_FAILURE() << "layers disagree: expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layers.2.attn"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)get_per_layer_parameters({&la, nullptr}), Error);
  EXPECT_THROW((void)get_per_layer_parameters({&la, &la}), Error);
}

// ---- StaticForwardContext: registration and kv_sharing_target_layer_name ------------------

// Constructing `p` in `model` throws an Error naming `argument` whose message holds every one
// of `words`; the context is left as it was.
void expect_context_error(StaticForwardContext& model, const AttentionLayerParams& p,
                          const std::string& argument, const std::vector<std::string>& words) {
  const size_t before = model.layers().size();
  try {
    Attention layer(p, &model);
    ADD_FAILURE() << "expected an Error naming '" << argument << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    for (const std::string& word : words) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << word << " in " << e.what();
    }
  }
  EXPECT_EQ(model.layers().size(), before);
}

AttentionLayerParams sharer_of(const std::string& name, const std::string& target) {
  AttentionLayerParams p = valid_params(name);
  p.backend = "REFERENCE";
  p.kv_sharing_target_layer_name = target;
  return p;
}

TEST(StaticForwardContext, RegistersLayersAndRejectsDuplicateNames) {
  StaticForwardContext model;
  AttentionLayerParams p = valid_params("model.layers.0.attn");
  p.backend = "REFERENCE";
  const Attention first(p, &model);
  AttentionLayerParams encoder = valid_params("model.layers.1.attn");
  encoder.attn_type = AttentionType::encoder_only;
  const Attention second(encoder, &model);
  ASSERT_EQ(model.layers().size(), 2u);
  EXPECT_EQ(model.layers()[0].name, "model.layers.0.attn");
  ASSERT_NE(model.find("model.layers.0.attn"), nullptr);
  EXPECT_EQ(*model.find("model.layers.0.attn")->kv_cache_spec, first.kv_cache_spec());
  EXPECT_FALSE(model.find("model.layers.1.attn")->kv_cache_spec.has_value());
  EXPECT_EQ(model.find("nope"), nullptr);
  expect_context_error(model, p, "prefix", {"model.layers.0.attn", "already"});
  expect_context_error(model, valid_params(""), "prefix", {"prefix is empty"});
  // A layer the selector rejects is not registered either.
  AttentionLayerParams bad_backend = valid_params("model.layers.2.attn");
  bad_backend.backend = "NO_SUCH_BACKEND";
  expect_context_error(model, bad_backend, "backend", {});
}

TEST(StaticForwardContext, KvSharingTargetIsAnEarlierLayerWithTheSameSpec) {
  StaticForwardContext model;
  AttentionLayerParams owner = valid_params("model.layers.0.attn");
  owner.backend = "REFERENCE";
  const Attention layer0(owner, &model);
  const Attention layer1(sharer_of("model.layers.1.attn", "model.layers.0.attn"), &model);
  EXPECT_EQ(layer1.kv_cache_spec(), layer0.kv_cache_spec());
  EXPECT_EQ(model.layers().size(), 2u);

  // Without the context the target cannot be checked: an Error, as in vLLM.
  try {
    Attention loose(sharer_of("model.layers.5.attn", "model.layers.0.attn"));
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "kv_sharing_target_layer_name");
    EXPECT_NE(std::string(e.what()).find("StaticForwardContext"), std::string::npos) << e.what();
  }
  // Later (by layer index) and unknown targets.
  expect_context_error(model, sharer_of("model.layers.2.attn", "model.layers.3.attn"),
                       "kv_sharing_target_layer_name",
                       {"model.layers.2.attn", "model.layers.3.attn", "earlier layer"});
  expect_context_error(model, sharer_of("model.layers.2.attn", "lm_head.attn"),
                       "kv_sharing_target_layer_name",
                       {"model.layers.2.attn", "lm_head.attn", "'model.layers.0.attn'"});
  // A target that shares itself: name its target instead.
  expect_context_error(model, sharer_of("model.layers.2.attn", "model.layers.1.attn"),
                       "kv_sharing_target_layer_name",
                       {"model.layers.2.attn", "model.layers.1.attn", "model.layers.0.attn"});
  // Spec differences, each named.
  AttentionLayerParams head = sharer_of("model.layers.2.attn", "model.layers.0.attn");
  head.head_size = 64;
  expect_context_error(model, head, "kv_sharing_target_layer_name",
                       {"model.layers.0.attn", "model.layers.2.attn", "head_size 32 vs 64"});
  AttentionLayerParams heads = sharer_of("model.layers.2.attn", "model.layers.0.attn");
  heads.num_kv_heads = 4;
  heads.block_size = 32;
  expect_context_error(model, heads, "kv_sharing_target_layer_name",
                       {"num_kv_heads 2 vs 4", "block_size 16 vs 32"});
  AttentionLayerParams window = sharer_of("model.layers.2.attn", "model.layers.0.attn");
  window.sliding_window = 128;
  expect_context_error(model, window, "kv_sharing_target_layer_name",
                       {"kind full_attention vs sliding_window", "sliding_window 0 vs 128"});
  AttentionLayerParams fp8 = sharer_of("model.layers.2.attn", "model.layers.0.attn");
  fp8.kv_cache_dtype = "fp8";
  expect_context_error(model, fp8, "kv_sharing_target_layer_name", {"dtype float32 vs fp8_e4m3"});
  AttentionLayerParams cross = sharer_of("model.layers.2.attn", "model.layers.0.attn");
  cross.attn_type = AttentionType::encoder_decoder;
  expect_context_error(model, cross, "kv_sharing_target_layer_name",
                       {"attn_type=decoder", "attn_type=encoder_decoder"});
  AttentionLayerParams cuda = sharer_of("model.layers.2.attn", "model.layers.0.attn");
  cuda.device = Device::cuda;
  expect_context_error(model, cuda, "kv_sharing_target_layer_name", {"on cpu", "on cuda"});
  // An MLA layer cannot read a standard layer's cache (nor the other way round).
  MLAAttentionLayerParams mla;
  mla.num_heads = 2;
  mla.kv_lora_rank = 32;
  mla.qk_nope_head_dim = 16;
  mla.qk_rope_head_dim = 16;
  mla.qk_head_dim = 32;
  mla.v_head_dim = 16;
  mla.block_size = 16;
  mla.dtype = DType::f32;
  mla.backend = "REFERENCE_MLA";
  mla.prefix = "model.layers.2.mla";
  mla.kv_sharing_target_layer_name = "model.layers.0.attn";
  try {
    MLAAttention layer(mla, &model);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "kv_sharing_target_layer_name");
    EXPECT_NE(std::string(e.what()).find("an MLA layer"), std::string::npos) << e.what();
  }
  mla.kv_sharing_target_layer_name.reset();
  const MLAAttention mla_owner(mla, &model);
  mla.prefix = "model.layers.3.mla";
  mla.kv_sharing_target_layer_name = "model.layers.2.mla";
  const MLAAttention mla_sharer(mla, &model);
  EXPECT_EQ(model.layers().size(), 4u);
  EXPECT_TRUE(model.find("model.layers.3.mla")->use_mla);
}

}  // namespace
}  // namespace pagedattn
