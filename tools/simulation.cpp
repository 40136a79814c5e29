// The serving simulation (see simulation.h for the data flow).
#include "simulation.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ostream>
#include <random>
#include <span>

#include "cli_common.h"
#include "option_limits.h"
#include "progress.h"
#include "pagedattn/pagedattn.h"
#include "run_checks.h"
#include "simulation_state.h"
#include "work_model.h"

namespace pagedattn::cli {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int cdiv(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// The library's selector lists every backend on its own line: one line here.
std::string one_line(std::string text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\n') {
      while (i + 1 < text.size() && text[i + 1] == ' ') ++i;
      out += out.empty() || out.back() == ':' ? " " : "; ";
    } else {
      out += text[i];
    }
  }
  return out;
}

bool is_selector_error(const Error& e) {
  return e.argument().empty() || e.argument() == "backend" || e.argument() == "PAGEDATTN_BACKEND";
}

bool same_builder_config(const BuilderConfig& a, const BuilderConfig& b) {
  return a.num_heads == b.num_heads && a.num_kv_heads == b.num_kv_heads && a.head_size == b.head_size &&
         a.head_size_v == b.head_size_v && a.max_num_seqs == b.max_num_seqs &&
         a.max_num_batched_tokens == b.max_num_batched_tokens && a.max_model_len == b.max_model_len &&
         a.sliding_window == b.sliding_window && a.use_alibi == b.use_alibi && a.attn_type == b.attn_type &&
         a.num_sms == b.num_sms && a.batch_invariant == b.batch_invariant &&
         a.num_speculative_tokens == b.num_speculative_tokens &&
         a.mla_dimensions == b.mla_dimensions && a.mla_dtype == b.mla_dtype &&
         a.mla_chunked_prefill_workspace_tokens == b.mla_chunked_prefill_workspace_tokens;
}

void fill_normal(Tensor& t, uint64_t seed, float stddev = 1.f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, stddev);
  for (int64_t i = 0; i < t.numel(); ++i) store_f32(t.data(), t.dtype(), i, normal(rng));
}


// "sliding_window 128, kv 2 x 64 bfloat16, 8 KiB/block"
std::string spec_summary(const KVCacheSpec& spec) {
  std::string s(kv_cache_spec_kind_name(spec.kind));
  if (spec.kind == KVCacheSpecKind::sliding_window) s += " " + std::to_string(spec.sliding_window);
  if (spec.kind == KVCacheSpecKind::chunked_local_attention) s += " " + std::to_string(spec.attention_chunk_size);
  s += ", kv " + std::to_string(spec.num_kv_heads) + " x " + std::to_string(spec.head_size);
  if (spec.head_size_v > 0 && spec.head_size_v != spec.head_size) s += "/" + std::to_string(spec.head_size_v);
  s += " " + std::string(dtype_name(spec.dtype)) + ", " + format_sig(spec.page_size_bytes() / 1024.0, 3) + " KiB/block";
  return s;
}

}  // namespace

int Simulation::State::add_group(std::vector<GroupState>& list, const LayerState& l, bool reference,
                                 Device device) {
  const int max_len = scheduler->max_request_len();
  const LayerShape& shape = l.shape;
  const AttentionBackend& backend = reference ? (l.mla ? l.ref_mla->backend() : l.ref_layer->backend()) : l.backend();
  BuilderConfig config;
  KVCacheSpec spec;
  if (l.mla) {
    const MLAAttention& layer = reference ? *l.ref_mla : *l.mla;
    config = layer.builder_config(options.max_num_seqs, options.max_num_batched_tokens, max_len);
    spec = layer.kv_cache_spec();
  } else {
    const Attention& layer = reference ? *l.ref_layer : *l.layer;
    config = layer.builder_config(options.max_num_seqs, options.max_num_batched_tokens, max_len);
    spec = layer.kv_cache_spec();
  }
  config.num_sms = device == Device::cuda ? num_sms : threads;
  config.batch_invariant = options.batch_invariant;
  config.num_speculative_tokens = options.num_speculative_tokens;
  // --dcp: a rank's step has one request per prefill row held elsewhere (dcp.h).
  if (dcp() && !reference) {
    config.max_num_seqs = std::max(config.max_num_seqs, options.max_num_batched_tokens);
    config.mla_chunked_prefill_workspace_tokens = 0;  // vLLM's rule for the larger max_num_seqs
  }
  for (size_t g = 0; g < list.size(); ++g) {
    if (list[g].backend == &backend && list[g].spec == spec && same_builder_config(list[g].config, config)) {
      return static_cast<int>(g);
    }
  }
  GroupState group;
  group.backend = &backend;
  group.spec = spec;
  group.config = config;
  group.shape = shape;
  group.builder = backend.make_builder(spec, config, device);
  if (dcp() && !reference) {
    for (int r = 1; r < options.dcp_world_size; ++r) {
      const DcpRanks::OnRank scope(*dcp_ranks, r);
      group.rank_builders.push_back(backend.make_builder(spec, config, device));
    }
  }
  list.push_back(std::move(group));
  return static_cast<int>(list.size()) - 1;
}

Simulation::Simulation(RunOptions options) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.options = std::move(options);
  RunOptions& o = s.options;
  // Every option against its limit before anything is allocated or set (run_checks.h).
  validate_run_options(o);
  s.preset = &find_preset(o.preset);
  s.threads = apply_thread_count(o.threads);
  s.num_sms = o.device == Device::cuda ? gpu_sm_count(0) : s.threads;
  s.rng.seed(o.seed);

  std::vector<LayerShape> shapes = s.preset->layers(o.num_layers);
  for (LayerShape& shape : shapes) {
    const int tp = o.tensor_parallel_size;
    if (shape.num_heads % tp != 0) {
      throw UsageError("--tensor-parallel-size: " + std::to_string(tp) + " does not divide the " +
                       std::to_string(shape.num_heads) + " query heads of " + s.preset->name);
    }
    shape.num_heads /= tp;
    // KV heads are split when they divide evenly and replicated otherwise (vLLM); MLA keeps its
    // one latent head.
    if (shape.kind != LayerKind::mla) {
      if (shape.num_kv_heads >= tp && shape.num_kv_heads % tp != 0) {
        throw UsageError("--tensor-parallel-size: " + std::to_string(tp) + " does not divide the " +
                         std::to_string(shape.num_kv_heads) + " KV heads of " + s.preset->name);
      }
      shape.num_kv_heads = std::max(1, shape.num_kv_heads / tp);
    }
  }
  for (const LayerShape& shape : shapes) {
    if (shape.kind == LayerKind::chunked_local && shape.attention_chunk_size % o.block_size != 0) {
      throw UsageError("--block-size: " + std::to_string(o.block_size) + " does not divide the attention_chunk_size " +
                       std::to_string(shape.attention_chunk_size) + " of " + s.preset->name +
                       "'s chunked local layers (make_local_attention_virtual_batches needs whole blocks per chunk)");
    }
  }

  if (s.dcp()) {
    s.dcp_ranks = std::make_unique<DcpRanks>(o.dcp_world_size, o.device);
    s.dcp_rank_seconds.assign(static_cast<size_t>(o.dcp_world_size), 0.0);
  }
  // Rank r's objects (--dcp, r >= 1) are made with its GPU current (on CUDA).
  const auto on_rank = [&](int r) { return DcpRanks::OnRank(*s.dcp_ranks, r); };

  // ---- layers (the selector picks each layer's backend) -----------------------------------------
  std::mt19937_64 sink_rng(o.seed ^ 0x51A5u);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (size_t i = 0; i < shapes.size(); ++i) {
    const LayerShape& shape = shapes[i];
    std::string name = "model.layers." + std::to_string(i) + ".self_attn.attn";
    if (shape.kind == LayerKind::mla) {
      MLAAttentionLayerParams p;
      p.num_heads = shape.num_heads;
      if (shape.scale > 0.f) p.scale = shape.scale;  // presets: 0 = unset (the layer's default)
      p.kv_lora_rank = shape.kv_lora_rank;
      p.qk_nope_head_dim = shape.qk_nope_head_dim;
      p.qk_rope_head_dim = shape.qk_rope_head_dim;
      p.qk_head_dim = shape.qk_nope_head_dim + shape.qk_rope_head_dim;
      p.v_head_dim = shape.v_head_dim;
      p.kv_cache_dtype = o.kv_cache_dtype;
      p.block_size = o.block_size;
      p.prefix = name;
      p.dtype = o.dtype;
      p.device = o.device;
      p.backend = o.backend;
      p.dcp = s.dcp_config(0);
      LayerState ls;
      ls.shape = shape;
      try {
        ls.mla = std::make_unique<MLAAttention>(p);
        for (int r = 1; r < o.dcp_world_size; ++r) {
          p.dcp.rank = r;
          const auto scope = on_rank(r);
          ls.rank_mla.push_back(std::make_unique<MLAAttention>(p));
        }
      } catch (const Error& e) {
        std::string msg = s.preset->name + ": layer " + name + " (MLA, latent " + std::to_string(shape.kv_lora_rank) +
                          "+" + std::to_string(shape.qk_rope_head_dim) + ", " + std::to_string(shape.num_heads) +
                          " heads) cannot run: " + one_line(e.what());
        if (is_selector_error(e)) throw UnsupportedConfiguration(msg);
        throw UsageError(msg);
      }
      s.layers.push_back(std::move(ls));
      continue;
    }
    AttentionLayerParams p;
    p.num_heads = shape.num_heads;
    p.head_size = shape.head_size;
    p.head_size_v = shape.head_size_v;
    if (shape.scale > 0.f) p.scale = shape.scale;  // presets: 0 = unset (the layer's default)
    if (shape.num_kv_heads > 0) p.num_kv_heads = shape.num_kv_heads;
    if (shape.kind == LayerKind::sliding_window) p.sliding_window = shape.sliding_window;
    if (shape.kind == LayerKind::chunked_local) p.attention_chunk_size = shape.attention_chunk_size;
    p.logits_soft_cap = shape.logits_soft_cap;
    if (shape.has_sinks) {
      for (int h = 0; h < shape.num_heads; ++h) p.sinks.push_back(normal(sink_rng));
    }
    p.kv_cache_dtype = o.kv_cache_dtype;
    p.block_size = o.block_size;
    p.prefix = name;
    p.dtype = o.dtype;
    p.device = o.device;
    p.backend = o.backend;
    p.dcp = s.dcp_config(0);
    if (s.dcp() && (shape.kind != LayerKind::full || shape.has_sinks)) {
      throw UsageError("--dcp: layer " + name + " of " + s.preset->name + " (" + shape.describe() +
                       ") cannot run striped: decode context parallelism supports full attention without sinks, "
                       "ALiBi, sliding windows or chunked local attention (and MLA)");
    }
    LayerState ls;
    ls.shape = shape;
    try {
      ls.layer = std::make_unique<Attention>(p);
      for (int r = 1; r < o.dcp_world_size; ++r) {
        p.dcp.rank = r;
        const auto scope = on_rank(r);
        ls.rank_layers.push_back(std::make_unique<Attention>(p));
      }
    } catch (const Error& e) {
      std::string msg = s.preset->name + ": layer " + name + " (" + shape.describe() + ") cannot run: " + one_line(e.what());
      if (is_selector_error(e)) throw UnsupportedConfiguration(msg);
      throw UsageError(msg);
    }
    s.layers.push_back(std::move(ls));
  }

  // Activations: the largest q/k/v row and output row of any layer (elements per token).
  int64_t per_token = 0, out_per_token = 0;
  for (const LayerState& l : s.layers) {
    const LayerShape& sh = l.shape;
    if (l.mla) {  // q (T, H, P + R), kv_c (T, L), k_pe (T, R); output (T, H, V)
      per_token = std::max<int64_t>({per_token, int64_t{sh.num_heads} * (sh.qk_nope_head_dim + sh.qk_rope_head_dim),
                                     int64_t{sh.kv_lora_rank}});
      out_per_token = std::max<int64_t>(out_per_token, int64_t{sh.num_heads} * sh.v_head_dim);
      continue;
    }
    per_token = std::max<int64_t>({per_token, int64_t{sh.num_heads} * sh.head_size,
                                   int64_t{sh.num_kv_heads} * std::max(sh.head_size, sh.value_head_size())});
    out_per_token = std::max<int64_t>(out_per_token, int64_t{sh.num_heads} * sh.value_head_size());
  }
  const int64_t max_tokens = o.max_num_batched_tokens;
  s.pool_slack = 1 << 16;

  // ---- workload and scheduler ----------------------------------------------------------------------
  std::vector<RequestSpec> requests = generate_workload(o.workload);
  SchedulerConfig sc;
  sc.block_size = o.block_size * o.dcp_world_size;  // --dcp: virtual blocks of N x block_size tokens
  sc.max_num_batched_tokens = o.max_num_batched_tokens;
  sc.max_num_seqs = o.max_num_seqs;
  sc.max_model_len = o.max_model_len > 0 ? o.max_model_len : s.preset->max_model_len;
  sc.chunked_prefill = o.chunked_prefill;
  sc.long_prefill_token_threshold = o.long_prefill_token_threshold;
  sc.num_speculative_tokens = o.num_speculative_tokens;
  sc.spec_acceptance_rate = o.spec_acceptance_rate;
  sc.spec_seed = o.seed ^ 0x5bec5bec5bec5becull;
  int64_t page_bytes = 0;  // one block in every layer's cache (--dcp: on every rank)
  for (const LayerState& l : s.layers) page_bytes += l.kv_cache_spec().page_size_bytes();
  page_bytes *= o.dcp_world_size;
  if (o.num_blocks > 0) {
    sc.num_blocks = o.num_blocks;
  } else {
    int64_t all_at_once = 1;
    for (const RequestSpec& r : requests) all_at_once += cdiv(int64_t{r.prompt_len} + r.output_len - 1, sc.block_size);
    int64_t fits = static_cast<int64_t>(o.kv_cache_gib * double(int64_t{1} << 30) / double(page_bytes));
    sc.num_blocks = static_cast<int>(std::clamp<int64_t>(std::min(all_at_once, fits), 0, kMaxNumBlocks));
    if (sc.num_blocks < 1) {
      throw UsageError("--kv-cache-gib: " + format_sig(o.kv_cache_gib) + " GiB holds no block of " +
                       std::to_string(page_bytes) + " bytes (all layers)");
    }
  }
  s.check = o.check.value_or(s.preset->name == "tiny");
  if (o.check_invariance) s.invariance = std::make_unique<InvarianceChecker>(o.seed, o.device);
  RunMemory memory;
  memory.num_layers = static_cast<int>(s.layers.size());
  memory.page_bytes = page_bytes;
  memory.num_blocks = sc.num_blocks;
  memory.automatic_num_blocks = o.num_blocks == 0;
  memory.check = s.check;
  // The pool (host, and its device copy), the output and --check's reference output.
  memory.activation_bytes = static_cast<int64_t>(dtype_size(o.dtype)) *
                            (max_tokens * per_token + s.pool_slack + 2 * max_tokens * out_per_token);
  check_run_memory(o, memory);
  try {
    s.scheduler = std::make_unique<Scheduler>(sc, std::move(requests));
  } catch (const UsageError& e) {
    if (o.num_blocks == 0 && std::string(e.what()).rfind("--num-blocks", 0) == 0) {
      throw UsageError(std::string(e.what()) + " (the automatic count is capped by --kv-cache-gib " +
                       format_sig(o.kv_cache_gib) + ")");
    }
    throw;
  }

  // ---- caches and builders --------------------------------------------------------------------------
  s.tolerance = check_tolerance(o.dtype, o.kv_cache_dtype);
  for (size_t i = 0; i < s.layers.size(); ++i) {
    LayerState& l = s.layers[i];
    l.cache = l.allocate_kv_cache(sc.num_blocks);
    s.kv_cache_bytes += static_cast<int64_t>(l.cache.nbytes());
    s.kv_cache_bytes_per_rank += static_cast<int64_t>(l.cache.nbytes());
    for (int r = 1; r < o.dcp_world_size; ++r) {
      const auto scope = on_rank(r);
      l.rank_caches.push_back(l.mla ? l.rank_mla[static_cast<size_t>(r - 1)]->allocate_kv_cache(sc.num_blocks)
                                    : l.rank_layers[static_cast<size_t>(r - 1)]->allocate_kv_cache(sc.num_blocks));
      s.kv_cache_bytes += static_cast<int64_t>(l.rank_caches.back().nbytes());
    }
    l.group = s.add_group(s.groups, l, false, o.device);
    s.groups[static_cast<size_t>(l.group)].layers.push_back(static_cast<int>(i));
    if (l.mla) {
      if (!s.kv_b_proj_host.defined()) {
        const LayerShape& sh = l.shape;
        s.kv_b_proj_host = Tensor(Shape{int64_t{sh.num_heads} * (sh.qk_nope_head_dim + sh.v_head_dim), sh.kv_lora_rank},
                                  o.dtype, Device::cpu);
        fill_normal(s.kv_b_proj_host, o.seed ^ 0xB0B0u, 1.f / std::sqrt(static_cast<float>(sh.kv_lora_rank)));
        if (o.device != Device::cpu) s.kv_b_proj_device = s.kv_b_proj_host.to(o.device);
      }
      l.mla->process_weights_after_loading(o.device == Device::cpu ? s.kv_b_proj_host.view() : s.kv_b_proj_device.view());
      for (size_t r = 0; r < l.rank_mla.size(); ++r) {
        const auto scope = on_rank(static_cast<int>(r) + 1);
        const Tensor weight = o.device == Device::cpu ? Tensor() : s.kv_b_proj_host.to(o.device);  // on GPU r
        l.rank_mla[r]->process_weights_after_loading(weight.defined() ? weight.view() : s.kv_b_proj_host.view());
      }
      if (s.check) {
        MLAAttentionLayerParams rp = l.mla->params();
        rp.backend = "REFERENCE_MLA";
        rp.prefill_backend = "";
        rp.device = Device::cpu;
        rp.block_size = sc.block_size;  // --dcp: the unsharded layout of the virtual blocks
        rp.dcp = DcpConfig{};
        try {
          l.ref_mla = std::make_unique<MLAAttention>(rp);
        } catch (const Error& e) {
          throw UnsupportedConfiguration("--check: the REFERENCE_MLA backend cannot run layer " + rp.prefix + ": " +
                                         one_line(e.what()));
        }
        l.ref_mla->process_weights_after_loading(s.kv_b_proj_host.view());
        l.ref_cache = l.ref_mla->allocate_kv_cache(sc.num_blocks);
        l.ref_group = s.add_group(s.ref_groups, l, true, Device::cpu);
        s.ref_groups[static_cast<size_t>(l.ref_group)].layers.push_back(static_cast<int>(i));
      }
      continue;
    }
    if (s.check) {
      AttentionLayerParams rp = l.layer->params();
      rp.backend = "REFERENCE";
      rp.device = Device::cpu;
      rp.block_size = sc.block_size;  // --dcp: the unsharded layout of the virtual blocks
      rp.dcp = DcpConfig{};
      try {
        l.ref_layer = std::make_unique<Attention>(rp);
      } catch (const Error& e) {
        throw UnsupportedConfiguration("--check: the REFERENCE backend cannot run layer " + rp.prefix + ": " + one_line(e.what()));
      }
      l.ref_cache = l.ref_layer->allocate_kv_cache(sc.num_blocks);
      l.ref_group = s.add_group(s.ref_groups, l, true, Device::cpu);
      s.ref_groups[static_cast<size_t>(l.ref_group)].layers.push_back(static_cast<int>(i));
    }
  }

  // Decodes-first reorder with the builders' threshold (vLLM: reorder_batch_threshold): the
  // smallest one that a builder asks for (1 + K for the standard builders under speculative
  // decoding, 1 for MLA, whose builders need exactly their decodes first; the others accept any
  // order), 1 when none asks.
  int decode_threshold = 0;
  for (const GroupState& g : s.groups) {
    const int t = g.builder->reorder_batch_threshold();
    if (t > 0) decode_threshold = decode_threshold == 0 ? t : std::min(decode_threshold, t);
  }
  s.scheduler->set_decode_threshold(std::max(decode_threshold, 1));

  // ---- activations ------------------------------------------------------------------------------------
  s.pool_host = Tensor(Shape{max_tokens * per_token + s.pool_slack}, o.dtype, Device::cpu);
  fill_normal(s.pool_host, o.seed ^ 0xACCE55u);
  if (o.device != Device::cpu) s.pool_device = s.pool_host.to(o.device);
  s.output = Tensor(Shape{max_tokens * out_per_token}, o.dtype, o.device);
  for (int r = 1; r < o.dcp_world_size; ++r) {
    const auto scope = on_rank(r);
    if (o.device == Device::cuda) s.rank_pools.push_back(s.pool_host.to(o.device));
    s.rank_outputs.emplace_back(s.output.shape(), o.dtype, o.device);
  }
  s.output.fill_bytes(0xFF);
  if (s.check) s.ref_output = Tensor(Shape{max_tokens * out_per_token}, o.dtype, Device::cpu);
}

Simulation::~Simulation() = default;

const Scheduler& Simulation::scheduler() const { return *state_->scheduler; }

HostBatch Simulation::State::host_batch(const StepSchedule& step) const {
  HostBatch b;
  const int bs = scheduler->config().block_size;  // --dcp: the virtual block size
  b.cols = std::max(1, scheduler->max_blocks_per_request());
  const int n = static_cast<int>(step.requests.size());
  b.query_start_loc.push_back(0);
  b.block_table.assign(static_cast<size_t>(n) * b.cols, 0);  // unused columns: block 0, as vLLM pads
  for (int r = 0; r < n; ++r) {
    const ScheduledRequest& req = step.requests[static_cast<size_t>(r)];
    b.query_lens.push_back(req.num_scheduled_tokens);
    b.query_start_loc.push_back(b.query_start_loc.back() + req.num_scheduled_tokens);
    b.seq_lens.push_back(req.seq_len());
    std::copy(req.blocks.begin(), req.blocks.end(), b.block_table.begin() + static_cast<ptrdiff_t>(r) * b.cols);
    for (int pos = req.num_computed_tokens; pos < req.seq_len(); ++pos) {
      b.slot_mapping.push_back(int64_t{req.blocks[static_cast<size_t>(pos / bs)]} * bs + pos % bs);
    }
  }
  return b;
}

StepRecord Simulation::State::run_step(const StepSchedule& step, bool check_step, bool invariance_step,
                                       RunReport& report) {
  const RunOptions& o = options;
  const int bs = scheduler->config().block_size;  // --dcp: the virtual block size
  const int64_t num_blocks = scheduler->config().num_blocks;
  StepRecord rec;
  rec.step = step.step;
  rec.num_reqs = static_cast<int>(step.requests.size());
  rec.num_tokens = step.num_scheduled_tokens;
  rec.num_decode_tokens = step.num_decode_tokens;
  rec.num_prefill_tokens = step.num_prefill_tokens;
  for (const ScheduledRequest& r : step.requests) rec.num_draft_tokens += r.num_draft_tokens;
  rec.num_preempted = static_cast<int>(step.preempted.size());
  rec.checked = check_step;

  HostBatch hb = host_batch(step);
  const int num_tokens = step.num_scheduled_tokens;
  CommonAttentionMetadataArgs args;
  args.query_start_loc = hb.query_start_loc;
  args.seq_lens = hb.seq_lens;
  args.block_table = hb.block_table;
  args.max_num_blocks_per_req = hb.cols;
  args.slot_mapping = hb.slot_mapping;
  OwnedCommonAttentionMetadata common = make_common_attention_metadata(args, o.device, num_blocks, bs);
  std::unique_ptr<OwnedCommonAttentionMetadata> common_host;  // the reference's copy (cuda runs)
  if (check && o.device != Device::cpu) {
    common_host = std::make_unique<OwnedCommonAttentionMetadata>(
        make_common_attention_metadata(args, Device::cpu, num_blocks, bs));
  }

  // Plan: one build per group; chunked-local groups' builders plan their virtual batches
  // themselves (the layer's own path). The cascade prefix is offered when the builder's heuristic
  // wants it (never to the check's REFERENCE plans, so that a cascade run is compared with a
  // plain one; never with local attention).
  auto plan = [&](std::vector<GroupState>& list, bool reference) {
    const CommonAttentionMetadata& cm = reference && common_host ? common_host->common : common.common;
    std::vector<std::shared_ptr<const AttentionMetadata>> metadata;
    for (GroupState& g : list) {
      int prefix = 0;
      if (!reference) {
        int candidate = common_prefix_len(cm, bs);
        const bool local = g.spec.kind == KVCacheSpecKind::chunked_local_attention;
        if (candidate > 0 &&
            g.builder->use_cascade_attention(candidate, hb.query_lens, g.config.num_heads, g.config.num_kv_heads,
                                             g.config.use_alibi, g.config.sliding_window.has_value(), local,
                                             g.config.num_sms)) {
          prefix = candidate;
        }
      }
      metadata.push_back(g.builder->build(prefix, cm, false));
    }
    return metadata;
  };
  auto t_plan = Clock::now();
  // --dcp: every rank plans its own share inside dcp_forward (counted in the forward time).
  std::vector<std::shared_ptr<const AttentionMetadata>> metadata;
  if (!dcp()) metadata = plan(groups, false);
  if (o.device == Device::cuda) synchronize_cuda();
  rec.plan_seconds = seconds_since(t_plan);
  for (const auto& md : metadata) rec.cascade_plans += md->use_cascade ? 1 : 0;
  report.batch_invariant_plans = !metadata.empty() && metadata.front()->batch_invariant;
  std::vector<std::shared_ptr<const AttentionMetadata>> ref_metadata;
  if (check_step) ref_metadata = plan(ref_groups, true);

  ForwardContext ctx, ref_ctx;
  for (LayerState& l : layers) {
    if (l.mla) continue;  // MLA layers get their metadata and cache directly
    if (!dcp()) {
      ctx.attn_metadata[l.layer->name()] = metadata[static_cast<size_t>(l.group)];
      ctx.kv_caches[l.layer->name()] = l.cache.view();
    }
    if (check_step) {
      ref_ctx.attn_metadata[l.layer->name()] = ref_metadata[static_cast<size_t>(l.ref_group)];
      ref_ctx.kv_caches[l.layer->name()] = l.ref_cache.view();
    }
  }
  TensorView slots_host(hb.slot_mapping.data(), DType::i64, Shape{static_cast<int64_t>(hb.slot_mapping.size())});

  // --check-invariance: the first layer of each group, re-run on sub-batches of the step.
  auto first_of_group = [&](const LayerState& l) {
    return groups[static_cast<size_t>(l.group)].layers.front() == static_cast<int>(&l - layers.data());
  };
  auto check_invariance = [&](const LayerState& l, const CommonAttentionMetadataArgs& step_args,
                              std::initializer_list<TensorView> inputs, const TensorView& out,
                              const InvarianceChecker::Forward& forward) {
    const GroupState& g = groups[static_cast<size_t>(l.group)];
    const TensorView in[3] = {inputs.begin()[0], inputs.begin()[1], inputs.begin()[2]};
    invariance->check_layer(l.name(), l.group, *g.backend, g.spec, g.config, step_args, num_blocks, in, out,
                            forward);
  };
  std::uniform_int_distribution<int64_t> offset_dist(0, pool_slack / 64 - 1);
  const size_t esize = dtype_size(o.dtype);
  for (LayerState& l : layers) {
    const LayerShape& sh = l.shape;
    const int64_t hq = sh.num_heads, hkv = sh.num_kv_heads, d = sh.head_size, dv = sh.value_head_size();
    int64_t q_off = 64 * offset_dist(rng), k_off = 64 * offset_dist(rng), v_off = 64 * offset_dist(rng);
    auto view = [&](const Tensor& pool, int64_t off, int64_t heads, int64_t dim) {
      return TensorView(static_cast<char*>(pool.data()) + off * static_cast<int64_t>(esize), o.dtype,
                        Shape{num_tokens, heads, dim}, pool.device());
    };
    const Tensor& pool = o.device == Device::cpu ? pool_host : pool_device;
    // One checked step of the layer: its error against REFERENCE and both forwards' times.
    auto record_error = [&](const TensorView& out, const TensorView& ref_out, double seconds, double ref_seconds) {
      l.checked_seconds += seconds;
      l.reference_seconds += ref_seconds;
      double err;
      if (o.device == Device::cpu) {
        err = output_relative_error(out, ref_out);
      } else {
        Tensor out_host(out.shape(), o.dtype, Device::cpu);
        out_host.copy_from(out);
        err = output_relative_error(out_host.view(), ref_out);
      }
      l.max_rel_error = std::max(l.max_rel_error, err);
      ++l.checked_steps;
    };
    if (l.mla) {
      // q (T, H, P + R), kv_c_normed (T, L), k_pe (T, R) -> output (T, H, V)
      const int64_t qk = sh.qk_nope_head_dim + sh.qk_rope_head_dim, lora = sh.kv_lora_rank;
      const int64_t rope = sh.qk_rope_head_dim, vdim = sh.v_head_dim;
      auto at = [&](const Tensor& p, int64_t off, Shape shape) {
        return TensorView(static_cast<char*>(p.data()) + off * static_cast<int64_t>(esize), o.dtype, shape, p.device());
      };
      TensorView q = at(pool, q_off, {num_tokens, hq, qk}), kv_c = at(pool, k_off, {num_tokens, lora});
      TensorView k_pe = at(pool, v_off, {num_tokens, rope});
      TensorView out(output.data(), o.dtype, Shape{num_tokens, hq, vdim}, o.device);
      if (check_step) output.fill_bytes(0xFF);  // every element must be written
      auto t0 = Clock::now();
      if (dcp()) {
        dcp_layer_step(l, args, {q, kv_c, k_pe}, out);
      } else {
        l.mla->forward(q, kv_c, k_pe, l.cache.view(), *metadata[static_cast<size_t>(l.group)], out);
      }
      if (o.device == Device::cuda) synchronize_cuda();
      const double seconds = seconds_since(t0);
      rec.forward_seconds += seconds;
      if (invariance_step && first_of_group(l)) {
        check_invariance(l, args, {q, kv_c, k_pe}, out,
                         [&](const TensorView& a, const TensorView& b, const TensorView& c,
                             const AttentionMetadata& md, const TensorView& o_) {
                           l.mla->forward(a, b, c, l.cache.view(), md, o_);
                         });
      }
      if (!check) continue;
      TensorView qh = at(pool_host, q_off, {num_tokens, hq, qk}), kv_ch = at(pool_host, k_off, {num_tokens, lora});
      TensorView k_peh = at(pool_host, v_off, {num_tokens, rope});
      if (!check_step) {
        concat_and_cache_mla(kv_ch, k_peh, l.ref_cache.view(), slots_host, o.kv_cache_dtype, l.ref_mla->scales().k_scale);
        continue;
      }
      TensorView ref_out(ref_output.data(), o.dtype, Shape{num_tokens, hq, vdim}, Device::cpu);
      const auto t_ref = Clock::now();
      l.ref_mla->forward(qh, kv_ch, k_peh, l.ref_cache.view(), *ref_metadata[static_cast<size_t>(l.ref_group)], ref_out);
      record_error(out, ref_out, seconds, seconds_since(t_ref));
      continue;
    }
    TensorView q = view(pool, q_off, hq, d), k = view(pool, k_off, hkv, d), v = view(pool, v_off, hkv, dv);
    TensorView out(output.data(), o.dtype, Shape{num_tokens, hq, dv}, o.device);
    if (check_step) output.fill_bytes(0xFF);  // every element must be written

    auto t0 = Clock::now();
    if (dcp()) {
      dcp_layer_step(l, args, {q, k, v}, out);
    } else {
      ctx.forward(*l.layer, q, k, v, out);
    }
    if (o.device == Device::cuda) synchronize_cuda();
    const double seconds = seconds_since(t0);
    rec.forward_seconds += seconds;
    if (invariance_step && first_of_group(l)) {
      check_invariance(l, args, {q, k, v}, out,
                       [&](const TensorView& a, const TensorView& b, const TensorView& c,
                           const AttentionMetadata& md, const TensorView& o_) {
                         l.layer->forward(a, b, c, l.cache.view(), md, o_);
                       });
    }

    if (!check) continue;
    TensorView qh = view(pool_host, q_off, hq, d), kh = view(pool_host, k_off, hkv, d), vh = view(pool_host, v_off, hkv, dv);
    if (!check_step) {
      // Keep the REFERENCE cache in step: the same k/v at the same slots.
      reshape_and_cache(kh, vh, l.ref_cache.view(), slots_host, o.kv_cache_dtype);
      continue;
    }
    TensorView ref_out(ref_output.data(), o.dtype, Shape{num_tokens, hq, dv}, Device::cpu);
    const auto t_ref = Clock::now();
    ref_ctx.forward(*l.ref_layer, qh, kh, vh, ref_out);
    record_error(out, ref_out, seconds, seconds_since(t_ref));
  }

  // Accounting: the work the step asked of every layer.
  for (const LayerState& l : layers) {
    AttentionWork w = attention_work(l.shape, o.dtype, kv_cache_storage_dtype(o.kv_cache_dtype, o.dtype),
                                     hb.query_lens, hb.seq_lens);
    report.kv_bytes += w.bytes;
    report.flops += w.flops;
  }
  return rec;
}

RunReport Simulation::run(std::ostream* progress) {
  State& s = *state_;
  const RunOptions& o = s.options;
  RunReport report;
  report.options = o;
  report.preset_summary = s.preset->summary(o.num_layers);
  if (o.tensor_parallel_size > 1) {
    report.preset_summary += "; one rank of tensor parallelism " + std::to_string(o.tensor_parallel_size) + " (" +
                             std::to_string(s.layers.front().shape.num_heads) + " query heads per layer)";
  }
  report.preset_source = s.preset->source;
  report.threads = s.threads;
  report.num_blocks = s.scheduler->config().num_blocks;
  report.kv_cache_bytes = s.kv_cache_bytes;
  report.kv_cache_bytes_per_rank = s.kv_cache_bytes_per_rank;
  report.num_requests = static_cast<int>(s.scheduler->requests().size());
  report.requested_tokens = s.scheduler->requested_tokens();
  report.check_enabled = s.check;
  report.invariance_enabled = s.invariance != nullptr;
  for (const GroupState& g : s.groups) {
    report.groups.push_back(GroupReport{std::string(g.backend->name()), spec_summary(g.spec),
                                        static_cast<int>(g.layers.size()),
                                        g.spec.kind == KVCacheSpecKind::chunked_local_attention});
  }
  if (o.measure_peaks) {
    try {
      report.peaks = machine_peaks(o.device, o.dtype, s.threads, progress);
    } catch (const Error& e) {
      report.peaks_unavailable = e.what();
    }
  } else {
    report.peaks_unavailable = "not measured (--no-peaks)";
  }

  Progress bar(progress, report.num_requests, o.progress && stderr_is_terminal());
  auto t_wall = Clock::now();
  int step_index = 0;
  while (!s.scheduler->done() && (o.max_steps == 0 || step_index < o.max_steps)) {
    StepSchedule step = s.scheduler->schedule();
    const bool check_step = s.check && step_index % o.check_interval == 0;
    const bool invariance_step = s.invariance && step_index % o.check_interval == 0;
    StepRecord rec = s.run_step(step, check_step, invariance_step, report);
    if (invariance_step) s.invariance->finish_step();
    s.scheduler->complete_step(step);
    report.plan_seconds += rec.plan_seconds;
    report.forward_seconds += rec.forward_seconds;
    report.plans += static_cast<int64_t>(s.groups.size());
    report.cascade_plans += rec.cascade_plans;
    if (check_step) ++report.checked_steps;
    report.steps.push_back(rec);
    ++step_index;
    if (o.progress) bar.update(s.scheduler->stats());
  }
  report.wall_seconds = seconds_since(t_wall);
  report.dcp_rank_forward_seconds = s.dcp_rank_seconds;
  if (o.progress) bar.finish(s.scheduler->stats());
  report.completed = s.scheduler->done();
  if (report.completed) s.scheduler->release_prefix_cache();
  report.free_blocks_at_end = s.scheduler->pool().num_free_blocks();
  report.stats = s.scheduler->stats();

  for (size_t i = 0; i < s.layers.size(); ++i) {
    const LayerState& l = s.layers[i];
    LayerReport lr;
    lr.name = l.name();
    lr.kind = l.shape.describe();
    lr.backend = std::string(l.backend().name());
    lr.group = l.group;
    lr.checked_steps = l.checked_steps;
    lr.max_rel_error = l.max_rel_error;
    lr.tolerance = s.tolerance;
    lr.checked_seconds = l.checked_seconds;
    lr.reference_seconds = l.reference_seconds;
    if (s.check && l.checked_steps > 0 && !lr.passed()) report.check_passed = false;
    report.layers.push_back(lr);
  }
  if (s.invariance) {
    report.invariance = s.invariance->stats();
    if (report.invariance.differences > 0) report.check_passed = false;
  }
  return report;
}

}  // namespace pagedattn::cli
