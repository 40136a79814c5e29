// `pagedattn plan-bench`: host time of planning one step, build() against build_for_drafting()
// (vLLM's drafting build: no cascade decision, no split-KV search), per backend, on one batch of
// --num-requests requests of a preset's layer shape. Each build is timed alone (steady_clock);
// the medians of --reps builds are reported with their ratio. Nothing runs on the device: only
// the builders' host work (on CUDA the builds also enqueue their plan copies).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>

#include "cli_common.h"
#include "commands.h"
#include "option_limits.h"
#include "option_parsing.h"
#include "pagedattn/pagedattn.h"
#include "presets.h"

namespace pagedattn::cli {

namespace {

using Clock = std::chrono::steady_clock;

struct PlanBenchFlags {
  std::string preset = "llama3-8b";
  int layer = 0;
  std::vector<std::string> backends;
  std::string device = "cpu";
  int num_requests = 256;
  int context = 2048;
  int query_len = 1;
  int common_prefix_len = 0;
  int block_size = 16;
  int threads = 0;
  int reps = 200;
  uint64_t seed = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

Command add_plan_bench_command(CLI::App& parent) {
  auto f = std::make_shared<PlanBenchFlags>();
  CLI::App* app = parent.add_subcommand(
      "plan-bench",
      "Host time of planning one step: build() against build_for_drafting() (the cheap plan of "
      "a speculative draft step: no cascade decision, no split-KV search) of each backend's "
      "metadata builder, on one batch of --num-requests requests (each --context cached tokens "
      "+ --query-len new ones, block tables shuffled) of a preset's layer shape. Medians of --reps "
      "builds of each, and their ratio.");
  app->add_option("--preset", f->preset, "model preset whose layer shape is planned")->capture_default_str();
  app->add_option("--layer", f->layer, "which layer of the preset (its pattern index)")
      ->capture_default_str()
      ->check(integer_option(0, kMaxInt));
  app->add_option("--backend", f->backends, "backend(s) to plan for (default: every usable one)")->delimiter(',');
  app->add_option("--device", f->device, "cpu or cuda")->capture_default_str();
  app->add_option("--num-requests", f->num_requests, "requests in the batch")
      ->capture_default_str()
      ->check(integer_option(1, kMaxNumSeqs));
  app->add_option("--context", f->context, "cached tokens of each request")
      ->capture_default_str()
      ->check(integer_option(0, 1 << 20));
  app->add_option("--query-len", f->query_len, "new tokens of each request (1 = decode)")
      ->capture_default_str()
      ->check(integer_option(1, 1 << 12));
  app->add_option("--common-prefix-len", f->common_prefix_len,
                  "tokens every request shares (the first blocks of every block table), passed to "
                  "build() as common_prefix_len: a multiple of --block-size, at most --context")
      ->capture_default_str()
      ->check(integer_option(0, 1 << 20));
  app->add_option("--block-size", f->block_size, "KV-cache block size")
      ->capture_default_str()
      ->check(integer_option(1, kMaxBlockSize));
  app->add_option("--threads", f->threads, "CPU threads the builders plan for (0 = OpenMP's default)")
      ->check(integer_option(0, kMaxThreads));
  app->add_option("--reps", f->reps, "builds timed of each kind (the median is reported)")
      ->capture_default_str()
      ->check(integer_option(1, 1000000));
  app->add_option("--seed", f->seed, "seed of the block-table shuffle")->capture_default_str()->check(seed_option());

  CommandAction action = [f](Streams& io) -> int {
    const ModelPreset& preset = find_preset(f->preset);
    if (f->layer < 0 || f->layer >= static_cast<int>(preset.pattern.size())) {
      throw UsageError("--layer: " + std::to_string(f->layer) + " is not a layer of " + preset.name +
                       "'s pattern: expected 0 to " + std::to_string(preset.pattern.size() - 1));
    }
    const LayerShape shape = preset.layer(f->layer);
    if (shape.kind == LayerKind::mla || shape.kind == LayerKind::chunked_local) {
      throw UsageError("--preset " + preset.name + " --layer " + std::to_string(f->layer) + ": " +
                       std::string(layer_kind_name(shape.kind)) +
                       " layers are not planned here; pick a full or sliding-window layer");
    }
    const int bs = f->block_size;
    if (f->common_prefix_len % bs != 0 || f->common_prefix_len > f->context) {
      throw UsageError("--common-prefix-len: " + std::to_string(f->common_prefix_len) +
                       " must be a multiple of --block-size " + std::to_string(bs) +
                       " and at most --context " + std::to_string(f->context));
    }
    const Device device = parse_device_flag(f->device, "--device");
    if (device == Device::cuda && cuda_device_count() == 0) {
      throw UsageError(std::string("--device cuda: ") +
                       (built_with_cuda() ? "no CUDA device is visible" : "this pagedattn was built without CUDA"));
    }
    const int threads = apply_thread_count(f->threads);

    // The batch: distinct shuffled blocks per request after the shared prefix blocks.
    const int seq = f->context + f->query_len;
    const int cols = (seq + bs - 1) / bs;
    const int prefix_blocks = f->common_prefix_len / bs;
    const int64_t total_blocks =
        prefix_blocks + static_cast<int64_t>(f->num_requests) * (cols - prefix_blocks);
    if (total_blocks > kMaxInt) throw UsageError("--num-requests x --context: too many blocks to plan");
    std::vector<int32_t> ids(static_cast<size_t>(total_blocks - prefix_blocks));
    std::iota(ids.begin(), ids.end(), prefix_blocks);
    std::mt19937_64 rng(f->seed);
    std::shuffle(ids.begin(), ids.end(), rng);
    CommonAttentionMetadataArgs args;
    args.query_start_loc.push_back(0);
    args.max_num_blocks_per_req = cols;
    size_t next = 0;
    for (int r = 0; r < f->num_requests; ++r) {
      for (int b = 0; b < cols; ++b) args.block_table.push_back(b < prefix_blocks ? b : ids[next++]);
      const int32_t* row = args.block_table.data() + static_cast<size_t>(r) * cols;
      for (int pos = f->context; pos < seq; ++pos) args.slot_mapping.push_back(int64_t{row[pos / bs]} * bs + pos % bs);
      args.query_start_loc.push_back(args.query_start_loc.back() + f->query_len);
      args.seq_lens.push_back(seq);
    }
    const OwnedCommonAttentionMetadata common =
        make_common_attention_metadata(args, device, total_blocks, bs);

    AttentionLayerParams p;
    p.num_heads = shape.num_heads;
    if (shape.num_kv_heads > 0) p.num_kv_heads = shape.num_kv_heads;
    p.head_size = shape.head_size;
    p.head_size_v = shape.head_size_v;
    if (shape.kind == LayerKind::sliding_window) p.sliding_window = shape.sliding_window;
    p.logits_soft_cap = shape.logits_soft_cap;
    if (shape.has_sinks) p.sinks.assign(static_cast<size_t>(shape.num_heads), 0.5f);
    p.block_size = bs;
    p.prefix = "plan_bench.layer";
    p.device = device;
    std::vector<const AttentionBackend*> backends;
    for (const std::string& name : f->backends) {
      const AttentionBackend* b = find_backend(name);
      if (b == nullptr) throw UsageError("--backend: unknown backend '" + name + "'");
      backends.push_back(b);
    }
    if (backends.empty()) {
      AttentionLayerParams probe = p;
      probe.backend.clear();
      const SelectorConfig sc = Attention(probe).selector_config();
      for (const BackendReport& r : explain_backends(sc)) {
        if (r.usable()) backends.push_back(r.backend);
      }
    }

    TextTable t({"backend", "batch", "build (median)", "build_for_drafting (median)", "drafting / build"});
    for (const AttentionBackend* b : backends) {
      p.backend = std::string(b->name());
      const Attention layer(p);  // Error (exit 3 / usage) when the backend cannot run the shape
      BuilderConfig config = layer.builder_config(f->num_requests, f->num_requests * f->query_len, seq);
      config.num_sms = device == Device::cuda ? 0 : threads;
      auto builder = b->make_builder(layer.kv_cache_spec(), config, device);
      std::vector<double> build_s, draft_s;
      (void)builder->build(f->common_prefix_len, common.common);  // warm-up (allocations)
      (void)builder->build_for_drafting(common.common, 0);
      for (int i = 0; i < f->reps; ++i) {
        auto t0 = Clock::now();
        auto md = builder->build(f->common_prefix_len, common.common);
        auto t1 = Clock::now();
        auto draft = builder->build_for_drafting(common.common, i);
        auto t2 = Clock::now();
        build_s.push_back(std::chrono::duration<double>(t1 - t0).count());
        draft_s.push_back(std::chrono::duration<double>(t2 - t1).count());
      }
      const double build = median(build_s), draft = median(draft_s);
      t.add_row({std::string(b->name()),
                 std::to_string(f->num_requests) + " x (" + std::to_string(f->context) + " + " +
                     std::to_string(f->query_len) + ")" +
                     (f->common_prefix_len > 0 ? ", prefix " + std::to_string(f->common_prefix_len) : ""),
                 format_seconds(build), format_seconds(draft), format_sig(draft / build, 3) + "x"});
    }
    io.out << "pagedattn plan-bench: " << preset.name << " layer " << f->layer << " (" << shape.describe() << ", "
           << shape.num_heads << " q / " << shape.num_kv_heads << " kv heads, d " << shape.head_size << "), "
           << device_name(device) << (device == Device::cpu ? " (" + std::to_string(threads) + " threads)" : "")
           << ", block " << bs << ", medians of " << f->reps << " builds each\n\n";
    t.print(io.out);
    return kExitOk;
  };
  return Command{app, action};
}

}  // namespace pagedattn::cli
