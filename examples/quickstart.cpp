// Quickstart: one GQA decoder layer, a paged cache, a batch of two prefills — plan, then run.
#include <cstdio>
#include "pagedattn/pagedattn.h"
using namespace pagedattn;

int main() {
  Attention layer({.num_heads = 8, .head_size = 64, .num_kv_heads = 2, .prefix = "layers.0.attn",
                   .dtype = DType::f32});                      // backend chosen by the selector
  Tensor kv_cache = layer.allocate_kv_cache(/*num_blocks=*/4);  // pages of 16 tokens
  auto batch = make_common_attention_metadata({                // requests of 5 and 3 tokens
      .query_start_loc = {0, 5, 8}, .seq_lens = {5, 3}, .block_table = {0, 1, 2, 3},
      .max_num_blocks_per_req = 2, .slot_mapping = {0, 1, 2, 3, 4, 32, 33, 34}});
  Tensor q({8, 8, 64}, DType::f32), k({8, 2, 64}, DType::f32), v({8, 2, 64}, DType::f32);
  for (Tensor* t : {&q, &k, &v})
    for (int64_t i = 0; i < t->numel(); ++i) t->data_as<float>()[i] = float(i % 7) / 7.f - 0.5f;
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(8, 64, 64), Device::cpu);
  auto plan = builder->build(/*common_prefix_len=*/0, batch.common);  // once per step
  Tensor out({8, 8, 64}, DType::f32);
  layer.forward(q, k, v, kv_cache, *plan, out);                // writes the cache, then attends
  std::printf("%s: out[0][0][0] = %.6f\n", std::string(layer.backend().name()).c_str(), out.data_as<float>()[0]);
}
