// REFERENCE_MLA: the fp64 oracle of MLA attention, written from the UN-ABSORBED formula and
// independent of MLACommonImpl (it shares only the plan, MLACommonMetadataBuilder).
//
// What it computes, for request r with seq_len s and query_len q (context c = s - q), head h,
// query token j at position c + j, kv_b_proj weight W (H*(P+V), L):
//   latent[pos] (L + R)  = cache row of pos (dequantized: fp8 * k_scale) when pos < c or r is a
//                          decode (vLLM reads every decode key from the cache, the current token's
//                          too), else [kv_c_normed, k_pe] of the token as given (prefill new
//                          tokens, vLLM's fp8 semantics: not quantized)
//   k[pos] = [W_UK[h] · latent[pos][:L], latent[pos][L:]]    (P + R)
//   v[pos] = W_UV[h] · latent[pos][:L]                       (V)
//   s_pos = scale * (q[token, h] · k[pos]) for pos <= c + j; out = softmax(s) · v; lse natural.
// Precision: every input converted exactly to fp64, all arithmetic fp64; one rounding of the
// output to the activation dtype (host::store_rounded_f64) and of the LSE to f32. fp8 output
// (output_scale given, as REFERENCE): saturate_e4m3(out / output_scale[0]), the division in fp64
// and one rounding to e4m3; a scale that is not a positive finite number is an Error before any
// write. No tiling (per (request, head): the keys' up-projection once, then every query row).
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backends/host_backend_common.h"
#include "backends/mla/mla_common.h"
#include "backends/ordered_registry.h"
#include "backends/reference/reference_mla.h"
#include "pagedattn/error.h"

namespace pagedattn {
namespace {

constexpr const char* kWho = "REFERENCE_MLA";

class ReferenceMLAImpl final : public MLAAttentionImpl {
 public:
  explicit ReferenceMLAImpl(MLAImplParams p) : MLAAttentionImpl(std::move(p)) {
    const MLAImplParams& q = params_;
    PAGEDATTN_CHECK(q.device == Device::cpu, "device", kWho, ": device = ", device_name(q.device),
                    " is not supported: REFERENCE_MLA runs on the cpu");
    PAGEDATTN_CHECK(host::is_activation_dtype(q.dtype), "dtype", kWho, ": dtype = ",
                    dtype_name(q.dtype), " is not supported: expected float32, float16 or bfloat16");
    PAGEDATTN_CHECK(host::is_accepted_kv_cache_dtype(q.kv_cache_dtype), "kv_cache_dtype", kWho,
                    ": kv_cache_dtype = '", q.kv_cache_dtype, "' is not supported: expected one of ",
                    host::accepted_kv_cache_dtypes());
    mla::check_mla_impl_params(kWho, q);
    // The oracle computes its prefill itself, in fp64: a forced prefill backend would be ignored,
    // so anything but the fp64 one is refused rather than silently dropped.
    PAGEDATTN_CHECK(q.prefill_backend.empty() || detail::equal_ignoring_case(q.prefill_backend, "REFERENCE"),
                    "prefill_backend", kWho, ": prefill_backend = '", q.prefill_backend,
                    "' cannot be used: REFERENCE_MLA runs its own fp64 prefill (leave it empty, or REFERENCE)");
    cache_dtype_ = kv_cache_storage_dtype(q.kv_cache_dtype, q.dtype);
  }

  void process_weights_after_loading(const TensorView& w) override {
    const MLADimensions& d = params_.dims;
    const int64_t rows = int64_t{params_.num_heads} * (d.qk_nope_head_dim + d.v_head_dim);
    check_defined(w, "kv_b_proj_weight");
    check_device(w, "kv_b_proj_weight", Device::cpu);
    const DType act[] = {params_.dtype};
    check_dtype(w, "kv_b_proj_weight", act);
    check_shape(w, "kv_b_proj_weight", Shape{rows, d.kv_lora_rank});
    weight_.resize(static_cast<size_t>(rows * d.kv_lora_rank));
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t l = 0; l < d.kv_lora_rank; ++l) {
        weight_[i * d.kv_lora_rank + l] =
            load_f64(w.data(), w.dtype(), i * w.stride(0) + l * w.stride(1));
      }
    }
  }

  void do_kv_cache_update(const LayerScales& scales, const TensorView& kv_c_normed,
                          const TensorView& k_pe, const TensorView& kv_cache,
                          const AttentionMetadata& metadata) override {
    const MLAMetadata& md = checked_metadata(metadata, "do_kv_cache_update");
    check_cache(kv_cache, md, "do_kv_cache_update");
    check_scale(scales, "do_kv_cache_update");
    concat_and_cache_mla(kv_c_normed, k_pe, kv_cache, md.slot_mapping, params_.kv_cache_dtype,
                         scales.k_scale);
  }

  void check_forward(const LayerScales& scales, const TensorView& q,
                     const TensorView& kv_c_normed, const TensorView& k_pe_in,
                     const TensorView& kv_cache, const AttentionMetadata& metadata,
                     const TensorView& output_in, const TensorView& output_scale,
                     const TensorView& output_lse) const override {
    const MLAMetadata& md = checked_metadata(metadata, "forward");
    check_cache(kv_cache, md, "forward");
    check_scale(scales, "forward");
    const MLADimensions& d = params_.dims;
    const int64_t H = params_.num_heads, L = d.kv_lora_rank, R = d.qk_rope_head_dim,
                  P = d.qk_nope_head_dim, V = d.v_head_dim;
    const int64_t T = md.num_actual_tokens;
    PAGEDATTN_CHECK(!weight_.empty(), "kv_b_proj_weight", kWho,
                    " forward: process_weights_after_loading was not called");
    const DType act[] = {params_.dtype};
    check_defined(q, "q");
    check_device(q, "q", Device::cpu);
    check_dtype(q, "q", act);
    PAGEDATTN_CHECK(q.ndim() == 3 && q.size(0) >= T && q.size(1) == H && q.size(2) == P + R, "q",
                    kWho, " forward: q is ", q.describe(), ", expected (>= ", T, ", ", H, ", ",
                    P + R, ")");
    TensorView k_pe = k_pe_in;
    if (k_pe.ndim() == 3 && k_pe.size(1) == 1) k_pe = k_pe.select(1, 0);
    const std::pair<const TensorView*, const char*> lat[] = {{&kv_c_normed, "kv_c_normed"},
                                                             {&k_pe, "k_pe"}};
    for (const auto& [t, name] : lat) {
      check_defined(*t, name);
      check_device(*t, name, Device::cpu);
      check_dtype(*t, name, act);
      check_ndim(*t, name, 2);
    }
    PAGEDATTN_CHECK(kv_c_normed.size(0) >= T && kv_c_normed.size(1) == L, "kv_c_normed", kWho,
                    " forward: kv_c_normed is ", kv_c_normed.describe(), ", expected (>= ", T,
                    ", ", L, ")");
    PAGEDATTN_CHECK(k_pe.size(0) >= T && k_pe.size(1) == R, "k_pe", kWho, " forward: k_pe is ",
                    k_pe_in.describe(), ", expected (>= ", T, ", ", R, ") or (>= ", T, ", 1, ", R,
                    ")");
    check_defined(output_in, "output");
    check_device(output_in, "output", Device::cpu);
    const DType fp8_out[] = {DType::fp8_e4m3};
    check_dtype(output_in, "output",
                output_scale.defined() ? std::span<const DType>(fp8_out) : std::span<const DType>(act));
    if (output_scale.defined()) {
      const DType f32[] = {DType::f32};
      check_device(output_scale, "output_scale", Device::cpu);
      check_dtype(output_scale, "output_scale", f32);
      check_shape(output_scale, "output_scale", Shape{1});
      const double divisor = load_f64(output_scale.data(), DType::f32, 0);
      PAGEDATTN_CHECK(std::isfinite(divisor) && divisor > 0.0, "output_scale", kWho,
                      " forward: output_scale[0] = ", divisor, " must be a positive finite number");
    }
    const TensorView output = as_3d_output(output_in, H, V);
    PAGEDATTN_CHECK(output.ndim() == 3 && output.size(0) >= T && output.size(1) == H &&
                        output.size(2) == V,
                    "output", kWho, " forward: output is ", output_in.describe(), ", expected (>= ",
                    T, ", ", H, ", ", V, ") or (>= ", T, ", ", H * V, ")");
    if (output_lse.defined()) {
      check_device(output_lse, "output_lse", Device::cpu);
      const DType f32[] = {DType::f32};
      check_dtype(output_lse, "output_lse", f32);
      PAGEDATTN_CHECK(output_lse.ndim() == 2 && output_lse.size(0) == H && output_lse.size(1) >= T,
                      "output_lse", kWho, " forward: output_lse is ", output_lse.describe(),
                      ", expected (", H, ", >= ", T, ")");
    }
  }

  void forward(const LayerScales& scales, const TensorView& q, const TensorView& kv_c_normed,
               const TensorView& k_pe_in, const TensorView& kv_cache,
               const AttentionMetadata& metadata, const TensorView& output_in,
               const TensorView& output_scale, const TensorView& output_lse) override {
    check_forward(scales, q, kv_c_normed, k_pe_in, kv_cache, metadata, output_in, output_scale,
                  output_lse);
    const auto& md = static_cast<const MLAMetadata&>(metadata);
    const MLADimensions& d = params_.dims;
    const int64_t H = params_.num_heads, L = d.kv_lora_rank, R = d.qk_rope_head_dim,
                  P = d.qk_nope_head_dim, V = d.v_head_dim;
    TensorView k_pe = k_pe_in;
    if (k_pe.ndim() == 3 && k_pe.size(1) == 1) k_pe = k_pe.select(1, 0);
    const TensorView output = as_3d_output(output_in, H, V);
    // fp8 output: out / output_scale[0] in fp64, rounded once (as REFERENCE); else a divisor of 1.
    const double output_divisor =
        output_scale.defined() ? load_f64(output_scale.data(), DType::f32, 0) : 1.0;

    // Requests: decodes [0, num_decodes) then prefills, token rows in order.
    struct Req {
      int64_t token_begin, query_len, seq_len;
      const TensorView* block_table;
      int64_t bt_row;
      bool decode;
    };
    std::vector<Req> reqs;
    for (int i = 0; i < md.num_decodes; ++i) {  // block_table: a row per decode request
      const int32_t t0 = md.decode.query_start_loc[i];
      reqs.push_back({t0, md.decode.query_start_loc[i + 1] - t0, md.decode.seq_lens[i], &md.decode.block_table, i, true});
    }
    if (md.prefill) {
      const MLAPrefillMetadata& pre = *md.prefill;
      for (int i = 0; i < pre.num_prefills; ++i) {
        reqs.push_back({pre.token_offset + pre.query_start_loc[i],
                        pre.query_start_loc[i + 1] - pre.query_start_loc[i], pre.seq_lens[i],
                        &pre.block_table, i, false});
      }
    }
    const int64_t block_size = kv_cache.size(1);
    // Every block id read below must lie in the cache (checked before any output is written).
    for (const Req& rq : reqs) {
      const int64_t cached = rq.decode ? rq.seq_len : rq.seq_len - rq.query_len;
      const TensorView& bt = *rq.block_table;
      PAGEDATTN_CHECK(cached == 0 || (cached - 1) / block_size < bt.size(1), "metadata", kWho,
                      " forward: a request reads ", cached, " cached tokens but the block table has ",
                      bt.size(1), " columns");
      for (int64_t col = 0; col * block_size < cached; ++col) {
        const int64_t block = bt.data_as<const int32_t>()[rq.bt_row * bt.stride(0) + col * bt.stride(1)];
        PAGEDATTN_CHECK(block >= 0 && block < kv_cache.size(0), "metadata", kWho,
                        " forward: block_table row ", rq.bt_row, " column ", col, " = ", block,
                        " is outside the cache's ", kv_cache.size(0), " blocks");
      }
    }
    const bool dequant = is_fp8(cache_dtype_);
    const double k_scale = scales.k_scale;
    const double scale = params_.scale;
    const int64_t tasks = static_cast<int64_t>(reqs.size());
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t ri = 0; ri < tasks; ++ri) {
      const Req& rq = reqs[static_cast<size_t>(ri)];
      const int64_t context = rq.seq_len - rq.query_len;
      // latent rows of every key position, fp64 (seq_len, L + R)
      std::vector<double> latent(static_cast<size_t>(rq.seq_len * (L + R)));
      const TensorView& bt = *rq.block_table;
      for (int64_t pos = 0; pos < rq.seq_len; ++pos) {
        double* row = latent.data() + pos * (L + R);
        if (rq.decode || pos < context) {
          const int64_t block =
              bt.data_as<const int32_t>()[rq.bt_row * bt.stride(0) + (pos / block_size) * bt.stride(1)];
          const int64_t base = block * kv_cache.stride(0) + (pos % block_size) * kv_cache.stride(1);
          for (int64_t x = 0; x < L + R; ++x) {
            const double val = load_f64(kv_cache.data(), cache_dtype_, base + x * kv_cache.stride(2));
            row[x] = dequant ? val * k_scale : val;
          }
        } else {
          const int64_t tok = rq.token_begin + (pos - context);
          for (int64_t x = 0; x < L; ++x) {
            row[x] = load_f64(kv_c_normed.data(), kv_c_normed.dtype(),
                              tok * kv_c_normed.stride(0) + x * kv_c_normed.stride(1));
          }
          for (int64_t x = 0; x < R; ++x) {
            row[L + x] = load_f64(k_pe.data(), k_pe.dtype(), tok * k_pe.stride(0) + x * k_pe.stride(1));
          }
        }
      }
      std::vector<double> keys(static_cast<size_t>(rq.seq_len * (P + R)));
      std::vector<double> values(static_cast<size_t>(rq.seq_len * V));
      std::vector<double> qrow(static_cast<size_t>(P + R)), logits(static_cast<size_t>(rq.seq_len)),
          acc(static_cast<size_t>(V));
      for (int64_t h = 0; h < H; ++h) {
        const double* w_uk = weight_.data() + h * (P + V) * L;      // (P, L)
        const double* w_uv = weight_.data() + (h * (P + V) + P) * L;  // (V, L)
        for (int64_t pos = 0; pos < rq.seq_len; ++pos) {
          const double* row = latent.data() + pos * (L + R);
          for (int64_t i = 0; i < P; ++i) {
            double s = 0;
            for (int64_t x = 0; x < L; ++x) s += w_uk[i * L + x] * row[x];
            keys[pos * (P + R) + i] = s;
          }
          for (int64_t i = 0; i < R; ++i) keys[pos * (P + R) + P + i] = row[L + i];
          for (int64_t i = 0; i < V; ++i) {
            double s = 0;
            for (int64_t x = 0; x < L; ++x) s += w_uv[i * L + x] * row[x];
            values[pos * V + i] = s;
          }
        }
        for (int64_t j = 0; j < rq.query_len; ++j) {
          const int64_t tok = rq.token_begin + j;
          for (int64_t i = 0; i < P + R; ++i) {
            qrow[i] = load_f64(q.data(), q.dtype(), tok * q.stride(0) + h * q.stride(1) + i * q.stride(2));
          }
          const int64_t visible = context + j + 1;  // causal with context
          double m = -std::numeric_limits<double>::infinity();
          for (int64_t pos = 0; pos < visible; ++pos) {
            double s = 0;
            for (int64_t i = 0; i < P + R; ++i) s += qrow[i] * keys[pos * (P + R) + i];
            logits[pos] = s * scale;
            m = std::max(m, logits[pos]);
          }
          std::fill(acc.begin(), acc.end(), 0.0);
          double denom = 0;
          for (int64_t pos = 0; pos < visible; ++pos) {
            const double w = std::exp(logits[pos] - m);
            denom += w;
            for (int64_t i = 0; i < V; ++i) acc[i] += w * values[pos * V + i];
          }
          const int64_t out_base = tok * output.stride(0) + h * output.stride(1);
          for (int64_t i = 0; i < V; ++i) {
            host::store_rounded_f64(output.data(), output.dtype(), out_base + i * output.stride(2),
                                    acc[i] / denom / output_divisor);
          }
          if (output_lse.defined()) {
            output_lse.data_as<float>()[h * output_lse.stride(0) + tok * output_lse.stride(1)] =
                static_cast<float>(m + std::log(denom));
          }
        }
      }
    }
  }

  // Its prefill is the fp64 one, computed in place (the same arithmetic as the REFERENCE prefill
  // backend).
  std::string_view prefill_backend_name() const override { return "REFERENCE"; }
  bool fused_output_quant_supported(const QuantKey& key) const override {
    return key.kind == QuantKey::Kind::fp8_e4m3_per_tensor_static;
  }

 private:
  // A (T, H * V) output with a unit column stride viewed as (T, H, V); anything else as given.
  static TensorView as_3d_output(const TensorView& output, int64_t H, int64_t V) {
    if (output.ndim() == 2 && output.size(1) == H * V && (V <= 1 || output.stride(1) == 1)) {
      return TensorView(output.data(), output.dtype(), Shape{output.size(0), H, V},
                        Shape{output.stride(0), V, 1}, Device::cpu);
    }
    return output;
  }

  const MLAMetadata& checked_metadata(const AttentionMetadata& metadata, const char* entry) const {
    const auto* md = dynamic_cast<const MLAMetadata*>(&metadata);
    PAGEDATTN_CHECK(md != nullptr, "metadata", kWho, " ", entry,
                    ": metadata is not an MLAMetadata (build it with the MLA backend's builder)");
    check_device(md->slot_mapping, "metadata.slot_mapping", Device::cpu);
    return *md;
  }

  // The cache's shape, and every block and slot of the plan inside it (O(1): found at build()).
  void check_cache(const TensorView& kv_cache, const MLAMetadata& md, const char* entry) const {
    const int64_t row = params_.dims.latent_head_size();
    check_defined(kv_cache, "kv_cache");
    check_device(kv_cache, "kv_cache", Device::cpu);
    const DType dt[] = {cache_dtype_};
    check_dtype(kv_cache, "kv_cache", dt);
    PAGEDATTN_CHECK(kv_cache.ndim() == 3 && kv_cache.size(1) == params_.block_size &&
                        kv_cache.size(2) == row,
                    "kv_cache", kWho, " ", entry, ": kv_cache is ", kv_cache.describe(),
                    ", expected (num_blocks, ", params_.block_size, ", ", row, ")");
    md.cache_footprint.check_fits(kv_cache.size(0), kv_cache.size(1), kWho, entry);
  }

  void check_scale(const LayerScales& s, const char* entry) const {
    if (!is_fp8(cache_dtype_)) return;
    PAGEDATTN_CHECK(std::isfinite(s.k_scale) && s.k_scale > 0.f, "scales.k_scale", kWho, " ",
                    entry, ": k_scale = ", s.k_scale,
                    " must be a positive finite number for an fp8 cache");
  }

  DType cache_dtype_ = DType::bf16;
  std::vector<double> weight_;  // (H * (P + V), L) row-major, fp64
};

class ReferenceMLABackend final : public MLABackend {
 public:
  std::string_view name() const override { return "REFERENCE_MLA"; }

  std::unique_ptr<MLAAttentionImpl> make_mla_impl(const MLAImplParams& params) const override {
    return std::make_unique<ReferenceMLAImpl>(params);
  }

  std::unique_ptr<AttentionMetadataBuilder> make_backend_builder(const KVCacheSpec& spec,
                                                                 const BuilderConfig& config,
                                                                 Device device) const override {
    PAGEDATTN_CHECK(device == Device::cpu, "device", kWho, " make_builder: device = ",
                    device_name(device), " is not supported: REFERENCE_MLA runs on the cpu");
    return std::make_unique<mla::MLACommonMetadataBuilder>(spec, config, device);
  }

  std::vector<KernelBlockSize> supported_kernel_block_sizes() const override {
    return {MultipleOf{1}};
  }

  std::vector<std::string> validate_configuration(const SelectorConfig& c) const override {
    std::vector<std::string> reasons;
    mla::add_mla_common_reasons(name(), c, reasons, /*fp8_output_supported=*/true);
    if (!c.use_mla) return reasons;
    if (c.device != Device::cpu) {
      reasons.push_back(detail::concat("device = ", device_name(c.device),
                                       " is not supported: REFERENCE_MLA runs on the cpu only."));
    }
    if (!host::is_activation_dtype(c.dtype)) {
      reasons.push_back(detail::concat("dtype = ", dtype_name(c.dtype),
                                       " is not supported: REFERENCE_MLA supports float32, "
                                       "float16 and bfloat16 activations."));
    }
    if (!host::is_accepted_kv_cache_dtype(c.kv_cache_dtype)) {
      reasons.push_back(detail::concat("kv_cache_dtype = '", c.kv_cache_dtype,
                                       "' is not supported: expected one of ",
                                       host::accepted_kv_cache_dtypes(), "."));
    }
    if (c.block_size < 1) {
      reasons.push_back(detail::concat("block_size = ", c.block_size,
                                       " is not supported: REFERENCE_MLA supports any block size "
                                       ">= 1."));
    }
    return reasons;
  }

  BackendCapabilities capabilities() const override {
    BackendCapabilities caps;
    caps.devices = {Device::cpu};
    caps.dtypes = {DType::f32, DType::f16, DType::bf16};
    caps.kv_cache_dtypes = host::kv_cache_dtype_names();
    caps.head_sizes = {};
    caps.attn_types = {AttentionType::decoder};
    caps.features = {"mla", "lse", "fp8_output", "fp8_kv_cache", "batch_invariant"};
    return caps;
  }
};

}  // namespace

const AttentionBackend& reference_mla_backend() {
  static const ReferenceMLABackend backend;
  return backend;
}

}  // namespace pagedattn
