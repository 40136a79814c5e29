// Chunked local attention (attention_chunk_size) on the CUDA backend: the local-attention builder
// reads the block table from the device, builds the virtual batches on the host and hands the
// CUDA builder device copies it owns. Checked against the same layer on REFERENCE (whose chunked
// answer tests/layer/test_local_attention_layer.cpp checks against an fp64 oracle), on inputs
// where plain causal attention is far off; the caller's block table is a strided view (a wider
// table narrowed) and the caller frees its metadata before the forward.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <tuple>
#include <vector>

#include "gpu_test_util.h"

namespace pagedattn {
namespace {

using gpu_test::random_host;
using gpu_test::rel_error;

constexpr int kHeads = 8, kKvHeads = 2, kHeadSize = 128, kBlockSize = 16;

AttentionLayerParams params(Device device, const char* backend, std::optional<int> chunk) {
  AttentionLayerParams p;
  p.num_heads = kHeads;
  p.num_kv_heads = kKvHeads;
  p.head_size = kHeadSize;
  p.dtype = DType::bf16;
  p.block_size = kBlockSize;
  p.attention_chunk_size = chunk;
  p.prefix = "model.layers.0.self_attn.attn";
  p.device = device;
  p.backend = backend;
  return p;
}

TEST(CudaLocalAttention, MatchesReferenceOnVirtualBatches) {
  PAGEDATTN_REQUIRE_GPU();
  for (const int chunk : {32, 64}) {
    SCOPED_TRACE(chunk);
    // (cached tokens, new tokens): an 80-token prefill, decodes beside and on chunk edges,
    // prefill chunks that start inside a chunk.
    const std::vector<std::pair<int, int>> requests = {{0, 80}, {70, 1}, {20, 30}, {63, 1}, {31, 2}, {64, 1}};
    const int num_reqs = static_cast<int>(requests.size());
    int needed_cols = 0, num_blocks = 0, num_tokens = 0;
    for (const auto& [ctx, q] : requests) {
      const int blocks = (ctx + q + kBlockSize - 1) / kBlockSize;
      needed_cols = std::max(needed_cols, blocks);
      num_blocks += blocks;
      num_tokens += q;
    }
    num_blocks += 4;
    const int cols = needed_cols + 3;  // the caller's table is wider than the batch needs
    std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(chunk));
    CommonAttentionMetadataArgs args;
    args.block_table.assign(static_cast<size_t>(num_reqs) * cols, 0);
    args.max_num_blocks_per_req = cols;
    args.query_start_loc = {0};
    std::vector<int64_t> context_slots;
    size_t next = 0;
    for (int r = 0; r < num_reqs; ++r) {
      const auto [ctx, q] = requests[static_cast<size_t>(r)];
      for (int b = 0; b < (ctx + q + kBlockSize - 1) / kBlockSize; ++b) {
        args.block_table[static_cast<size_t>(r * cols + b)] = ids[next++];
      }
      auto slot = [&](int pos) {
        return int64_t{args.block_table[static_cast<size_t>(r * cols + pos / kBlockSize)]} * kBlockSize +
               pos % kBlockSize;
      };
      for (int pos = 0; pos < ctx; ++pos) context_slots.push_back(slot(pos));
      for (int pos = ctx; pos < ctx + q; ++pos) args.slot_mapping.push_back(slot(pos));
      args.query_start_loc.push_back(args.query_start_loc.back() + q);
      args.seq_lens.push_back(ctx + q);
    }

    Attention cuda_layer(params(Device::cuda, "CUDA", chunk));
    Attention ref_layer(params(Device::cpu, "REFERENCE", chunk));
    Attention causal_layer(params(Device::cpu, "REFERENCE", std::nullopt));
    Tensor cache = cuda_layer.allocate_kv_cache(num_blocks);
    Tensor ref_cache = ref_layer.allocate_kv_cache(num_blocks);
    Tensor causal_cache = causal_layer.allocate_kv_cache(num_blocks);
    cache.fill_bytes(0);
    ref_cache.fill_bytes(0);
    causal_cache.fill_bytes(0);
    // The context of every request, written into all three caches.
    const int64_t ctx_tokens = static_cast<int64_t>(context_slots.size());
    Tensor ctx_k = random_host(Shape{ctx_tokens, kKvHeads, kHeadSize}, DType::bf16, 11 + chunk);
    Tensor ctx_v = random_host(Shape{ctx_tokens, kKvHeads, kHeadSize}, DType::bf16, 12 + chunk);
    Tensor ctx_slots(Shape{ctx_tokens}, DType::i64);
    std::copy(context_slots.begin(), context_slots.end(), ctx_slots.data_as<int64_t>());
    reshape_and_cache(ctx_k, ctx_v, ref_cache, ctx_slots, "auto");
    reshape_and_cache(ctx_k, ctx_v, causal_cache, ctx_slots, "auto");
    reshape_and_cache(ctx_k.to(Device::cuda), ctx_v.to(Device::cuda), cache, ctx_slots.to(Device::cuda), "auto");

    Tensor q = random_host(Shape{num_tokens, kHeads, kHeadSize}, DType::bf16, 21 + chunk);
    Tensor k = random_host(Shape{num_tokens, kKvHeads, kHeadSize}, DType::bf16, 22 + chunk);
    Tensor v = random_host(Shape{num_tokens, kKvHeads, kHeadSize}, DType::bf16, 23 + chunk);
    auto common = std::make_unique<OwnedCommonAttentionMetadata>(
        make_common_attention_metadata(args, Device::cuda, num_blocks, kBlockSize));
    // A strided view: the columns the batch needs of the wider device table. Its host mirror is
    // the same view of the host table at C = 64; at C = 32 there is no mirror, so the builders
    // read the device table themselves (one device-to-host copy).
    common->common.block_table_tensor = common->block_table.view().narrow(1, 0, needed_cols);
    common->common.block_table_cpu =
        chunk == 64 ? common->block_table_cpu.view().narrow(1, 0, needed_cols) : TensorView{};
    const auto host_common = make_common_attention_metadata(args, Device::cpu, num_blocks, kBlockSize);

    auto builder = cuda_layer.backend().make_builder(cuda_layer.kv_cache_spec(),
                                                     cuda_layer.builder_config(num_reqs, 256, 256), Device::cuda);
    EXPECT_EQ(builder->cudagraph_support(), CudaGraphSupport::never);
    std::shared_ptr<const AttentionMetadata> md = builder->build(0, common->common);
    common.reset();  // the plan owns what it needs
    Tensor out(Shape{num_tokens, kHeads, kHeadSize}, DType::bf16, Device::cuda);
    out.fill_bytes(0xFF);
    cuda_layer.forward(q.to(Device::cuda), k.to(Device::cuda), v.to(Device::cuda), cache, *md, out);
    synchronize_cuda();
    Tensor out_host = out.to(Device::cpu);

    Tensor ref_out(Shape{num_tokens, kHeads, kHeadSize}, DType::bf16);
    Tensor causal_out(Shape{num_tokens, kHeads, kHeadSize}, DType::bf16);
    for (auto [layer, layer_cache, output] : {std::tuple{&ref_layer, &ref_cache, &ref_out},
                                              std::tuple{&causal_layer, &causal_cache, &causal_out}}) {
      auto b = layer->backend().make_builder(layer->kv_cache_spec(), layer->builder_config(num_reqs, 256, 256),
                                             Device::cpu);
      layer->forward(q, k, v, *layer_cache, *b->build(0, host_common.common), *output);
    }
    ASSERT_GT(rel_error(causal_out, ref_out), 0.05) << "the batch does not exercise the chunk";
    EXPECT_LE(rel_error(out_host, ref_out), 8e-3);
  }
}

}  // namespace
}  // namespace pagedattn
