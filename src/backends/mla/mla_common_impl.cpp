// MLACommonImpl (vLLM MLACommonImpl): the run of an MLA layer, device-generic through the
// primitives (batched_gemm, copy_3d) and the public ops; the backend supplies only the latent
// decode attention (forward_decode). No allocation in forward: every buffer is the builder's
// MLAWorkspace (mla_common.h), every operand a view.
//
// Data flow of one step (Td decode tokens first, then Tp prefill tokens; H heads):
//   decode:  q_latent[:, h, :L] = q[:Td, h, :P] · W_UK[h]              batched_gemm (H, Td, L, P)
//            q_latent[:, :, L:] = q[:Td, :, P:]                        copy_3d
//            o_latent, lse      = forward_decode(q_latent, cache)      the backend
//            out[:Td, h]        = o_latent[:, h] · W_UV[h]             batched_gemm (H, Td, V, L)
//   prefill: kv_up  = kv_c[Td:] · w_kv                                 batched_gemm (1, Tp, H(P+V), L)
//   (batch-invariant plans: the three products through batched_gemm_fixed_rows, one row count per
//   launch, so a row's sums do not depend on the batch's token count)
//            k_full = [kv_up[..., :P], k_pe broadcast over heads]      copy_3d x2 (head stride 0)
//            new-token attention (causal) -> out, or suffix + LSE when any prefill has context
//            per context chunk c: gather the cache rows (dequantized) -> up-project as above
//            -> non-causal attention -> LSE-merge into the running context result
//            out[Td:] = merge(context, suffix) (output_lse too when given)
// Precision: each gemm accumulates in f32 and rounds once to the activation dtype (q_latent,
// o_latent, kv_up, out), as vLLM's bf16 matmuls; attention precision is the backends'.
//
// fp8 output (output_scale given; only impls whose fused_output_quant_supported is true): the
// output is e4m3 = saturate(o / output_scale[0]). Which writes are fused and which are staged:
//   decode rows         W_UV batched_gemm (cuBLAS on CUDA writes bf16/f16/f32 only) into
//                       suffix_out[:Td] (free until the prefill part), then one quantize_e4m3_3d
//                       pass into out[:Td];
//   prefill, no context fused when the prefill backend supports_quant_output (it gets
//                       output_scale and writes e4m3 itself; none does today), else
//                       run_prefill_new_tokens into suffix_out, then one quantize pass;
//   prefill, context    the final merge_attn_states into chunk_out (free once the chunks are
//                       merged), then one quantize pass (the public merge op stays unquantized).
// A staged row is rounded twice (to the activation dtype, then to e4m3), as output_store.cuh's
// staged kernels; the quantize pass reads the scale on the tensors' device, and on CUDA an
// invalid scale writes NaN (the host check rejects it before anything is written). The staging
// rows are the builder's (T, H, V) step buffers (T >= any token count): no allocation in forward.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "backends/mla/mla_common.h"
#include "pagedattn/error.h"
#include "pagedattn/ops.h"

namespace pagedattn::mla {
namespace {

constexpr const char* kWho = "MLA";

bool is_activation(DType d) { return d == DType::f32 || d == DType::f16 || d == DType::bf16; }

void check_last_contiguous(const TensorView& t, const char* name) {
  PAGEDATTN_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, name, kWho, ": ", name, " ",
                  t.describe(), " has strides ", t.strides().str(),
                  ", expected the last dim contiguous");
}

// The output as (T, H, V): a (T, H * V) output with unit column stride is viewed as
// (T, H, V):(row stride, V, 1); anything else is returned as given (checked by the caller).
TensorView as_3d_output(const TensorView& output, int64_t H, int64_t V) {
  if (output.ndim() == 2 && output.size(1) == H * V && output.stride(1) == 1) {
    return TensorView(output.data(), output.dtype(), Shape{output.size(0), H, V},
                      Shape{output.stride(0), V, 1}, output.device(), output.device_index());
  }
  return output;
}

// A CUDA plan lives in its builder's reused device arrays: valid until the next build().
void check_plan_current(const MLAMetadata& md, const char* entry) {
  PAGEDATTN_CHECK(md.stamp.current(), "metadata", kWho, " ", entry, ": the plan is stale (built as "
                  "plan ", md.stamp.generation, " but its builder has since built another or been "
                  "destroyed): a CUDA plan is valid until its builder's next build()");
}

}  // namespace

MLACommonImpl::MLACommonImpl(MLAImplParams p) : MLAAttentionImpl(std::move(p)) {
  const MLAImplParams& q = params_;
  const MLADimensions& d = q.dims;
  PAGEDATTN_CHECK(is_activation(q.dtype), "dtype", kWho, ": dtype = ", dtype_name(q.dtype),
                  " is not supported: expected float32, float16 or bfloat16");
  check_mla_impl_params(kWho, q);
  validate_kv_cache_dtype(q.kv_cache_dtype);
  MLAPrefillSelectorConfig sc;
  sc.dtype = q.dtype;
  sc.mla_dimensions = d;
  sc.device = q.device;
  prefill_class_ = &get_mla_prefill_backend(device_capability(q.device), sc, q.prefill_backend);
  MLAPrefillParams pp;
  pp.num_heads = q.num_heads;
  pp.scale = q.scale;
  pp.kv_lora_rank = d.kv_lora_rank;
  pp.qk_nope_head_dim = d.qk_nope_head_dim;
  pp.qk_rope_head_dim = d.qk_rope_head_dim;
  pp.v_head_dim = d.v_head_dim;
  pp.dtype = q.dtype;
  pp.device = q.device;
  prefill_ = prefill_class_->create(pp);
  PAGEDATTN_CHECK(prefill_ != nullptr, "prefill_backend", kWho, ": prefill backend ",
                  prefill_class_->get_name(), " created no runner");
}

std::string_view MLACommonImpl::prefill_backend_name() const { return prefill_->get_name(); }

void MLACommonImpl::process_weights_after_loading(const TensorView& w) {
  const MLADimensions& d = params_.dims;
  const int64_t H = params_.num_heads, L = d.kv_lora_rank, P = d.qk_nope_head_dim,
                V = d.v_head_dim;
  check_defined(w, "kv_b_proj_weight");
  const DType act[] = {params_.dtype};
  check_dtype(w, "kv_b_proj_weight", act);
  check_device(w, "kv_b_proj_weight", params_.device);
  check_shape(w, "kv_b_proj_weight", Shape{H * (P + V), L});
  check_contiguous(w, "kv_b_proj_weight");
  // One-time split on the host (exact element copies), then one upload per weight.
  Tensor host(Shape{H * (P + V), L}, params_.dtype, Device::cpu);
  host.copy_from(w);
  const size_t es = dtype_size(params_.dtype);
  const auto* src = static_cast<const char*>(host.data());
  Tensor uk(Shape{H, P, L}, params_.dtype), uv(Shape{H, L, V}, params_.dtype),
      kv(Shape{L, H * (P + V)}, params_.dtype);
  auto* uk_p = static_cast<char*>(uk.data());
  auto* uv_p = static_cast<char*>(uv.data());
  auto* kv_p = static_cast<char*>(kv.data());
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t i = 0; i < P + V; ++i) {
      const int64_t row = h * (P + V) + i;
      for (int64_t l = 0; l < L; ++l) {
        const char* e = src + (row * L + l) * static_cast<int64_t>(es);
        if (i < P) std::copy(e, e + es, uk_p + ((h * P + i) * L + l) * static_cast<int64_t>(es));
        else std::copy(e, e + es, uv_p + ((h * L + l) * V + (i - P)) * static_cast<int64_t>(es));
        std::copy(e, e + es, kv_p + (l * H * (P + V) + row) * static_cast<int64_t>(es));
      }
    }
  }
  if (params_.device == Device::cpu) {
    w_uk_ = std::move(uk);
    w_uv_ = std::move(uv);
    w_kv_ = std::move(kv);
  } else {
    w_uk_ = uk.to(params_.device);
    w_uv_ = uv.to(params_.device);
    w_kv_ = kv.to(params_.device);
  }
}

void MLACommonImpl::do_kv_cache_update(const LayerScales& scales, const TensorView& kv_c_normed,
                                       const TensorView& k_pe, const TensorView& kv_cache,
                                       const AttentionMetadata& metadata) {
  const auto* md = dynamic_cast<const MLAMetadata*>(&metadata);
  PAGEDATTN_CHECK(md != nullptr, "metadata", kWho,
                  " do_kv_cache_update: metadata is not an MLAMetadata (build it with the MLA "
                  "backend's builder)");
  check_plan_current(*md, "do_kv_cache_update");
  check_defined(kv_cache, "kv_cache");
  check_ndim(kv_cache, "kv_cache", 3);
  md->cache_footprint.check_fits(kv_cache.size(0), kv_cache.size(1), kWho, "do_kv_cache_update");
  concat_and_cache_mla(kv_c_normed, k_pe, kv_cache, md->slot_mapping, params_.kv_cache_dtype,
                       scales.k_scale);
}

void MLACommonImpl::check_forward(const LayerScales& scales, const TensorView& q,
                                  const TensorView& kv_c_normed, const TensorView& k_pe_in,
                                  const TensorView& kv_cache, const AttentionMetadata& metadata,
                                  const TensorView& output_in, const TensorView& output_scale,
                                  const TensorView& output_lse) const {
  // ---- checks (messages are built only on failure) ----
  const auto* mdp = dynamic_cast<const MLAMetadata*>(&metadata);
  PAGEDATTN_CHECK(mdp != nullptr, "metadata", kWho,
                  " forward: metadata is not an MLAMetadata (build it with the MLA backend's "
                  "builder)");
  const MLAMetadata& md = *mdp;
  check_plan_current(md, "forward");
  const MLADimensions& d = params_.dims;
  const int64_t H = params_.num_heads, L = d.kv_lora_rank, R = d.qk_rope_head_dim,
                P = d.qk_nope_head_dim, V = d.v_head_dim;
  const DType dt = params_.dtype;
  const Device dev = params_.device;
  PAGEDATTN_CHECK(md.workspace != nullptr && md.workspace->dims == d &&
                      md.workspace->num_heads == H && md.workspace->dtype == dt &&
                      md.workspace->device == dev,
                  "metadata", kWho,
                  " forward: the plan's workspace does not match this layer (build the plan with "
                  "a builder whose BuilderConfig has this layer's num_heads, mla_dimensions and "
                  "mla_dtype, on its device)");
  PAGEDATTN_CHECK(w_uk_.defined(), "kv_b_proj_weight", kWho,
                  " forward: process_weights_after_loading was not called");
  const int64_t T = md.num_actual_tokens;
  const int64_t Td = md.num_decode_tokens;
  const DType act[] = {dt};
  check_defined(q, "q");
  check_dtype(q, "q", act);
  check_device(q, "q", dev);
  PAGEDATTN_CHECK(q.ndim() == 3 && q.size(0) >= T && q.size(1) == H && q.size(2) == P + R, "q",
                  kWho, " forward: q is ", q.describe(), ", expected (>= ", T, ", ", H, ", ",
                  P + R, ")");
  check_last_contiguous(q, "q");
  TensorView k_pe = k_pe_in;
  if (k_pe.ndim() == 3 && k_pe.size(1) == 1) k_pe = k_pe.select(1, 0);
  check_defined(kv_c_normed, "kv_c_normed");
  check_dtype(kv_c_normed, "kv_c_normed", act);
  check_device(kv_c_normed, "kv_c_normed", dev);
  PAGEDATTN_CHECK(kv_c_normed.ndim() == 2 && kv_c_normed.size(0) >= T && kv_c_normed.size(1) == L,
                  "kv_c_normed", kWho, " forward: kv_c_normed is ", kv_c_normed.describe(),
                  ", expected (>= ", T, ", ", L, ")");
  check_last_contiguous(kv_c_normed, "kv_c_normed");
  check_defined(k_pe, "k_pe");
  check_dtype(k_pe, "k_pe", act);
  check_device(k_pe, "k_pe", dev);
  PAGEDATTN_CHECK(k_pe.ndim() == 2 && k_pe.size(0) >= T && k_pe.size(1) == R, "k_pe", kWho,
                  " forward: k_pe is ", k_pe_in.describe(), ", expected (>= ", T, ", ", R,
                  ") or (>= ", T, ", 1, ", R, ")");
  check_last_contiguous(k_pe, "k_pe");
  check_defined(output_in, "output");
  const DType fp8_out[] = {DType::fp8_e4m3};
  check_dtype(output_in, "output",
              output_scale.defined() ? std::span<const DType>(fp8_out) : std::span<const DType>(act));
  check_device(output_in, "output", dev);
  if (output_scale.defined()) {
    PAGEDATTN_CHECK(fused_output_quant_supported(QuantKey{}), "output_scale", kWho,
                    " forward: output_scale is given but this backend does not support fused fp8 "
                    "output quantization");
    const DType f32[] = {DType::f32};
    check_device(output_scale, "output_scale", dev);
    check_dtype(output_scale, "output_scale", f32);
    PAGEDATTN_CHECK(output_scale.numel() == 1, "output_scale", kWho, " forward: output_scale is ",
                    output_scale.describe(), ", expected float32 (1,)");
    if (dev == Device::cpu) {  // a device scale is read by the quantize kernel (NaN if invalid)
      const float s = output_scale.data_as<const float>()[0];
      PAGEDATTN_CHECK(std::isfinite(s) && s > 0.f, "output_scale", kWho,
                      " forward: output_scale[0] = ", s, " must be a positive finite number");
    }
  }
  const TensorView out = as_3d_output(output_in, H, V);
  PAGEDATTN_CHECK(out.ndim() == 3 && out.size(0) >= T && out.size(1) == H && out.size(2) == V,
                  "output", kWho, " forward: output is ", output_in.describe(), ", expected (>= ",
                  T, ", ", H, ", ", V, ") or (>= ", T, ", ", H * V, ")");
  check_last_contiguous(out, "output");
  if (output_lse.defined()) {
    const DType f32[] = {DType::f32};
    check_dtype(output_lse, "output_lse", f32);
    check_device(output_lse, "output_lse", dev);
    PAGEDATTN_CHECK(output_lse.ndim() == 2 && output_lse.size(0) == H && output_lse.size(1) >= T,
                    "output_lse", kWho, " forward: output_lse is ", output_lse.describe(),
                    ", expected (", H, ", >= ", T, ")");
  }
  check_defined(kv_cache, "kv_cache");
  check_device(kv_cache, "kv_cache", dev);
  const DType cache_dt[] = {kv_cache_storage_dtype(params_.kv_cache_dtype, dt)};
  check_dtype(kv_cache, "kv_cache", cache_dt);
  PAGEDATTN_CHECK(kv_cache.ndim() == 3 && kv_cache.size(1) == params_.block_size &&
                      kv_cache.size(2) == L + R,
                  "kv_cache", kWho, " forward: kv_cache is ", kv_cache.describe(),
                  ", expected (num_blocks, ", params_.block_size, ", ", L + R, ")");
  if (is_fp8(cache_dt[0])) {
    PAGEDATTN_CHECK(std::isfinite(scales.k_scale) && scales.k_scale > 0.f, "scales.k_scale", kWho,
                    " forward: k_scale = ", scales.k_scale,
                    " must be a positive finite number for an fp8 cache");
  }
  // Every block a request reads (and every slot written) lies in this cache: O(1), from build().
  md.cache_footprint.check_fits(kv_cache.size(0), kv_cache.size(1), kWho, "forward");
  if (Td > 0) {
    check_decode(scales, kv_cache, md,
                 output_lse.defined() ? output_lse.narrow(1, 0, Td) : TensorView{});
  }
}

void MLACommonImpl::forward(const LayerScales& scales, const TensorView& q,
                            const TensorView& kv_c_normed, const TensorView& k_pe_in,
                            const TensorView& kv_cache, const AttentionMetadata& metadata,
                            const TensorView& output_in, const TensorView& output_scale,
                            const TensorView& output_lse) {
  check_forward(scales, q, kv_c_normed, k_pe_in, kv_cache, metadata, output_in, output_scale,
                output_lse);
  const MLAMetadata& md = static_cast<const MLAMetadata&>(metadata);
  const MLADimensions& d = params_.dims;
  const int64_t H = params_.num_heads, L = d.kv_lora_rank, R = d.qk_rope_head_dim,
                P = d.qk_nope_head_dim, V = d.v_head_dim;
  const DType dt = params_.dtype;
  const Device dev = params_.device;
  const int64_t Td = md.num_decode_tokens, Tp = md.num_prefill_tokens;
  TensorView k_pe = k_pe_in;
  if (k_pe.ndim() == 3 && k_pe.size(1) == 1) k_pe = k_pe.select(1, 0);
  const TensorView out = as_3d_output(output_in, H, V);
  const bool quantize = output_scale.defined();  // fp8 output: see the top of this file
  // CPU: this call's own step buffers (concurrent forwards lease other sets; a new set is made
  // only while forwards overlap). CUDA: the builder's one set, used in stream order by plans
  // that pass the PlanStamp check above (mla_common.h).
  std::optional<host::RunBufferPool<MLAStepBuffers>::Lease> lease;
  MLAStepBuffers* buffers = md.workspace->device_buffers.get();
  if (dev == Device::cpu) {
    lease.emplace(md.workspace->host_buffers.acquire());
    buffers = &**lease;
  }
  MLAStepBuffers& ws = *buffers;
  // Batch-invariant plans: every product in launches of one row count (batched_gemm_fixed_rows),
  // so no row's sums depend on the batch's token count.
  const auto gemm = [&](int batch, int m, int n, int k, const MatrixRef& a, const MatrixRef& b,
                        const MutableMatrixRef& c) {
    if (md.batch_invariant) {
      batched_gemm_fixed_rows(dev, batch, m, n, k, a, b, c, ws.gemm_a_stage, ws.gemm_c_stage);
    } else {
      batched_gemm(dev, batch, m, n, k, a, b, c);
    }
  };

  // ---- decode: absorbed attention over the latent cache ----
  if (Td > 0) {
    const int td = static_cast<int>(Td);
    const TensorView q_lat = ws.q_latent.view().narrow(0, 0, Td);  // (Td, H, L+R):(H(L+R), L+R, 1)
    gemm(static_cast<int>(H), td, static_cast<int>(L), static_cast<int>(P),
         MatrixRef{q.data(), dt, q.stride(1), q.stride(0), 1}, MatrixRef{w_uk_.data(), dt, P * L, L, 1},
         MutableMatrixRef{q_lat.data(), dt, L + R, H * (L + R)});
    copy_3d(q.narrow(0, 0, Td).narrow(2, P, R), q_lat.narrow(2, L, R));
    const TensorView o_lat = ws.o_latent.view().narrow(0, 0, Td);  // (Td, H, L):(HL, L, 1)
    const TensorView lse = output_lse.defined() ? output_lse.narrow(1, 0, Td) : TensorView{};
    forward_decode(scales, q_lat, kv_cache, md, o_lat, lse);
    // fp8 output: the gemm writes the staging rows (activation dtype), one pass quantizes them.
    const TensorView o_d = quantize ? ws.suffix_out.view().narrow(0, 0, Td) : out.narrow(0, 0, Td);
    gemm(static_cast<int>(H), td, static_cast<int>(V), static_cast<int>(L), MatrixRef{o_lat.data(), dt, L, H * L, 1},
         MatrixRef{w_uv_.data(), dt, L * V, V, 1}, MutableMatrixRef{o_d.data(), dt, o_d.stride(1), o_d.stride(0)});
    if (quantize) quantize_e4m3_3d(o_d, out.narrow(0, 0, Td), output_scale);
  }
  if (Tp == 0) return;
  PAGEDATTN_CHECK(md.prefill.has_value(), "metadata", kWho,
                  " forward: the plan has prefill tokens but no prefill part");
  const MLAPrefillMetadata& pre = *md.prefill;

  // ---- prefill: up-projected MHA (P + R keys, V values) ----
  const int64_t HPV = H * (P + V);
  // Up-projects `rows` latent rows (kv (rows, >= L) with row stride kv_stride) and rope rows
  // (pe (rows, R) with row stride pe_stride) into kv_up[:rows] and k_full[:rows].
  const auto up_project = [&](const void* kv, int64_t kv_stride, const void* pe, int64_t pe_stride,
                              int64_t rows) {
    gemm(1, static_cast<int>(rows), static_cast<int>(HPV), static_cast<int>(L), MatrixRef{kv, dt, 0, kv_stride, 1},
         MatrixRef{w_kv_.data(), dt, 0, HPV, 1}, MutableMatrixRef{ws.kv_up.data(), dt, 0, HPV});
    const TensorView kv_up = ws.kv_up.view().narrow(0, 0, rows);   // (rows, H, P+V)
    const TensorView k_full = ws.k_full.view().narrow(0, 0, rows); // (rows, H, P+R)
    copy_3d(kv_up.narrow(2, 0, P), k_full.narrow(2, 0, P));
    // k_pe broadcast over heads: (rows, H, R):(pe_stride, 0, 1)
    const TensorView pe_b(const_cast<void*>(pe), dt, Shape{rows, H, R}, Shape{pe_stride, 0, 1},
                          dev, output_in.device_index());
    copy_3d(pe_b, k_full.narrow(2, P, R));
  };
  const auto elem = static_cast<int64_t>(dtype_size(dt));
  up_project(static_cast<const char*>(kv_c_normed.data()) + Td * kv_c_normed.stride(0) * elem,
             kv_c_normed.stride(0),
             static_cast<const char*>(k_pe.data()) + Td * k_pe.stride(0) * elem, k_pe.stride(0),
             Tp);
  const TensorView q_p = q.narrow(0, Td, Tp);
  const TensorView out_p = out.narrow(0, Td, Tp);
  const TensorView lse_p = output_lse.defined() ? output_lse.narrow(1, Td, Tp) : TensorView{};
  const auto k_rows = [&](int64_t rows) { return ws.k_full.view().narrow(0, 0, rows); };
  const auto v_rows = [&](int64_t rows) { return ws.kv_up.view().narrow(0, 0, rows).narrow(2, P, V); };
  // prefill_ keeps `pre` from prepare_metadata to its last run: one forward at a time here.
  const std::lock_guard<std::mutex> prefill_lock(prefill_mutex_);
  prefill_->prepare_metadata(pre);
  if (!pre.chunked_context) {
    if (!quantize) {
      prefill_->run_prefill_new_tokens(q_p, k_rows(Tp), v_rows(Tp), lse_p.defined(), out_p, lse_p);
    } else if (prefill_->supports_quant_output(QuantKey{})) {  // fused: e4m3 written by the kernel
      prefill_->run_prefill_new_tokens(q_p, k_rows(Tp), v_rows(Tp), lse_p.defined(), out_p, lse_p,
                                       output_scale);
    } else {  // staged in suffix_out (unused without context), then one quantize pass
      const TensorView staged = ws.suffix_out.view().narrow(0, 0, Tp);
      prefill_->run_prefill_new_tokens(q_p, k_rows(Tp), v_rows(Tp), lse_p.defined(), staged, lse_p);
      quantize_e4m3_3d(staged, out_p, output_scale);
    }
    return;
  }
  const TensorView suffix_out = ws.suffix_out.view().narrow(0, 0, Tp);
  const TensorView suffix_lse = ws.suffix_lse.view().narrow(1, 0, Tp);
  prefill_->run_prefill_new_tokens(q_p, k_rows(Tp), v_rows(Tp), true, suffix_out, suffix_lse);

  const MLAChunkedContextMetadata& cc = *pre.chunked_context;
  const TensorView context_out = ws.context_out.view().narrow(0, 0, Tp);
  const TensorView lse_buffers[2] = {ws.context_lse.view().narrow(1, 0, Tp),
                                     ws.merged_lse.view().narrow(1, 0, Tp)};
  const TensorView chunk_out = ws.chunk_out.view().narrow(0, 0, Tp);
  const TensorView chunk_lse = ws.chunk_lse.view().narrow(1, 0, Tp);
  TensorView state_out, state_lse;  // the context result so far
  int state_buffer = 0;
  for (int c = 0; c < cc.num_chunks; ++c) {
    const int64_t rows = cc.chunk_total_tokens[c];
    gather_and_maybe_dequant_cache(kv_cache, ws.gather.view(), pre.block_table,
                                   cc.cu_seq_lens_device.select(0, c), pre.num_prefills,
                                   params_.kv_cache_dtype, scales.k_scale,
                                   cc.chunk_starts_device.select(0, c));
    // gather (W, L+R):(L+R, 1): latent [:L], rope [L:]
    up_project(ws.gather.data(), L + R, static_cast<const char*>(ws.gather.data()) + L * elem,
               L + R, rows);
    if (c == 0) {
      std::tie(state_out, state_lse) = prefill_->run_prefill_context_chunk(
          c, q_p, k_rows(rows), v_rows(rows), context_out, lse_buffers[0]);
      state_buffer = 0;
    } else {
      const auto [o, l] =
          prefill_->run_prefill_context_chunk(c, q_p, k_rows(rows), v_rows(rows), chunk_out,
                                              chunk_lse);
      // Output may alias the prefix element for element (merge_attn_states); LSEs ping-pong.
      const int next = 1 - state_buffer;
      merge_attn_states(context_out, state_out, state_lse, o, l, lse_buffers[next]);
      state_out = context_out;
      state_lse = lse_buffers[next];
      state_buffer = next;
    }
  }
  if (!quantize) {
    merge_attn_states(out_p, state_out, state_lse, suffix_out, suffix_lse, lse_p);
    return;
  }
  // fp8 output: merged into chunk_out (no longer read: every chunk is merged into context_out),
  // then one quantize pass.
  const TensorView staged = ws.chunk_out.view().narrow(0, 0, Tp);
  merge_attn_states(staged, state_out, state_lse, suffix_out, suffix_lse, lse_p);
  quantize_e4m3_3d(staged, out_p, output_scale);
}

}  // namespace pagedattn::mla
