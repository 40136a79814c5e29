// The REFERENCE MLA prefill backend: fp64 naive attention of the prefill tokens (vLLM
// MLAPrefillBackend interface), any dimensions, f32/f16/bf16, on the cpu.
//
// What it computes, per prefill i (query rows [qsl[i], qsl[i+1]) of q), head h, query row t:
//   new tokens:    keys = rows [qsl[i], t] of k/v (causal among the new tokens, which are the
//                  last ones of the sequence)
//   context chunk: keys = rows [cu[c][i], cu[c][i+1]) of k/v (non-causal; an empty chunk gives
//                  out 0 and lse -inf)
//   s_j = scale * (q[t, h] · k[j, h]); out = softmax(s) · v; lse = log(sum e^{s_j}) (natural).
// Precision: every product and sum in fp64; one rounding of out to its dtype, lse to f32.
// No tiling: O(keys) per query row, the oracle's job is to be obviously right.
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "backends/reference/reference_mla.h"
#include "pagedattn/error.h"

namespace pagedattn {
namespace {

constexpr const char* kWho = "REFERENCE MLA prefill: ";

class ReferencePrefill final : public MLAPrefillBackend {
 public:
  using MLAPrefillBackend::MLAPrefillBackend;
  std::string_view get_name() const override { return "REFERENCE"; }

  void run_prefill_new_tokens(const TensorView& q, const TensorView& k, const TensorView& v,
                              bool return_softmax_lse, const TensorView& out,
                              const TensorView& lse, const TensorView& output_scale) override {
    PAGEDATTN_CHECK(!output_scale.defined(), "output_scale", kWho,
                    "output_scale is given but the REFERENCE prefill backend does not write "
                    "quantized output (supports_quant_output is false)");
    const MLAPrefillMetadata& md = metadata();
    const int64_t rows = md.num_prefill_tokens;
    check(q, k, v, out, rows, return_softmax_lse ? &lse : nullptr);
    std::vector<int64_t> key_begin(md.num_prefills), key_end(md.num_prefills);
    for (int i = 0; i < md.num_prefills; ++i) {
      key_begin[i] = md.query_start_loc[i];
      key_end[i] = md.query_start_loc[i + 1];
    }
    attend(q, k, v, out, return_softmax_lse ? lse : TensorView{}, key_begin, key_end, true);
  }

  std::pair<TensorView, TensorView> run_prefill_context_chunk(int chunk_idx, const TensorView& q,
                                                              const TensorView& k,
                                                              const TensorView& v,
                                                              const TensorView& out,
                                                              const TensorView& lse) override {
    const MLAPrefillMetadata& md = metadata();
    PAGEDATTN_CHECK(md.chunked_context.has_value(), "chunk_idx", kWho, "chunk_idx = ", chunk_idx,
                    " but the step has no context chunks (no prefill has context)");
    const MLAChunkedContextMetadata& cc = *md.chunked_context;
    PAGEDATTN_CHECK(chunk_idx >= 0 && chunk_idx < cc.num_chunks, "chunk_idx", kWho, "chunk_idx = ",
                    chunk_idx, " is out of range: expected [0, ", cc.num_chunks, ")");
    const int np = md.num_prefills;
    const int32_t* cu = cc.cu_seq_lens.data() + static_cast<size_t>(chunk_idx) * (np + 1);
    check(q, k, v, out, md.num_prefill_tokens, &lse, cu[np]);
    std::vector<int64_t> key_begin(np), key_end(np);
    for (int i = 0; i < np; ++i) {
      key_begin[i] = cu[i];
      key_end[i] = cu[i + 1];
    }
    attend(q, k, v, out, lse, key_begin, key_end, false);
    return {out, lse};
  }

 private:
  const MLAPrefillMetadata& metadata() const {
    PAGEDATTN_CHECK(prefill_metadata_ != nullptr, "prefill_metadata", kWho,
                    "prepare_metadata was not called before the run");
    return *prefill_metadata_;
  }

  // q (Tp, H, P + R), k (>= key_rows, H, P + R), v (>= key_rows, H, V), out (Tp, H, V),
  // lse (H, Tp) f32 when given.
  void check(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
             int64_t rows, const TensorView* lse, int64_t key_rows = -1) const {
    const MLAPrefillParams& p = params_;
    const int64_t h = p.num_heads, qk = p.qk_nope_head_dim + p.qk_rope_head_dim,
                  dv = p.v_head_dim;
    if (key_rows < 0) key_rows = rows;
    const DType act[] = {p.dtype};
    const std::pair<const TensorView*, const char*> acts[] = {{&q, "q"}, {&k, "k"}, {&v, "v"},
                                                              {&out, "out"}};
    for (const auto& [t, name] : acts) {
      check_defined(*t, name);
      check_device(*t, name, Device::cpu);
      check_dtype(*t, name, act);
      check_ndim(*t, name, 3);
    }
    PAGEDATTN_CHECK(q.size(0) == rows && q.size(1) == h && q.size(2) == qk, "q", kWho, "q is ",
                    q.describe(), ", expected (", rows, ", ", h, ", ", qk, ")");
    PAGEDATTN_CHECK(k.size(0) >= key_rows && k.size(1) == h && k.size(2) == qk, "k", kWho,
                    "k is ", k.describe(), ", expected (>= ", key_rows, ", ", h, ", ", qk, ")");
    PAGEDATTN_CHECK(v.size(0) >= key_rows && v.size(1) == h && v.size(2) == dv, "v", kWho,
                    "v is ", v.describe(), ", expected (>= ", key_rows, ", ", h, ", ", dv, ")");
    PAGEDATTN_CHECK(out.size(0) == rows && out.size(1) == h && out.size(2) == dv, "out", kWho,
                    "out is ", out.describe(), ", expected (", rows, ", ", h, ", ", dv, ")");
    if (lse != nullptr) {
      check_defined(*lse, "lse");
      check_device(*lse, "lse", Device::cpu);
      const DType f32[] = {DType::f32};
      check_dtype(*lse, "lse", f32);
      check_shape(*lse, "lse", Shape{h, rows});
    }
  }

  void attend(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
              const TensorView& lse, const std::vector<int64_t>& key_begin,
              const std::vector<int64_t>& key_end, bool causal) const {
    const MLAPrefillMetadata& md = *prefill_metadata_;
    const int np = md.num_prefills;
    const int64_t num_heads = params_.num_heads;
    const int64_t qk = params_.qk_nope_head_dim + params_.qk_rope_head_dim;
    const int64_t dv = params_.v_head_dim;
    const double scale = params_.scale;
    const int64_t tasks = int64_t{np} * num_heads;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int i = static_cast<int>(task / num_heads);
      const int64_t h = task % num_heads;
      std::vector<double> logits, acc(static_cast<size_t>(dv));
      for (int64_t t = md.query_start_loc[i]; t < md.query_start_loc[i + 1]; ++t) {
        const int64_t kb = key_begin[i];
        const int64_t ke = causal ? kb + (t - md.query_start_loc[i]) + 1 : key_end[i];
        logits.assign(static_cast<size_t>(ke - kb), 0.0);
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = kb; j < ke; ++j) {
          double s = 0;
          for (int64_t d = 0; d < qk; ++d) {
            s += load_f64(q.data(), q.dtype(), t * q.stride(0) + h * q.stride(1) + d * q.stride(2)) *
                 load_f64(k.data(), k.dtype(), j * k.stride(0) + h * k.stride(1) + d * k.stride(2));
          }
          logits[j - kb] = s * scale;
          m = std::max(m, logits[j - kb]);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double denom = 0;
        for (int64_t j = kb; j < ke; ++j) {
          const double w = std::exp(logits[j - kb] - m);
          denom += w;
          for (int64_t d = 0; d < dv; ++d) {
            acc[d] += w * load_f64(v.data(), v.dtype(),
                                   j * v.stride(0) + h * v.stride(1) + d * v.stride(2));
          }
        }
        for (int64_t d = 0; d < dv; ++d) {
          const double o = denom > 0 ? acc[d] / denom : 0.0;
          store_f32(out.data(), out.dtype(),
                    t * out.stride(0) + h * out.stride(1) + d * out.stride(2),
                    static_cast<float>(o));
        }
        if (lse.defined()) {
          const double l = denom > 0 ? m + std::log(denom) : -std::numeric_limits<double>::infinity();
          lse.data_as<float>()[h * lse.stride(0) + t * lse.stride(1)] = static_cast<float>(l);
        }
      }
    }
  }
};

class ReferencePrefillClass final : public MLAPrefillBackendClass {
 public:
  std::string_view get_name() const override { return "REFERENCE"; }
  Device device() const override { return Device::cpu; }
  std::vector<DType> supported_dtypes() const override {
    return {DType::f32, DType::f16, DType::bf16};
  }
  std::unique_ptr<MLAPrefillBackend> create(const MLAPrefillParams& p) const override {
    PAGEDATTN_CHECK(p.device == Device::cpu, "device", kWho, "device = ", device_name(p.device),
                    " is not supported: the REFERENCE prefill backend runs on the cpu");
    PAGEDATTN_CHECK(supports_dtype(p.dtype), "dtype", kWho, "dtype = ", dtype_name(p.dtype),
                    " is not supported: expected float32, float16 or bfloat16");
    PAGEDATTN_CHECK(p.num_heads > 0 && p.qk_nope_head_dim > 0 && p.qk_rope_head_dim > 0 &&
                        p.v_head_dim > 0 && p.kv_lora_rank > 0,
                    "params", kWho, "num_heads = ", p.num_heads, ", kv_lora_rank = ",
                    p.kv_lora_rank, ", qk_nope_head_dim = ", p.qk_nope_head_dim,
                    ", qk_rope_head_dim = ", p.qk_rope_head_dim, ", v_head_dim = ", p.v_head_dim,
                    ": every one must be > 0");
    PAGEDATTN_CHECK(std::isfinite(p.scale) && p.scale > 0.f, "scale", kWho, "scale = ", p.scale,
                    " must be a finite value > 0");
    return std::make_unique<ReferencePrefill>(p);
  }
};

}  // namespace

const MLAPrefillBackendClass& reference_mla_prefill_backend() {
  static const ReferencePrefillClass backend;
  return backend;
}

}  // namespace pagedattn
