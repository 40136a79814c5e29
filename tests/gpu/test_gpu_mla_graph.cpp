// CUDA_MLA under CUDA graphs (uniform_batch): one decode step of an MLA layer (cache write, the
// W_UK product, the latent decode kernel and its combine, the W_UV product) is captured ONCE on a
// batch of 8 decodes of q tokens each (q > 1: speculative decodes) and replayed with other batches after only a build() per step: other context lengths (one long
// enough to be split over every part), trailing padding requests (query_len 0, as vLLM pads a
// graph's batch), padding among the decodes (block-table rows gathered), and a single request.
// Each replay gets fresh metadata tensors (the capture's are gone) whose slot mapping holds only
// the step's tokens, so the graph must read the builder's own copies. Each replay is checked
// against REFERENCE_MLA (the fp64 oracle) doing the same step on a host copy of the cache: every
// live output row written and within tolerance, the LSE, and the WHOLE cache byte-identical (no
// padded slot written, every live one written). 16 heads (the mma.sync kernel; bf16 and fp8
// caches) and 128 heads (the wgmma kernel); q = 1, and q = 2 / 3 (16 x q rows a request: wgmma
// with a bf16 cache, the 64-row mma.sync kernel with fp8).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "pagedattn/device.h"
#include "pagedattn/mla.h"

namespace pagedattn {
namespace {

using gpu_test::random_host;
using gpu_test::rel_error;

constexpr int kL = 512, kR = 64, kP = 128, kV = 128;
constexpr int kBatch = 8, kBlock = 64, kCols = 40, kBlocks = kBatch * kCols + 4;

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// One step: per request (query_len, context_len); query_len 0 = padding.
using Step = std::vector<std::pair<int, int>>;

// `step` with every decode of query_len 1 made a decode of q tokens (same context before it).
Step with_tokens(Step step, int q) {
  for (auto& [len, ctx] : step) len = len == 1 ? q : len;
  return step;
}

CommonAttentionMetadataArgs step_args(const Step& step, std::mt19937_64& rng) {
  CommonAttentionMetadataArgs a;
  a.query_start_loc = {0};
  a.max_num_blocks_per_req = kCols;
  std::vector<int32_t> blocks(kBlocks);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  for (size_t r = 0; r < step.size(); ++r) {
    const auto [q, ctx] = step[r];
    const int seq = q > 0 ? ctx + q : 0;
    a.query_start_loc.push_back(a.query_start_loc.back() + q);
    a.seq_lens.push_back(seq);
    for (int c = 0; c < kCols; ++c) a.block_table.push_back(blocks[(r * kCols + c) % kBlocks]);
    for (int pos = seq - q; pos < seq; ++pos) {
      a.slot_mapping.push_back(int64_t{a.block_table[r * kCols + pos / kBlock]} * kBlock + pos % kBlock);
    }
  }
  return a;  // slot_mapping: the step's tokens only (the builder pads its copy with -1)
}

struct GraphCase {
  int heads;
  const char* kv_cache_dtype;
  int tokens;  // q, every decode's query_len (the builders' num_speculative_tokens = q - 1)
  std::vector<Step> replays;  // written with query_len 1 for a decode (with_tokens makes it q)  // contexts kept short: the fp64 oracle up-projects every key per head
};

void run_graph_case(const GraphCase& c) {
  SCOPED_TRACE(detail::concat(c.heads, " heads, kv ", c.kv_cache_dtype, ", ", c.tokens, " tokens a decode"));
  const int rows = kBatch * c.tokens;  // the captured token rows
  const DType dtype = DType::bf16;
  const bool fp8 = std::string(c.kv_cache_dtype) != "auto";
  MLAAttention ref(gpu_test::deepseek_mla_params(c.heads, c.kv_cache_dtype, kBlock, "REFERENCE_MLA", Device::cpu));
  MLAAttention dev(gpu_test::deepseek_mla_params(c.heads, c.kv_cache_dtype, kBlock, "CUDA_MLA", Device::cuda));
  for (MLAAttention* layer : {&ref, &dev}) layer->scales().k_scale = fp8 ? 0.05f : 1.f;
  const Tensor w = random_host(Shape{int64_t{c.heads} * (kP + kV), kL}, dtype, 5, -0.08f, 0.08f);
  ref.process_weights_after_loading(w);
  dev.process_weights_after_loading(w.to(Device::cuda));

  // Both caches hold the same stale rows (written through the op, so fp8 bytes are values).
  Tensor cache_h = ref.allocate_kv_cache(kBlocks);
  {
    const int64_t n = int64_t{kBlocks} * kBlock;
    std::vector<int64_t> all(static_cast<size_t>(n));
    std::iota(all.begin(), all.end(), 0);
    Tensor slots(Shape{n}, DType::i64, Device::cpu);
    std::copy(all.begin(), all.end(), slots.data_as<int64_t>());
    const Tensor rows = random_host(Shape{n, kL + kR}, dtype, 6, -2.f, 2.f);
    concat_and_cache_mla(rows.view().narrow(1, 0, kL), rows.view().narrow(1, kL, kR), cache_h, slots,
                         c.kv_cache_dtype, ref.scales().k_scale);
  }
  Tensor cache_d = cache_h.to(Device::cuda);

  const int max_len = kCols * kBlock;
  const auto config = [&](const MLAAttention& layer) {
    BuilderConfig b = layer.builder_config(kBatch, 2 * rows, max_len);
    b.num_speculative_tokens = c.tokens - 1;
    return b;
  };
  auto ref_builder = ref.backend().make_builder(ref.kv_cache_spec(), config(ref), Device::cpu);
  auto dev_builder = dev.backend().make_builder(dev.kv_cache_spec(), config(dev), Device::cuda);
  EXPECT_EQ(dev_builder->cudagraph_support(), CudaGraphSupport::uniform_batch);

  // The layer's persistent inputs and outputs (fixed addresses, as an engine's graph buffers).
  Tensor q(Shape{rows, c.heads, kP + kR}, dtype, Device::cuda);
  Tensor kv_c(Shape{rows, kL}, dtype, Device::cuda);
  Tensor k_pe(Shape{rows, kR}, dtype, Device::cuda);
  Tensor out(Shape{rows, c.heads, kV}, dtype, Device::cuda);
  Tensor lse(Shape{c.heads, rows}, DType::f32, Device::cuda);

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  set_current_cuda_stream(stream);
  std::mt19937_64 rng(17);
  uint64_t seed = 100;

  // Runs `step` on the host oracle (cache_h) with the live rows of fresh inputs, which it also
  // copies into the device buffers; returns the oracle's output and LSE.
  struct Oracle {
    Tensor out, lse;
    int live = 0;
  };
  const auto oracle_step = [&](const CommonAttentionMetadataArgs& args) {
    const OwnedCommonAttentionMetadata common = make_common_attention_metadata(args, Device::cpu, kBlocks, kBlock);
    const int live = common.common.num_actual_tokens;
    const Tensor q_h = random_host(Shape{rows, c.heads, kP + kR}, dtype, seed++);
    const Tensor c_h = random_host(Shape{rows, kL}, dtype, seed++);
    const Tensor pe_h = random_host(Shape{rows, kR}, dtype, seed++);
    q.copy_from(q_h);
    kv_c.copy_from(c_h);
    k_pe.copy_from(pe_h);
    Oracle o{Tensor(Shape{live, c.heads, kV}, dtype, Device::cpu), Tensor(Shape{c.heads, live}, DType::f32, Device::cpu),
             live};
    const auto md = ref_builder->build(0, common.common);
    ref.forward(q_h.view().narrow(0, 0, live), c_h.view().narrow(0, 0, live), pe_h.view().narrow(0, 0, live), cache_h,
                *md, o.out, o.lse);
    return o;
  };

  // Capture on a full batch of decodes, after one eager run of the same step (lazy cuBLAS and
  // kernel state must exist before a capture); the oracle mirrors that eager step.
  const Step capture_step =
      with_tokens({{1, 10}, {1, 60}, {1, 33}, {1, 64}, {1, 100}, {1, 1}, {1, 29}, {1, 90}}, c.tokens);
  const CommonAttentionMetadataArgs capture_args = step_args(capture_step, rng);
  const OwnedCommonAttentionMetadata capture_common =
      make_common_attention_metadata(capture_args, Device::cuda, kBlocks, kBlock);
  EXPECT_TRUE(dev_builder->can_run_in_cudagraph(capture_common.common));
  auto capture_md = dev_builder->build_for_cudagraph_capture(capture_common.common);
  (void)oracle_step(capture_args);
  dev.forward(q, kv_c, k_pe, cache_d, *capture_md, out, lse);
  CUDA_OK(cudaStreamSynchronize(stream));
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  dev.forward(q, kv_c, k_pe, cache_d, *capture_md, out, lse);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  const std::vector<Step>& steps = c.replays;
  for (size_t si = 0; si < steps.size(); ++si) {
    SCOPED_TRACE(detail::concat("replay ", si));
    const CommonAttentionMetadataArgs args = step_args(with_tokens(steps[si], c.tokens), rng);
    const Oracle want = oracle_step(args);
    const int live = want.live;
    {
      // Fresh device metadata, gone before the replay runs: the graph reads the builder's copies.
      const OwnedCommonAttentionMetadata common = make_common_attention_metadata(args, Device::cuda, kBlocks, kBlock);
      EXPECT_TRUE(dev_builder->can_run_in_cudagraph(common.common));
      out.fill_bytes(0xFF);
      lse.fill_bytes(0xFF);
      (void)dev_builder->build(0, common.common);
      CUDA_OK(cudaStreamSynchronize(stream));
    }
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    const Tensor got = out.to(Device::cpu);
    const Tensor got_lse = lse.to(Device::cpu);
    const TensorView got_live = got.view().narrow(0, 0, live);
    for (int64_t i = 0; i < got_live.numel(); ++i) {
      ASSERT_TRUE(std::isfinite(load_f64(got_live.data(), dtype, i))) << "output element " << i << " not written";
    }
    EXPECT_LE(rel_error(got_live, want.out), fp8 ? 6e-2 : 8e-3);
    double lse_err = 0;
    for (int h = 0; h < c.heads; ++h) {
      for (int t = 0; t < live; ++t) {
        lse_err = std::max(lse_err, std::abs(double(got_lse.data_as<float>()[h * rows + t]) -
                                             want.lse.data_as<float>()[h * live + t]));
      }
    }
    EXPECT_LT(lse_err, fp8 ? 5e-2 : 2e-2);
    const Tensor cache_back = cache_d.to(Device::cpu);
    EXPECT_EQ(std::memcmp(cache_back.data(), cache_h.data(), cache_h.nbytes()), 0)
        << "the cache differs from the oracle's: a padded slot was written or a live one was not";
  }

  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  set_current_cuda_stream(nullptr);
  cudaStreamDestroy(stream);
}

// The replays: other lengths (a request split over many parts: at 16 heads every SM is a part,
// so a few hundred keys are cut), trailing padding (vLLM's padded graph batches), padding among
// the decodes (rows gathered), a single request. Written with query_len 1 a decode: with_tokens
// makes each a decode of the case's q tokens.
const Step kOtherLengths = {{1, 700}, {1, 5}, {1, 17}, {1, 300}, {1, 1}, {1, 129}, {1, 64}, {1, 250}};
const Step kTrailingPadding = {{1, 33}, {1, 400}, {1, 2}, {1, 77}, {1, 200}, {0, 0}, {0, 0}, {0, 0}};
const Step kPaddingAmong = {{1, 90}, {0, 0}, {1, 130}, {1, 7}, {0, 0}, {1, 200}, {0, 0}, {0, 0}};
const Step kOneRequest = {{1, 900}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}};

TEST(CudaMlaGraph, CaptureOnceReplayOtherDecodeBatches) {
  PAGEDATTN_REQUIRE_GPU();
  const char* small = std::getenv("PAGEDATTN_GPU_SMALL_GRID");  // the sanitizer runs
  if (small != nullptr && *small == '1') {
    run_graph_case({16, "auto", 1, {kTrailingPadding, kPaddingAmong}});
    run_graph_case({16, "auto", 3, {kPaddingAmong}});
    return;
  }
  run_graph_case({16, "auto", 1, {kOtherLengths, kTrailingPadding, kPaddingAmong, kOneRequest}});
  run_graph_case({16, "fp8_e4m3", 1, {kTrailingPadding, kPaddingAmong, kOneRequest}});
  run_graph_case({128, "auto", 1, {kPaddingAmong, {{1, 300}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}}}});
}

// Speculative decodes (uniform_batch): every decode of q = 1 + k tokens, each token masked at its
// own causal end, captured once and replayed with other lengths and padding.
TEST(CudaMlaGraph, CaptureOnceReplaySpeculativeDecodeBatches) {
  PAGEDATTN_REQUIRE_GPU();
  run_graph_case({16, "auto", 3, {kOtherLengths, kTrailingPadding, kPaddingAmong, kOneRequest}});
  run_graph_case({16, "fp8_e4m3", 2, {kTrailingPadding, kPaddingAmong}});
  run_graph_case({128, "auto", 2, {kPaddingAmong, kOneRequest}});
}

// Only uniform decode batches are captured: a prefill (query_len past the reorder threshold),
// decodes of unequal query_len and a batch of padding only are refused by
// build_for_cudagraph_capture with an Error naming common.
TEST(CudaMlaGraph, CaptureRefusesOtherBatches) {
  PAGEDATTN_REQUIRE_GPU();
  MLAAttention dev(gpu_test::deepseek_mla_params(16, "auto", kBlock, "CUDA_MLA", Device::cuda));
  BuilderConfig config = dev.builder_config(kBatch, 64, kCols * kBlock);
  config.num_speculative_tokens = 2;  // decodes of up to 3 tokens
  auto builder = dev.backend().make_builder(dev.kv_cache_spec(), config, Device::cuda);
  std::mt19937_64 rng(3);
  for (const Step& step : {Step{{1, 20}, {5, 40}}, Step{{2, 20}, {0, 0}, {3, 40}}, Step{{0, 0}, {0, 0}}}) {
    const OwnedCommonAttentionMetadata common =
        make_common_attention_metadata(step_args(step, rng), Device::cuda, kBlocks, kBlock);
    EXPECT_FALSE(builder->can_run_in_cudagraph(common.common));
    try {
      (void)builder->build_for_cudagraph_capture(common.common);
      ADD_FAILURE() << "expected an Error";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "common") << e.what();
    }
  }
  // Uniform decodes of 3 tokens with padding are accepted.
  const OwnedCommonAttentionMetadata ok =
      make_common_attention_metadata(step_args(Step{{3, 20}, {0, 0}, {3, 9}}, rng), Device::cuda, kBlocks, kBlock);
  EXPECT_TRUE(builder->can_run_in_cudagraph(ok.common));
}

}  // namespace
}  // namespace pagedattn
