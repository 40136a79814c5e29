// MLA conformance harness (see mla_harness.h).
#include "conformance/mla_harness.h"
#include "conformance/uniform_float.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>

#include "pagedattn/selector.h"

namespace pagedattn::conformance::mla {
namespace {

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

Tensor random_host(Shape shape, DType dtype, std::mt19937_64& rng, float lo, float hi) {
  Tensor t(shape, dtype, Device::cpu);
  void* const data = t.data();
  const int64_t n = t.numel();  // read once: per element it costs more than the store
  for (int64_t i = 0; i < n; ++i) store_f32(data, dtype, i, uniform_float(rng, lo, hi));
  return t;
}

Tensor i64_host(const std::vector<int64_t>& v) {
  Tensor t(Shape{static_cast<int64_t>(v.size())}, DType::i64, Device::cpu);
  std::copy(v.begin(), v.end(), t.data_as<int64_t>());
  return t;
}

// Everything generated for one (case, seed), on the host.
struct Inputs {
  MLACase c;
  int num_reqs = 0, num_actual_tokens = 0, num_tokens = 0, num_blocks = 0, cols = 0;
  int max_seq_len = 0;
  std::vector<int32_t> query_start_loc, seq_lens, block_table;
  std::vector<int64_t> step_slots, context_slots;
  Tensor weight;              // (H * (P + V), L)
  Tensor q;                   // (T, H, P + R)
  Tensor kv_c, k_pe;          // (T, L), (T, R)
  Tensor ctx_kv_c, ctx_k_pe;  // (num_context_tokens, L / R)
  Tensor stale_cache;         // (num_blocks, block_size, L + R) storage dtype, random
  float scale = 1.f, k_scale = 1.f;
};

Inputs make_inputs(const MLACase& c, uint64_t seed) {
  Inputs in;
  in.c = c;
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 17);
  const MLADimensions& d = c.dims;
  const int64_t H = c.num_heads, L = d.kv_lora_rank, R = d.qk_rope_head_dim,
                P = d.qk_nope_head_dim, V = d.v_head_dim;
  in.num_reqs = static_cast<int>(c.batch.size());
  in.query_start_loc.push_back(0);
  int total_blocks = 0;
  for (const MLARequest& r : c.batch) {
    in.query_start_loc.push_back(in.query_start_loc.back() + r.query_len);
    in.seq_lens.push_back(r.context_len + r.query_len);
    in.max_seq_len = std::max(in.max_seq_len, r.context_len + r.query_len);
    const int blocks = static_cast<int>(cdiv(r.context_len + r.query_len, c.block_size));
    in.cols = std::max(in.cols, blocks);
    total_blocks += blocks;
  }
  in.cols = std::max(in.cols, 1);
  in.num_actual_tokens = in.query_start_loc.back();
  in.num_tokens = in.num_actual_tokens + c.pad_tokens;
  in.num_blocks = total_blocks + 3;  // spares: unused columns point at them
  std::vector<int32_t> ids(static_cast<size_t>(in.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  in.block_table.assign(static_cast<size_t>(in.num_reqs) * in.cols, 0);
  size_t next = 0;
  for (int r = 0; r < in.num_reqs; ++r) {
    const int blocks = static_cast<int>(cdiv(in.seq_lens[r], c.block_size));
    for (int col = 0; col < in.cols; ++col) {
      in.block_table[static_cast<size_t>(r) * in.cols + col] =
          col < blocks ? ids[next++] : ids[static_cast<size_t>(total_blocks) + col % 3];
    }
  }
  const auto slot_of = [&](int r, int pos) {
    return int64_t{in.block_table[static_cast<size_t>(r) * in.cols + pos / c.block_size]} *
               c.block_size + pos % c.block_size;
  };
  for (int r = 0; r < in.num_reqs; ++r) {
    for (int pos = 0; pos < c.batch[r].context_len; ++pos) in.context_slots.push_back(slot_of(r, pos));
    for (int j = 0; j < c.batch[r].query_len; ++j) {
      in.step_slots.push_back(slot_of(r, c.batch[r].context_len + j));
    }
  }
  for (int i = 0; i < c.pad_tokens; ++i) in.step_slots.push_back(-1);

  const float w_bound = std::sqrt(3.f / static_cast<float>(L));
  in.weight = random_host(Shape{H * (P + V), L}, c.dtype, rng, -w_bound, w_bound);
  in.q = random_host(Shape{in.num_tokens, H, P + R}, c.dtype, rng, -1.f, 1.f);
  in.kv_c = random_host(Shape{in.num_tokens, L}, c.dtype, rng, -1.f, 1.f);
  in.k_pe = random_host(Shape{in.num_tokens, R}, c.dtype, rng, -1.f, 1.f);
  const int64_t nctx = static_cast<int64_t>(in.context_slots.size());
  in.ctx_kv_c = random_host(Shape{nctx, L}, c.dtype, rng, -1.f, 1.f);
  in.ctx_k_pe = random_host(Shape{nctx, R}, c.dtype, rng, -1.f, 1.f);
  in.stale_cache = random_host(Shape{in.num_blocks, c.block_size, L + R},
                               kv_cache_storage_dtype(c.kv_cache_dtype, c.dtype), rng, -2.f, 2.f);
  in.scale = 1.f / std::sqrt(static_cast<float>(P + R));
  in.k_scale = c.fp8_kv() ? 1.f / 32.f : 1.f;
  return in;
}

using Outputs = MLAOutputs;

Outputs run_one(const AttentionBackend& backend, std::string_view prefill, Device device,
                const Inputs& in) {
  const MLACase& c = in.c;
  const MLADimensions& d = c.dims;
  const int64_t H = c.num_heads, V = d.v_head_dim;
  const MLABackend* mla_backend = backend.as_mla();
  if (mla_backend == nullptr) {
    throw Error("backend", std::string(backend.name()) + " is not an MLA backend");
  }
  Outputs out;
  out.backend_name = std::string(backend.name());
  out.num_actual_tokens = in.num_actual_tokens;

  Tensor cache = in.stale_cache.to(device);
  if (!in.context_slots.empty()) {
    const Tensor kv = in.ctx_kv_c.to(device), pe = in.ctx_k_pe.to(device),
                 slots = i64_host(in.context_slots).to(device);
    concat_and_cache_mla(kv, pe, cache, slots, c.kv_cache_dtype, in.k_scale);
  }
  CommonAttentionMetadataArgs args;
  args.query_start_loc = in.query_start_loc;
  args.seq_lens = in.seq_lens;
  args.block_table = in.block_table;
  args.max_num_blocks_per_req = in.cols;
  args.slot_mapping = in.step_slots;
  args.num_tokens_padded = in.num_tokens;
  const OwnedCommonAttentionMetadata common =
      make_common_attention_metadata(args, device, in.num_blocks, c.block_size);

  BuilderConfig cfg;
  cfg.num_heads = c.num_heads;
  cfg.num_kv_heads = 1;
  cfg.head_size = d.latent_head_size();
  cfg.head_size_v = d.v_head_dim;
  cfg.max_num_seqs = std::max(in.num_reqs, 1);
  cfg.max_num_batched_tokens = std::max(in.num_tokens, 1);
  cfg.max_model_len = std::max(in.max_seq_len, 1);
  cfg.mla_dimensions = d;
  cfg.mla_dtype = c.dtype;
  cfg.mla_chunked_prefill_workspace_tokens = c.workspace_tokens;
  cfg.num_speculative_tokens = c.num_speculative_tokens;
  const KVCacheSpec spec = mla_attention_spec(c.block_size, d, c.dtype, c.kv_cache_dtype);
  std::unique_ptr<AttentionMetadataBuilder> builder = backend.make_builder(spec, cfg, device);
  const std::shared_ptr<const AttentionMetadata> md = builder->build(0, common.common);

  const Tensor weight = in.weight.to(device), q = in.q.to(device), kv_c = in.kv_c.to(device),
               k_pe = in.k_pe.to(device);
  const DType out_dtype = c.output_dtype();
  Tensor output = c.output_2d ? Tensor(Shape{in.num_tokens, H * V}, out_dtype, device)
                              : Tensor(Shape{in.num_tokens, H, V}, out_dtype, device);
  output.fill_bytes(0xFF);  // NaN in every float dtype (e4m3 too)
  Tensor output_scale;
  if (c.fp8_output()) {
    Tensor host_scale(Shape{1}, DType::f32, Device::cpu);
    host_scale.data_as<float>()[0] = c.output_scale;
    output_scale = host_scale.to(device);
  }
  const TensorView scale_view = c.fp8_output() ? output_scale.view() : TensorView{};
  Tensor lse;
  if (c.return_lse) {
    lse = Tensor(Shape{H, in.num_tokens}, DType::f32, device);
    lse.fill_bytes(0xFF);
  }
  const TensorView lse_view = c.return_lse ? lse.view() : TensorView{};
  if (find_backend(backend.name()) == &backend) {
    MLAAttentionLayerParams lp;
    lp.num_heads = c.num_heads;
    lp.scale = in.scale;
    lp.kv_lora_rank = d.kv_lora_rank;
    lp.qk_nope_head_dim = d.qk_nope_head_dim;
    lp.qk_rope_head_dim = d.qk_rope_head_dim;
    lp.qk_head_dim = d.qk_head_dim();
    lp.v_head_dim = d.v_head_dim;
    lp.kv_cache_dtype = c.kv_cache_dtype;
    lp.block_size = c.block_size;
    lp.prefix = "mla_conformance";
    lp.dtype = c.dtype;
    lp.device = device;
    lp.backend = std::string(backend.name());
    lp.prefill_backend = std::string(prefill);
    lp.fp8_output = c.fp8_output();
    MLAAttention layer(lp);
    layer.scales().k_scale = in.k_scale;
    layer.process_weights_after_loading(weight);
    layer.forward(q, kv_c, k_pe, cache, *md, output, lse_view, scale_view);
    out.prefill_name = std::string(layer.impl().prefill_backend_name());
  } else {
    MLAImplParams ip;
    ip.num_heads = c.num_heads;
    ip.scale = in.scale;
    ip.dims = d;
    ip.kv_cache_dtype = c.kv_cache_dtype;
    ip.dtype = c.dtype;
    ip.device = device;
    ip.block_size = c.block_size;
    ip.prefill_backend = std::string(prefill);
    std::unique_ptr<MLAAttentionImpl> impl = mla_backend->make_mla_impl(ip);
    LayerScales scales;
    scales.k_scale = in.k_scale;
    impl->process_weights_after_loading(weight);
    impl->do_kv_cache_update(scales, kv_c, k_pe, cache, *md);
    impl->forward(scales, q, kv_c, k_pe, cache, *md, output, scale_view, lse_view);
    out.prefill_name = std::string(impl->prefill_backend_name());
  }
  synchronize_cuda();
  out.output = output.to(Device::cpu);
  if (c.return_lse) out.lse = lse.to(Device::cpu);
  out.cache = cache.to(Device::cpu);
  return out;
}

MLAResult compare(const Inputs& in, const Outputs& got, const Outputs& ref, uint64_t seed) {
  const MLACase& c = in.c;
  MLAResult r;
  r.backend_name = got.backend_name;
  r.prefill_backend_name = got.prefill_name;
  r.case_description = c.describe();
  r.seed = seed;
  r.tolerance = tolerance(c);
  const int64_t H = c.num_heads, V = c.dims.v_head_dim, T = in.num_actual_tokens;
  double diff = 0, norm = 0;
  const int64_t n = T * H * V;  // the first T rows, (T, H, V) or (T, H * V) alike
  for (int64_t i = 0; i < n; ++i) {
    const double o = load_f64(got.output.data(), c.output_dtype(), i);
    const double e = load_f64(ref.output.data(), c.output_dtype(), i);
    if (!std::isfinite(o)) {
      ++r.unwritten;
      continue;
    }
    diff += (o - e) * (o - e);
    norm += e * e;
  }
  r.output_rel_error = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  if (c.return_lse) {
    double ld = 0, ln = 0;
    const int64_t cols = in.num_tokens;
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        const float a = got.lse.data_as<const float>()[h * cols + t];
        const float b = ref.lse.data_as<const float>()[h * cols + t];
        if (std::isnan(a) || a == std::numeric_limits<float>::infinity()) {
          ++r.unwritten;
          continue;
        }
        if (std::isinf(a) != std::isinf(b)) {
          ++r.lse_inf_mismatches;
          continue;
        }
        if (std::isinf(a)) continue;
        ld += (double{a} - b) * (double{a} - b);
        ln += double{b} * b;
      }
    }
    r.lse_rel_error = ln > 0 ? std::sqrt(ld / ln) : std::sqrt(ld);
  }
  // Cache rows written (context and step): byte-identical to the REFERENCE's.
  const int64_t row = c.dims.latent_head_size();
  const size_t es = dtype_size(got.cache.dtype());
  const auto* a = static_cast<const uint8_t*>(got.cache.data());
  const auto* b = static_cast<const uint8_t*>(ref.cache.data());
  for (const std::vector<int64_t>* slots : {&in.context_slots, &in.step_slots}) {
    for (const int64_t slot : *slots) {
      if (slot < 0) continue;
      for (int64_t x = 0; x < row; ++x) {
        const size_t at = static_cast<size_t>((slot * row + x)) * es;
        if (std::memcmp(a + at, b + at, es) != 0) ++r.cache_mismatches;
      }
    }
  }
  return r;
}

MLACase make_case(std::string name, DType dtype, std::string kv, MLADimensions dims, int heads,
                  int block_size, int64_t workspace, std::vector<MLARequest> batch) {
  MLACase c;
  c.name = std::move(name);
  c.dtype = dtype;
  c.kv_cache_dtype = std::move(kv);
  c.dims = dims;
  c.num_heads = heads;
  c.block_size = block_size;
  c.workspace_tokens = workspace;
  c.batch = std::move(batch);
  return c;
}

}  // namespace

bool MLACase::fp8_kv() const { return is_fp8(kv_cache_storage_dtype(kv_cache_dtype, dtype)); }

std::string MLACase::describe() const {
  std::ostringstream os;
  if (!name.empty()) os << name << ": ";
  os << dtype_name(dtype) << " kv=" << kv_cache_dtype << " L=" << dims.kv_lora_rank
     << " P=" << dims.qk_nope_head_dim << " R=" << dims.qk_rope_head_dim
     << " V=" << dims.v_head_dim << " H=" << num_heads << " bs=" << block_size;
  if (workspace_tokens > 0) os << " W=" << workspace_tokens;
  if (!return_lse) os << " no-lse";
  if (output_2d) os << " out2d";
  if (pad_tokens > 0) os << " pad=" << pad_tokens;
  if (fp8_output()) os << " fp8-out/" << output_scale;
  if (num_speculative_tokens > 0) os << " spec=" << num_speculative_tokens;
  os << " [";
  for (size_t i = 0; i < batch.size(); ++i) {
    os << (i ? "," : "") << "(" << batch[i].context_len << "," << batch[i].query_len << ")";
  }
  os << "]";
  return os.str();
}

MLAAttentionLayerParams small_mla_layer_params(const std::string& backend, DType dtype) {
  MLAAttentionLayerParams p;
  p.num_heads = 4;
  p.kv_lora_rank = 64;
  p.qk_nope_head_dim = 32;
  p.qk_rope_head_dim = 16;
  p.qk_head_dim = 48;
  p.v_head_dim = 32;
  p.block_size = 16;
  p.dtype = dtype;
  p.prefix = "layers.0.mla";
  p.backend = backend;
  return p;
}

OwnedCommonAttentionMetadata small_mla_step_metadata() {
  CommonAttentionMetadataArgs a;
  a.query_start_loc = {0, 1, 3};
  a.seq_lens = {5, 2};
  a.block_table = {0, 1, 2, 3};
  a.max_num_blocks_per_req = 2;
  a.slot_mapping = {4, 32, 33};
  return make_common_attention_metadata(a, Device::cpu);
}

double tolerance(const MLACase& c) {
  double tol = c.dtype == DType::f32 ? 1e-5 : c.dtype == DType::f16 ? 2e-3 : 8e-3;
  if (c.fp8_kv() || c.fp8_output()) tol = std::max(tol, 6e-2);
  return tol;
}

std::vector<MLACase> mla_grid(bool full) {
  const MLADimensions small{64, 32, 16, 32};
  const MLADimensions deepseek{512, 128, 64, 128};
  const DType f32 = DType::f32, bf16 = DType::bf16, f16 = DType::f16;
  std::vector<MLACase> g;
  g.push_back(make_case("decode", f32, "auto", small, 4, 16, 0, {{40, 1}, {17, 1}, {0, 1}}));
  g.push_back(make_case("prefill", f32, "auto", small, 4, 16, 0, {{0, 7}, {0, 3}}));
  g.push_back(make_case("context-1-chunk", f32, "auto", small, 4, 16, 0, {{20, 5}, {33, 4}}));
  g.push_back(make_case("context-2-chunks", f32, "auto", small, 4, 16, 64, {{40, 3}, {50, 6}}));
  g.push_back(make_case("context-7-chunks", f32, "auto", small, 4, 16, 32, {{100, 4}, {37, 3}}));
  const std::vector<MLARequest> mixed = {{30, 1}, {5, 1}, {45, 6}, {0, 4}, {20, 2}};
  g.push_back(make_case("mixed", bf16, "auto", small, 4, 16, 80, mixed));
  g.push_back(make_case("mixed-fp8", bf16, "fp8", small, 4, 16, 80, mixed));
  g.push_back(make_case("mixed-bs64", f16, "auto", small, 4, 64, 0, {{70, 1}, {130, 5}, {10, 3}}));
  MLACase e5m2 = make_case("fp8-e5m2-out2d-pad", f32, "fp8_e5m2", small, 4, 64, 0,
                           {{20, 1}, {50, 4}});
  e5m2.output_2d = true;
  e5m2.pad_tokens = 3;
  g.push_back(e5m2);
  MLACase no_lse = make_case("no-lse", f32, "auto", small, 4, 16, 32, {{10, 1}, {40, 3}});
  no_lse.return_lse = false;
  g.push_back(no_lse);
  g.push_back(make_case("deepseek", bf16, "auto", deepseek, 16, 64, 0, {{40, 1}, {30, 5}}));
  // Speculative decodes (k = 3: decodes of 1 to 4 tokens, then prefills of more), with context
  // chunks behind them, an fp8 cache, and DeepSeek dims.
  MLACase spec = make_case("spec-decode", f32, "auto", small, 4, 16, 96,
                           {{40, 1}, {30, 4}, {17, 2}, {0, 3}, {20, 6}, {0, 5}});
  spec.num_speculative_tokens = 3;
  g.push_back(spec);
  spec = make_case("spec-decode-fp8", bf16, "fp8", small, 4, 16, 0, {{33, 3}, {0, 4}, {50, 2}, {9, 7}});
  spec.num_speculative_tokens = 3;
  g.push_back(spec);
  spec = make_case("spec-deepseek", bf16, "auto", deepseek, 16, 64, 0, {{100, 4}, {64, 4}, {30, 2}, {70, 6}});
  spec.num_speculative_tokens = 3;
  g.push_back(spec);
  // Fused fp8 output: decodes, new tokens without context and a 3-chunk context in one batch
  // (every staged write of MLACommonImpl), and DeepSeek dims over an fp8 cache.
  MLACase fp8_out = make_case("fp8-out-mixed", bf16, "auto", small, 4, 16, 64,
                              {{30, 1}, {5, 1}, {0, 4}, {140, 3}});
  fp8_out.output_scale = 1.f / 64.f;
  g.push_back(fp8_out);
  fp8_out = make_case("fp8-out-prefill", f32, "auto", small, 4, 16, 0, {{0, 6}, {0, 3}});
  fp8_out.output_scale = 1.f / 256.f;
  g.push_back(fp8_out);
  fp8_out = make_case("fp8-out-deepseek", bf16, "fp8", deepseek, 16, 64, 0, {{40, 1}, {20, 3}});
  fp8_out.output_scale = 1.f / 128.f;
  g.push_back(fp8_out);
  if (!full) return g;
  // Larger grid: every activation dtype x cache dtype x block size on the mixed batch, DeepSeek
  // dims with fp8 and many chunks, odd dims.
  for (const DType dt : {f32, f16, bf16}) {
    for (const char* kv : {"auto", "fp8", "fp8_e5m2", "bfloat16"}) {
      for (const int bs : {1, 16, 64}) {
        g.push_back(make_case("full-mixed", dt, kv, small, 4, bs, 5 * bs * 2,
                              {{30, 1}, {5, 1}, {0, 1}, {45, 6}, {0, 4}, {129, 2}}));
      }
    }
  }
  g.push_back(make_case("full-deepseek-fp8", bf16, "fp8", deepseek, 16, 64, 256,
                        {{200, 1}, {64, 1}, {300, 7}, {129, 3}}));
  g.push_back(make_case("full-odd-dims", f32, "auto", MLADimensions{24, 8, 8, 12}, 3, 16, 48,
                        {{7, 1}, {50, 5}, {3, 2}}));
  g.push_back(make_case("full-h128", bf16, "auto", deepseek, 128, 64, 0, {{100, 1}, {80, 9}}));
  return g;
}

std::vector<MLACase> mla_grid() {
  const char* env = std::getenv("PAGEDATTN_FULL_GRID");
  return mla_grid(env != nullptr && std::string(env) == "1");
}

SelectorConfig selector_config(const MLACase& c, Device device) {
  SelectorConfig s;
  s.head_size = c.dims.latent_head_size();
  s.dtype = c.dtype;
  s.kv_cache_dtype = c.kv_cache_dtype;
  s.block_size = c.block_size;
  s.use_mla = true;
  s.device = device;
  s.mla_dimensions = c.dims;
  s.num_heads = c.num_heads;
  s.fp8_output = c.fp8_output();
  return s;
}

std::vector<std::string> unsupported_reasons(const AttentionBackend& backend, Device device,
                                             const MLACase& c) {
  std::vector<std::string> reasons = backend.validate_configuration(selector_config(c, device));
  if (!block_size_supported(backend.supported_kernel_block_sizes(), c.block_size)) {
    reasons.push_back("block_size = " + std::to_string(c.block_size) + " is not a kernel block size");
  }
  return reasons;
}

bool MLAResult::passed() const {
  if (skipped) return true;
  return unwritten == 0 && lse_inf_mismatches == 0 && cache_mismatches == 0 &&
         output_rel_error <= tolerance && lse_rel_error <= tolerance;
}

std::string MLAResult::describe() const {
  std::ostringstream os;
  if (skipped) {
    os << "SKIP " << backend_name << " " << case_description << ":";
    for (const std::string& r : skip_reasons) os << " " << r;
    return os.str();
  }
  os << (passed() ? "PASS " : "FAIL ") << backend_name << " (prefill " << prefill_backend_name
     << ") " << case_description << " seed=" << seed << ": out err " << output_rel_error
     << ", lse err " << lse_rel_error << " (tol " << tolerance << "), unwritten " << unwritten
     << ", lse -inf mismatches " << lse_inf_mismatches << ", cache mismatches "
     << cache_mismatches;
  return os.str();
}

MLAResult run_mla_case(const AttentionBackend& backend, std::string_view prefill_backend,
                       Device device, const MLACase& c, uint64_t seed) {
  const Inputs in = make_inputs(c, seed);
  const AttentionBackend* ref = find_backend("REFERENCE_MLA");
  if (ref == nullptr) throw Error("backend", "REFERENCE_MLA is not registered");
  const Outputs got = run_one(backend, prefill_backend, device, in);
  const Outputs want = run_one(*ref, "", Device::cpu, in);
  return compare(in, got, want, seed);
}

MLAOutputs run_mla_outputs(const AttentionBackend& backend, std::string_view prefill_backend,
                           Device device, const MLACase& c, uint64_t seed) {
  return run_one(backend, prefill_backend, device, make_inputs(c, seed));
}

std::string QuantizedComparison::describe() const {
  std::ostringstream os;
  os << elements << " elements: " << unwritten << " unwritten, " << mismatches
     << " differ from the quantized activation output (at most " << max_steps << " e4m3 steps), "
     << saturated << " saturated";
  return os.str();
}

QuantizedComparison compare_with_quantized(const Tensor& fp8, const Tensor& act, float scale,
                                           int64_t elements) {
  // Position of an e4m3 code on the number line: codes 0..0x7E grow with the magnitude.
  const auto ordinal = [](uint8_t bits) {
    const int magnitude = bits & 0x7F;
    return (bits & 0x80) != 0 ? -magnitude : magnitude;
  };
  QuantizedComparison r;
  r.elements = elements;
  const auto* got = static_cast<const uint8_t*>(fp8.data());
  for (int64_t i = 0; i < elements; ++i) {
    if ((got[i] & 0x7F) == 0x7F) {
      ++r.unwritten;
      continue;
    }
    r.saturated += (got[i] & 0x7F) == 0x7E;
    const uint8_t want = f32_to_fp8_e4m3_bits(load_f32(act.data(), act.dtype(), i) / scale);
    const int steps = std::abs(ordinal(got[i]) - ordinal(want));
    r.mismatches += steps != 0;
    r.max_steps = std::max(r.max_steps, steps);
  }
  return r;
}

std::vector<MLAResult> run_mla_grid(const AttentionBackend& backend,
                                    std::string_view prefill_backend, Device device,
                                    const std::vector<MLACase>& grid, uint64_t seed) {
  std::vector<MLAResult> results;
  for (size_t i = 0; i < grid.size(); ++i) {
    std::vector<std::string> reasons = unsupported_reasons(backend, device, grid[i]);
    if (!reasons.empty()) {
      MLAResult skipped;
      skipped.backend_name = std::string(backend.name());
      skipped.case_description = grid[i].describe();
      skipped.seed = seed + i;
      skipped.skipped = true;
      skipped.skip_reasons = std::move(reasons);
      results.push_back(std::move(skipped));
      continue;
    }
    results.push_back(run_mla_case(backend, prefill_backend, device, grid[i], seed + i));
  }
  return results;
}

}  // namespace pagedattn::conformance::mla
