// CUDA graphs: one step (cache write + attention) is captured ONCE on a padded batch and
// replayed with different batch contents — other sequence lengths and block tables, padded
// requests of query length 0 with slot -1, a mixed step with a 3-token chunk and an 8-token
// prefill chunk (a plan of the other kind than the captured decode plan); fp8 at head size 64, a
// graph captured on a mixed step replaying plans over kv-head pairs — after only a build() per
// step (the plan lands in the builder's fixed workspace). Each replay is checked against the
// REFERENCE doing the same step on a host copy of the cache: the outputs within the bf16
// tolerance and the WHOLE cache byte-identical (so padded slots were never written).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <vector>

#include "backends/cuda/attention/cuda_backend_internal.h"
#include "conformance/harness.h"
#include "gpu_test_util.h"

namespace pagedattn {
namespace {

constexpr int kBlock = 16, kBatch = 8, kBlocks = 512;
constexpr int kTableCols = 40;  // 640 tokens per request at most

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

struct Step {
  std::vector<int32_t> query_lens;  // kBatch entries (0 = padded request)
  std::vector<int32_t> context;     // kBatch entries
};

CommonAttentionMetadataArgs step_args(const Step& s, std::mt19937_64& rng) {
  CommonAttentionMetadataArgs a;
  a.query_start_loc = {0};
  std::vector<int32_t> blocks(kBlocks);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  a.max_num_blocks_per_req = kTableCols;
  for (int r = 0; r < kBatch; ++r) {
    const int q = s.query_lens[r];
    const int seq = q > 0 ? s.context[r] + q : 0;
    a.query_start_loc.push_back(a.query_start_loc.back() + q);
    a.seq_lens.push_back(seq);
    for (int c = 0; c < kTableCols; ++c) a.block_table.push_back(blocks[(r * kTableCols + c) % kBlocks]);
    for (int i = 0; i < q; ++i) {
      const int pos = seq - q + i;
      a.slot_mapping.push_back(static_cast<int64_t>(a.block_table[r * kTableCols + pos / kBlock]) * kBlock +
                               pos % kBlock);
    }
  }
  a.num_tokens_padded = kBatch;  // the captured token count; the tail is -1
  return a;
}

// A layer, the step its graph is captured on, and the steps replayed.
struct GraphCase {
  int heads = 8, kv_heads = 2, head = 128;
  DType cache = DType::bf16;
  const char* cache_name = "auto";  // AttentionImplParams::kv_cache_dtype
  Step capture;
  std::vector<Step> steps;
  // What the builder must plan (checked on the capture plan and on each replay's plan).
  std::optional<cuda::AttentionKernel> capture_kernel;
  bool replays_pair = false;  // some replayed plan pairs kv heads (kItemPairedHeads)
};

// Captures one step (cache write + attention) and replays every other step after a build(),
// each checked against the REFERENCE on a host copy of the cache: outputs within the bf16
// tolerance (fp8 caches: every replay runs the decode-only kernel, off the 8-bit path), LSE, and
// the WHOLE cache byte-identical.
void capture_and_replay(const GraphCase& gc) {
  const AttentionBackend& cuda = cuda_backend();
  const AttentionBackend& ref = conformance::reference();
  const int H = gc.heads, KV = gc.kv_heads, D = gc.head;
  AttentionImplParams params;
  params.num_heads = H;
  params.num_kv_heads = KV;
  params.head_size = D;
  params.scale = 1.f / std::sqrt(static_cast<float>(D));
  params.dtype = DType::bf16;
  params.kv_cache_dtype = gc.cache_name;
  params.block_size = kBlock;
  for (int h = 0; h < H; ++h) params.sinks.push_back(0.5f * static_cast<float>((h * 7) % 9) - 2.f);
  params.device = Device::cuda;
  auto cuda_impl = cuda.make_impl(params);
  params.device = Device::cpu;
  auto ref_impl = ref.make_impl(params);
  const KVCacheSpec spec = KVCacheSpec::full_attention(kBlock, KV, D, gc.cache);
  BuilderConfig config;
  config.num_heads = H;
  config.num_kv_heads = KV;
  config.head_size = D;
  config.max_num_seqs = kBatch;
  config.max_num_batched_tokens = 64;
  config.max_model_len = kTableCols * kBlock;
  auto cuda_builder = cuda.make_builder(spec, config, Device::cuda);
  auto ref_builder = ref.make_builder(spec, config, Device::cpu);
  EXPECT_EQ(cuda_builder->cudagraph_support(), CudaGraphSupport::always);
  EXPECT_GT(cuda_builder->workspace_bytes(), 0u);

  // Caches: identical stale data on both sides.
  Tensor host_cache = ref.allocate_kv_cache(kBlocks, kBlock, KV, D, gc.cache, Device::cpu);
  {
    std::mt19937_64 fill(7);
    std::uniform_real_distribution<float> dist(-2.f, 2.f);
    for (int64_t i = 0; i < host_cache.numel(); ++i) store_f32(host_cache.data(), gc.cache, i, dist(fill));
  }
  Tensor dev_cache = host_cache.to(Device::cuda);

  // The layer's persistent buffers (fixed addresses, as an engine's graph inputs).
  Tensor query(Shape{kBatch, H, D}, DType::bf16, Device::cuda);
  Tensor key(Shape{kBatch, KV, D}, DType::bf16, Device::cuda);
  Tensor value(Shape{kBatch, KV, D}, DType::bf16, Device::cuda);
  Tensor output(Shape{kBatch, H, D}, DType::bf16, Device::cuda);
  Tensor lse(Shape{H, kBatch}, DType::f32, Device::cuda);
  LayerScales scales;

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  set_current_cuda_stream(stream);
  std::mt19937_64 rng(11);

  OwnedCommonAttentionMetadata capture_common =
      make_common_attention_metadata(step_args(gc.capture, rng), Device::cuda, kBlocks, kBlock);
  auto capture_md = cuda_builder->build_for_cudagraph_capture(capture_common.common);
  const auto* capture_plan = dynamic_cast<const cuda::CudaAttentionMetadata*>(capture_md.get());
  ASSERT_NE(capture_plan, nullptr);
  if (gc.capture_kernel) EXPECT_EQ(capture_plan->kernel, *gc.capture_kernel);
  synchronize_cuda();
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cuda_impl->do_kv_cache_update(scales, key, value, dev_cache, *capture_md);
  cuda_impl->forward(scales, query, key, value, dev_cache, *capture_md, output, {}, lse);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  uint64_t seed = 1000;
  bool paired = false;
  for (size_t si = 0; si < gc.steps.size(); ++si) {
    SCOPED_TRACE(detail::concat("replay ", si));
    const CommonAttentionMetadataArgs args = step_args(gc.steps[si], rng);
    OwnedCommonAttentionMetadata common = make_common_attention_metadata(args, Device::cuda, kBlocks, kBlock);
    OwnedCommonAttentionMetadata host_common = make_common_attention_metadata(args, Device::cpu, kBlocks, kBlock);
    const int live = common.common.num_actual_tokens;

    const Tensor q_host = gpu_test::random_host(Shape{kBatch, H, D}, DType::bf16, seed++);
    const Tensor k_host = gpu_test::random_host(Shape{kBatch, KV, D}, DType::bf16, seed++);
    const Tensor v_host = gpu_test::random_host(Shape{kBatch, KV, D}, DType::bf16, seed++);
    query.copy_from(q_host);
    key.copy_from(k_host);
    value.copy_from(v_host);
    output.fill_bytes(0xFF);
    lse.fill_bytes(0xFF);

    // Plan (host) into the fixed workspace, then replay.
    auto md = cuda_builder->build(0, common.common);
    const auto* plan = dynamic_cast<const cuda::CudaAttentionMetadata*>(md.get());
    ASSERT_NE(plan, nullptr);
    std::vector<cuda::WorkItem> items(plan->num_work_items);
    CUDA_OK(cudaMemcpy(items.data(), plan->items, items.size() * sizeof(cuda::WorkItem), cudaMemcpyDeviceToHost));
    for (const cuda::WorkItem& it : items) paired = paired || (it.flags & cuda::kItemPairedHeads) != 0;
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));

    // The REFERENCE step on the host cache.
    auto ref_md = ref_builder->build(0, host_common.common);
    Tensor ref_out(Shape{kBatch, H, D}, DType::bf16, Device::cpu);
    Tensor ref_lse(Shape{H, kBatch}, DType::f32, Device::cpu);
    ref_impl->do_kv_cache_update(scales, k_host.view().narrow(0, 0, live), v_host.view().narrow(0, 0, live),
                                 host_cache, *ref_md);
    ref_impl->forward(scales, q_host, {}, {}, host_cache, *ref_md, ref_out, {}, ref_lse);

    const Tensor out = output.to(Device::cpu);
    const Tensor out_lse = lse.to(Device::cpu);
    EXPECT_LE(gpu_test::rel_error(out.view().narrow(0, 0, live), ref_out.view().narrow(0, 0, live)), 8e-3);
    for (int h = 0; h < H; ++h) {
      for (int t = 0; t < live; ++t) {
        EXPECT_NEAR(out_lse.data_as<float>()[h * kBatch + t], ref_lse.data_as<float>()[h * kBatch + t], 2e-2)
            << "lse head " << h << " token " << t;
      }
    }
    const Tensor cache_back = dev_cache.to(Device::cpu);
    EXPECT_EQ(std::memcmp(cache_back.data(), host_cache.data(), host_cache.nbytes()), 0)
        << "the cache differs from the REFERENCE's: a padded slot was written or a live one was not";
  }
  EXPECT_EQ(paired, gc.replays_pair);

  // A plan older than the builder's latest is refused (its workspace was overwritten).
  EXPECT_THROW(cuda_impl->forward(scales, query, key, value, dev_cache, *capture_md, output, {}, lse), Error);

  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  set_current_cuda_stream(nullptr);
  cudaStreamDestroy(stream);
}

// Captured on a full decode batch; replayed with other lengths, padded requests, a mixed step with
// a 3-token chunk, one long request (split-KV), and an 8-token chunk (32 packed rows: a
// prefill-path item) run by the kernel captured for the decode batch (the decode-only kernel at
// head size 128: its 16-row slices).
TEST(CudaGraph, CaptureOnceReplayWithDifferentBatches) {
  PAGEDATTN_REQUIRE_GPU();
  GraphCase gc;
  gc.capture = {{1, 1, 1, 1, 1, 1, 1, 1}, {10, 20, 30, 40, 50, 60, 70, 80}};
  gc.steps = {
      {{1, 1, 1, 1, 1, 1, 1, 1}, {300, 5, 17, 600, 1, 129, 64, 250}},  // full batch, other lengths
      {{1, 1, 1, 1, 1, 0, 0, 0}, {33, 400, 2, 77, 500, 0, 0, 0}},      // 3 padded requests
      {{3, 1, 1, 0, 0, 0, 0, 0}, {90, 260, 0, 0, 0, 0, 0, 0}},         // mixed: a 3-token chunk
      {{1, 0, 0, 0, 0, 0, 0, 0}, {630, 0, 0, 0, 0, 0, 0, 0}},          // one long request (split-KV)
      {{8, 0, 0, 0, 0, 0, 0, 0}, {200, 0, 0, 0, 0, 0, 0, 0}},          // a prefill-path item
  };
  capture_and_replay(gc);
}

// fp8 at head size 64: decode plans over kv-head pairs (kItemPairedHeads, the decode-only kernel's)
// replayed by a graph captured on a mixed step, whose kernel (mma.sync) must run the paired items
// too. decode=decode pairs every decode batch (the automatic choice pairs only large ones).
TEST(CudaGraph, Fp8D64GraphsReplayPairedPlans) {
  PAGEDATTN_REQUIRE_GPU();
  const gpu_test::KernelOverrideScope decode_kernel("decode=decode");
  GraphCase gc;
  gc.heads = 16;
  gc.kv_heads = 4;
  gc.head = 64;
  gc.cache = DType::fp8_e4m3;
  gc.cache_name = "fp8_e4m3";
  gc.capture = {{5, 1, 1, 1, 0, 0, 0, 0}, {40, 20, 30, 40, 0, 0, 0, 0}};  // 5 tokens: a prefill-path item
  gc.capture_kernel = cuda::AttentionKernel::mma;
  gc.replays_pair = true;
  gc.steps = {
      {{1, 1, 1, 1, 1, 1, 1, 1}, {300, 5, 17, 600, 1, 129, 64, 250}},  // paired decode batch
      {{3, 1, 1, 0, 0, 0, 0, 0}, {90, 260, 0, 0, 0, 0, 0, 0}},         // mixed (unpaired)
      {{1, 1, 0, 0, 0, 0, 0, 0}, {630, 333, 0, 0, 0, 0, 0, 0}},        // paired, split-KV
  };
  capture_and_replay(gc);
}

TEST(CudaGraph, BadInputsThrowBeforeAnyWrite) {
  PAGEDATTN_REQUIRE_GPU();
  const AttentionBackend& cuda = cuda_backend();
  AttentionImplParams params;
  params.num_heads = 4;
  params.num_kv_heads = 4;
  params.head_size = 64;
  params.scale = 0.125f;
  params.dtype = DType::bf16;
  params.device = Device::cuda;
  auto impl = cuda.make_impl(params);
  const KVCacheSpec spec = KVCacheSpec::full_attention(16, 4, 64, DType::bf16);
  BuilderConfig config;
  config.num_heads = 4;
  config.num_kv_heads = 4;
  config.head_size = 64;
  config.max_num_seqs = 4;
  config.max_num_batched_tokens = 32;
  config.max_model_len = 256;
  auto builder = cuda.make_builder(spec, config, Device::cuda);
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0, 2};
  args.seq_lens = {20};
  args.max_num_blocks_per_req = 2;
  args.block_table = {3, 1};
  args.slot_mapping = {1 * 16 + 2, 1 * 16 + 3};
  OwnedCommonAttentionMetadata common = make_common_attention_metadata(args, Device::cuda, 8, 16);
  auto md = builder->build(0, common.common);
  Tensor cache = cuda.allocate_kv_cache(8, 16, 4, 64, DType::bf16, Device::cuda);
  cache.fill_bytes(0x11);
  Tensor q(Shape{2, 4, 64}, DType::bf16, Device::cuda);
  Tensor out(Shape{2, 4, 64}, DType::bf16, Device::cuda);
  Tensor wrong_dtype(Shape{2, 4, 64}, DType::f16, Device::cuda);
  Tensor wrong_heads(Shape{2, 3, 64}, DType::bf16, Device::cuda);
  Tensor host_q(Shape{2, 4, 64}, DType::bf16, Device::cpu);
  out.fill_bytes(0x22);
  LayerScales scales;
  EXPECT_THROW(impl->forward(scales, wrong_dtype, {}, {}, cache, *md, out), Error);
  EXPECT_THROW(impl->forward(scales, wrong_heads, {}, {}, cache, *md, out), Error);
  EXPECT_THROW(impl->forward(scales, host_q, {}, {}, cache, *md, out), Error);
  EXPECT_THROW(impl->forward(scales, q, {}, {}, cache, *md, wrong_dtype), Error);
  Tensor out_scale(Shape{1}, DType::f32, Device::cuda);
  EXPECT_THROW(impl->forward(scales, q, {}, {}, cache, *md, out, out_scale), Error);
  // A batch beyond the builder's construction limits is an error, not a resize.
  CommonAttentionMetadataArgs big = args;
  big.query_start_loc = {0, 40};
  big.seq_lens = {40};
  big.max_num_blocks_per_req = 3;
  big.block_table = {0, 1, 2};
  big.slot_mapping.assign(40, -1);
  OwnedCommonAttentionMetadata big_common = make_common_attention_metadata(big, Device::cuda, 8, 16);
  EXPECT_THROW(builder->build(0, big_common.common), Error);
  EXPECT_FALSE(builder->can_run_in_cudagraph(big_common.common));
  synchronize_cuda();
  const Tensor out_back = out.to(Device::cpu);
  const Tensor cache_back = cache.to(Device::cpu);
  for (size_t i = 0; i < out_back.nbytes(); ++i) ASSERT_EQ(static_cast<const uint8_t*>(out_back.data())[i], 0x22);
  for (size_t i = 0; i < cache_back.nbytes(); ++i) ASSERT_EQ(static_cast<const uint8_t*>(cache_back.data())[i], 0x11);
}

}  // namespace
}  // namespace pagedattn
