// Concurrent forwards on the host backends (DESIGN.md §1: a plan is an independent object; plans
// of one builder may run concurrently and stay correct). For CPU, REFERENCE, CPU_MLA (with the
// CPU and the REFERENCE prefill backends) and REFERENCE_MLA: 2-4 std::threads run forward many
// times, either on different plans of one builder or all on one shared plan, and every result
// must equal, bit for bit, the same forward run alone (the host kernels are deterministic: each
// work item and merge computes the same thing whichever OpenMP thread runs it).
// The builders use 4 threads so that decodes take the split-KV path (partial rows + merges).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "pagedattn/pagedattn.h"

namespace pagedattn {
namespace {

// normal(0, 1) values (never zeros), f32 or bf16.
Tensor random_tensor(Shape shape, DType dtype, std::mt19937& rng) {
  Tensor t(shape, dtype);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float x = dist(rng);
    if (dtype == DType::f32) t.data_as<float>()[i] = x;
    else t.data_as<uint16_t>()[i] = f32_to_bf16_bits(x);
  }
  return t;
}

Tensor poisoned_like(const Tensor& t) {
  Tensor out(t.shape(), t.dtype());
  out.fill_bytes(0xFF);
  return out;
}

float element(const Tensor& t, int64_t i) {
  return t.dtype() == DType::f32 ? t.data_as<float>()[i] : bf16_bits_to_f32(t.data_as<uint16_t>()[i]);
}

// Largest |a - b| (infinite when exactly one is NaN).
double max_abs_diff(const Tensor& a, const Tensor& b) {
  double worst = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = element(a, i), y = element(b, i);
    if (std::isnan(x) != std::isnan(y)) return INFINITY;
    if (!std::isnan(x)) worst = std::max(worst, std::abs(x - y));
  }
  return worst;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// One scheduler step of a batch: (context_len, query_len) per request, decodes first.
struct Step {
  std::vector<std::pair<int, int>> requests;
};

// The common metadata of `step` over a cache of `num_blocks` pages: each request gets its own
// shuffled pages; slot_mapping -1 everywhere (the forwards only read the cache).
OwnedCommonAttentionMetadata make_common(const Step& step, int block_size, int num_blocks,
                                         std::mt19937& rng) {
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0};
  int cols = 1;
  for (const auto& [context, query] : step.requests) {
    args.query_start_loc.push_back(args.query_start_loc.back() + query);
    args.seq_lens.push_back(context + query);
    cols = std::max(cols, (context + query + block_size - 1) / block_size);
  }
  args.max_num_blocks_per_req = cols;
  std::vector<int32_t> pages(static_cast<size_t>(num_blocks));
  for (int i = 0; i < num_blocks; ++i) pages[i] = i;
  std::shuffle(pages.begin(), pages.end(), rng);
  size_t next = 0;
  for (size_t r = 0; r < step.requests.size(); ++r) {
    for (int c = 0; c < cols; ++c) args.block_table.push_back(pages.at(next++));
  }
  args.slot_mapping.assign(static_cast<size_t>(args.query_start_loc.back()), -1);
  return make_common_attention_metadata(args);
}

// The steps every test plans: long decodes (split-KV on 4 threads), a spec decode, a prefill with
// context, a mixed batch.
std::vector<Step> steps() {
  return {Step{{{1500, 1}, {700, 1}}},
          Step{{{900, 3}, {40, 1}, {300, 1}}},
          Step{{{0, 1}, {130, 70}}},
          Step{{{1100, 1}, {200, 1}, {60, 33}, {0, 20}}}};
}

// The same steps ordered as MLA builders require: 1-token decodes first (stable).
std::vector<Step> mla_steps() {
  std::vector<Step> all = steps();
  for (Step& step : all) {
    std::stable_partition(step.requests.begin(), step.requests.end(),
                          [](const std::pair<int, int>& r) { return r.second == 1; });
  }
  return all;
}

// Forwards per thread: the REFERENCE oracles are slow (fp64, naive) and share nothing anyway.
int iterations_for(std::string_view backend) { return backend.starts_with("REFERENCE") ? 3 : 15; }

// One plan with its inputs, output buffers and its result when run alone.
struct PlanRun {
  OwnedCommonAttentionMetadata common;
  std::shared_ptr<const AttentionMetadata> plan;
  Tensor query, key, value;  // standard layers: key/value unused (the cache is read)
  Tensor kv_c, k_pe;         // MLA layers
  Tensor alone_output, alone_lse;
};

// Runs `forward(plan_index, output, lse)` on `num_threads` threads, `iterations` times each;
// thread t uses plan `plan_of(t)`. Returns a description of every result that differs from the
// plan's run alone (empty = all equal).
template <class Forward, class PlanOf>
std::string run_concurrently(std::vector<PlanRun>& runs, int num_threads, int iterations,
                             const PlanOf& plan_of, const Forward& forward) {
  std::vector<std::string> problems(static_cast<size_t>(num_threads));
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < num_threads; ++t) {
    threads.emplace_back([&, t] {
      PlanRun& run = runs[static_cast<size_t>(plan_of(t))];
      Tensor output = poisoned_like(run.alone_output);
      Tensor lse = poisoned_like(run.alone_lse);
      ready.fetch_add(1);
      while (ready.load() < num_threads) std::this_thread::yield();  // start together
      int wrong = 0;
      double worst = 0;
      for (int it = 0; it < iterations; ++it) {
        output.fill_bytes(0xFF);
        lse.fill_bytes(0xFF);
        try {
          forward(run, output, lse);
        } catch (const std::exception& e) {
          problems[t] = std::string("threw: ") + e.what();
          return;
        }
        if (!same_bytes(output, run.alone_output) || !same_bytes(lse, run.alone_lse)) {
          ++wrong;
          worst = std::max({worst, max_abs_diff(output, run.alone_output),
                            max_abs_diff(lse, run.alone_lse)});
        }
      }
      if (wrong > 0) {
        std::ostringstream os;
        os << "thread " << t << " (plan " << plan_of(t) << "): " << wrong << " of " << iterations
           << " forwards differ from the plan run alone, max abs diff " << worst << "; ";
        problems[t] = os.str();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  std::string all;
  for (const std::string& p : problems) all += p;
  return all;
}

// ---- standard layers (CPU, REFERENCE) --------------------------------------------------------

class StandardConcurrency : public ::testing::TestWithParam<const char*> {
 protected:
  static constexpr int kHeads = 8, kKvHeads = 2, kHeadSize = 64, kBlockSize = 16, kBlocks = 600;

  void SetUp() override {
    AttentionLayerParams p;
    p.num_heads = kHeads;
    p.head_size = kHeadSize;
    p.num_kv_heads = kKvHeads;
    p.scale = 0.125f;
    p.sliding_window = 1000;  // long decodes see a window, short ones everything
    p.dtype = DType::bf16;
    p.block_size = kBlockSize;
    p.prefix = "layers.0.attn";
    p.backend = GetParam();
    layer_ = std::make_unique<Attention>(p);
    BuilderConfig config = layer_->builder_config(8, 256, 2048);
    config.num_sms = 4;  // CPU: 4 threads, so the long decodes are split (partial rows)
    builder_ = layer_->backend().make_builder(layer_->kv_cache_spec(), config, Device::cpu);
    construction_bytes_ = builder_->workspace_bytes();
    std::mt19937 rng(17);
    Tensor cache = layer_->allocate_kv_cache(kBlocks);
    Tensor noise = random_tensor(cache.shape(), cache.dtype(), rng);
    std::memcpy(cache.data(), noise.data(), cache.nbytes());
    cache_ = std::move(cache);
    for (const Step& step : steps()) {
      PlanRun run;
      run.common = make_common(step, kBlockSize, kBlocks, rng);
      run.plan = builder_->build(0, run.common.common);
      const int64_t tokens = run.common.common.num_actual_tokens;
      run.query = random_tensor(Shape{tokens, kHeads, kHeadSize}, DType::bf16, rng);
      run.key = random_tensor(Shape{tokens, kKvHeads, kHeadSize}, DType::bf16, rng);
      run.value = random_tensor(Shape{tokens, kKvHeads, kHeadSize}, DType::bf16, rng);
      run.alone_output = Tensor(Shape{tokens, kHeads, kHeadSize}, DType::bf16);
      run.alone_lse = Tensor(Shape{kHeads, tokens}, DType::f32);
      runs_.push_back(std::move(run));
    }
    // Alone: one after another, on the calling thread, after every plan was built.
    for (PlanRun& run : runs_) forward(run, run.alone_output, run.alone_lse);
  }

  void forward(const PlanRun& run, const Tensor& output, const Tensor& lse) {
    layer_->impl().forward(layer_->scales(), run.query, run.key, run.value, cache_, *run.plan,
                           output, {}, lse);
  }

  std::unique_ptr<Attention> layer_;
  std::unique_ptr<AttentionMetadataBuilder> builder_;
  size_t construction_bytes_ = 0;
  Tensor cache_;
  std::vector<PlanRun> runs_;
};

TEST_P(StandardConcurrency, DifferentPlansOfOneBuilder) {
  // Forwards one after another (SetUp ran every plan once) never grow the workspace.
  EXPECT_EQ(builder_->workspace_bytes(), construction_bytes_);
  for (int threads : {2, 4}) {
    const std::string problems = run_concurrently(
        runs_, threads, iterations_for(GetParam()),
        [&](int t) { return t % static_cast<int>(runs_.size()); },
        [&](const PlanRun& run, const Tensor& out, const Tensor& lse) { forward(run, out, lse); });
    EXPECT_TRUE(problems.empty()) << GetParam() << ", " << threads << " threads: " << problems;
  }
  // Overlapping forwards got their own buffer sets: at most one per thread.
  EXPECT_LE(builder_->workspace_bytes(), 4 * construction_bytes_);
}

TEST_P(StandardConcurrency, OneSharedPlan) {
  for (int plan : {0, 3}) {
    const std::string problems = run_concurrently(
        runs_, 3, iterations_for(GetParam()), [&](int) { return plan; },
        [&](const PlanRun& run, const Tensor& out, const Tensor& lse) { forward(run, out, lse); });
    EXPECT_TRUE(problems.empty()) << GetParam() << ", plan " << plan << ": " << problems;
  }
}

// A plan does not depend on its builder's later work: built first, run after more builds, and
// after the builder is gone, it gives the same result.
TEST_P(StandardConcurrency, PlanOutlivesLaterBuildsAndItsBuilder) {
  std::mt19937 rng(3);
  for (const Step& step : steps()) {
    OwnedCommonAttentionMetadata later = make_common(step, kBlockSize, kBlocks, rng);
    builder_->build(0, later.common);
  }
  builder_.reset();
  for (PlanRun& run : runs_) {
    Tensor output = poisoned_like(run.alone_output), lse = poisoned_like(run.alone_lse);
    forward(run, output, lse);
    EXPECT_TRUE(same_bytes(output, run.alone_output) && same_bytes(lse, run.alone_lse))
        << GetParam() << ": max abs diff " << max_abs_diff(output, run.alone_output);
  }
}

INSTANTIATE_TEST_SUITE_P(HostBackends, StandardConcurrency, ::testing::Values("CPU", "REFERENCE"));

// ---- MLA layers (CPU_MLA with either prefill backend, REFERENCE_MLA) -----------------------------

struct MlaParam {
  const char* backend;
  const char* prefill_backend;
};

void PrintTo(const MlaParam& p, std::ostream* os) { *os << p.backend << "/" << p.prefill_backend; }

class MlaConcurrency : public ::testing::TestWithParam<MlaParam> {
 protected:
  static constexpr int kHeads = 4, kL = 64, kP = 32, kR = 16, kV = 32, kBlockSize = 16,
                       kBlocks = 600;

  void SetUp() override {
    MLAAttentionLayerParams p;
    p.num_heads = kHeads;
    p.scale = 0.15f;
    p.kv_lora_rank = kL;
    p.qk_nope_head_dim = kP;
    p.qk_rope_head_dim = kR;
    p.qk_head_dim = kP + kR;
    p.v_head_dim = kV;
    p.block_size = kBlockSize;
    p.dtype = DType::f32;
    p.prefix = "layers.0.attn";
    p.backend = GetParam().backend;
    p.prefill_backend = GetParam().prefill_backend;
    layer_ = std::make_unique<MLAAttention>(p);
    std::mt19937 rng(29);
    layer_->process_weights_after_loading(
        random_tensor(Shape{kHeads * (kP + kV), kL}, DType::f32, rng));
    // A small chunked-prefill workspace: the prefill with context takes several chunks.
    BuilderConfig config = layer_->builder_config(4, 256, 2048, 64);
    config.num_sms = 4;  // CPU_MLA decode: 4 threads, long decodes split
    builder_ = layer_->backend().make_builder(layer_->kv_cache_spec(), config, Device::cpu);
    construction_bytes_ = builder_->workspace_bytes();
    cache_ = layer_->allocate_kv_cache(kBlocks);
    Tensor noise = random_tensor(cache_.shape(), cache_.dtype(), rng);
    std::memcpy(cache_.data(), noise.data(), cache_.nbytes());
    for (const Step& step : mla_steps()) {
      PlanRun run;
      run.common = make_common(step, kBlockSize, kBlocks, rng);
      run.plan = builder_->build(0, run.common.common);
      const int64_t tokens = run.common.common.num_actual_tokens;
      run.query = random_tensor(Shape{tokens, kHeads, kP + kR}, DType::f32, rng);
      run.kv_c = random_tensor(Shape{tokens, kL}, DType::f32, rng);
      run.k_pe = random_tensor(Shape{tokens, kR}, DType::f32, rng);
      run.alone_output = Tensor(Shape{tokens, kHeads, kV}, DType::f32);
      run.alone_lse = Tensor(Shape{kHeads, tokens}, DType::f32);
      runs_.push_back(std::move(run));
    }
    for (PlanRun& run : runs_) forward(run, run.alone_output, run.alone_lse);
  }

  void forward(const PlanRun& run, const Tensor& output, const Tensor& lse) {
    layer_->impl().forward(layer_->scales(), run.query, run.kv_c, run.k_pe, cache_, *run.plan,
                           output, /*output_scale=*/{}, lse);
  }

  std::unique_ptr<MLAAttention> layer_;
  std::unique_ptr<AttentionMetadataBuilder> builder_;
  size_t construction_bytes_ = 0;
  Tensor cache_;
  std::vector<PlanRun> runs_;
};

TEST_P(MlaConcurrency, DifferentPlansOfOneBuilder) {
  EXPECT_EQ(builder_->workspace_bytes(), construction_bytes_);
  for (int threads : {2, 4}) {
    const std::string problems = run_concurrently(
        runs_, threads, iterations_for(GetParam().backend),
        [&](int t) { return t % static_cast<int>(runs_.size()); },
        [&](const PlanRun& run, const Tensor& out, const Tensor& lse) { forward(run, out, lse); });
    EXPECT_TRUE(problems.empty()) << GetParam().backend << "/" << GetParam().prefill_backend
                                  << ", " << threads << " threads: " << problems;
  }
  EXPECT_LE(builder_->workspace_bytes(), 4 * construction_bytes_);
}

TEST_P(MlaConcurrency, OneSharedPlan) {
  for (int plan : {0, 3}) {
    const std::string problems = run_concurrently(
        runs_, 3, iterations_for(GetParam().backend), [&](int) { return plan; },
        [&](const PlanRun& run, const Tensor& out, const Tensor& lse) { forward(run, out, lse); });
    EXPECT_TRUE(problems.empty()) << GetParam().backend << "/" << GetParam().prefill_backend
                                  << ", plan " << plan << ": " << problems;
  }
}

TEST_P(MlaConcurrency, PlanOutlivesLaterBuildsAndItsBuilder) {
  std::mt19937 rng(5);
  for (const Step& step : mla_steps()) {
    OwnedCommonAttentionMetadata later = make_common(step, kBlockSize, kBlocks, rng);
    builder_->build(0, later.common);
  }
  builder_.reset();
  for (PlanRun& run : runs_) {
    Tensor output = poisoned_like(run.alone_output), lse = poisoned_like(run.alone_lse);
    forward(run, output, lse);
    EXPECT_TRUE(same_bytes(output, run.alone_output) && same_bytes(lse, run.alone_lse))
        << GetParam().backend << ": max abs diff " << max_abs_diff(output, run.alone_output);
  }
}

INSTANTIATE_TEST_SUITE_P(HostBackends, MlaConcurrency,
                         ::testing::Values(MlaParam{"CPU_MLA", "CPU"},
                                           MlaParam{"CPU_MLA", "REFERENCE"},
                                           MlaParam{"REFERENCE_MLA", "REFERENCE"}),
                         [](const ::testing::TestParamInfo<MlaParam>& info) {
                           return std::string(info.param.backend) + "_" +
                                  info.param.prefill_backend;
                         });

}  // namespace
}  // namespace pagedattn
