// Decode context parallelism: a rank's planned step (pagedattn/dcp.h DcpPlan) -- the plan, the
// local attention packed for the group, and the group's combine -- on host tensors (the in-memory
// group) or on the rank's GPU (NCCL; the row and merge kernels of dcp_device.cu).
#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include "pagedattn/dcp.h"
#include "pagedattn/error.h"
#include "pagedattn/layer.h"
#include "pagedattn/mla.h"
#if PAGEDATTN_HAS_CUDA
#include "dcp/dcp_device.h"
#endif

namespace pagedattn {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kLseAlign = 256;  // bytes: the LSE part of a pack starts aligned

void check_dcp_layer(const DcpConfig& config, const DcpConfig& layer, int block_size, const char* who) {
  config.validate(block_size);
  PAGEDATTN_CHECK(config == layer, "dcp", who, ": config (world_size ", config.world_size, ", rank ", config.rank,
                  ", interleave ", config.interleave, ") is not the layer's dcp (", layer.world_size, ", ", layer.rank,
                  ", ", layer.interleave, "): create the layer with the group's DcpConfig");
}

// The one-call dcp_forward's config against its communicator (before anything is planned).
void check_group(const DcpConfig& config, const DcpCommunicator& comm, const char* who) {
  PAGEDATTN_CHECK(config.world_size == comm.world_size() && config.rank == comm.rank(), "dcp", who,
                  ": config (world_size ", config.world_size, ", rank ", config.rank,
                  ") does not match the communicator's (", comm.world_size(), ", ", comm.rank(), ")");
}

// This rank's share of a step: the local step, reordered as the builder asks (MLA: decodes first).
DcpLocalStep local_step_for(AttentionMetadataBuilder& builder, const CommonAttentionMetadataArgs& global,
                            const DcpConfig& config, int block_size) {
  DcpLocalStep step = make_dcp_local_step(global, config, block_size);
  const CommonAttentionMetadataArgs& a = step.args;
  const size_t n = a.seq_lens.size();
  std::vector<int32_t> lens(n);
  for (size_t i = 0; i < n; ++i) lens[i] = a.query_start_loc[i + 1] - a.query_start_loc[i];
  const std::optional<BatchReorder> reorder = builder.reorder_batch(lens);
  if (!reorder) return step;
  DcpLocalStep out;
  CommonAttentionMetadataArgs& b = out.args;
  b.query_start_loc = {0};
  b.max_num_blocks_per_req = a.max_num_blocks_per_req;
  b.causal = a.causal;
  const size_t cols = static_cast<size_t>(a.max_num_blocks_per_req);
  for (int i : reorder->order) {
    const auto req = static_cast<size_t>(i);
    b.seq_lens.push_back(a.seq_lens[req]);
    b.block_table.insert(b.block_table.end(), a.block_table.begin() + static_cast<int64_t>(req * cols),
                         a.block_table.begin() + static_cast<int64_t>((req + 1) * cols));
    for (int32_t t = a.query_start_loc[req]; t < a.query_start_loc[req + 1]; ++t) {
      out.rows.push_back(step.rows[static_cast<size_t>(t)]);
      b.slot_mapping.push_back(a.slot_mapping[static_cast<size_t>(t)]);
    }
    b.query_start_loc.push_back(b.query_start_loc.back() + lens[req]);
  }
  return out;
}

// A layer's three inputs, per row: shape after the row dim, and dtype.
struct RowShape {
  Shape shape;
  DType dtype;
};

Shape with_rows(int64_t rows, const Shape& row) {
  Shape s;
  s.push_back(rows);
  for (int64_t d : row) s.push_back(d);
  return s;
}

std::unique_ptr<DcpPlan> make_plan(AttentionMetadataBuilder& builder, const DcpConfig& config,
                                   const CommonAttentionMetadataArgs& global, int block_size, int64_t heads,
                                   int64_t head_size_v, DType dtype, Device device, const RowShape (&inputs)[3]) {
  auto plan = std::make_unique<DcpPlan>();
  plan->config = config;
  plan->step = local_step_for(builder, global, config, block_size);
  plan->num_tokens = global.query_start_loc.back();
  plan->num_heads = heads;
  plan->head_size_v = head_size_v;
  plan->dtype = dtype;
  plan->device = device;
  const std::vector<int32_t>& rows = plan->step.rows;
  const auto n = static_cast<int64_t>(rows.size());
  plan->identity = n == plan->num_tokens;
  for (int64_t i = 0; plan->identity && i < n; ++i) plan->identity = rows[static_cast<size_t>(i)] == i;
  if (n > 0) {
    plan->metadata = make_common_attention_metadata(plan->step.args, device);
    plan->attention = builder.build(0, plan->metadata.common);
  }
  if (!plan->identity) {
    if (device != Device::cpu) {  // the row kernels' maps (the host path reads step.rows)
      Tensor host_rows(Shape{n}, DType::i32, Device::cpu), host_inverse(Shape{plan->num_tokens}, DType::i32, Device::cpu);
      std::copy(rows.begin(), rows.end(), host_rows.data_as<int32_t>());
      std::fill_n(host_inverse.data_as<int32_t>(), plan->num_tokens, -1);
      for (int64_t i = 0; i < n; ++i) host_inverse.data_as<int32_t>()[rows[static_cast<size_t>(i)]] = static_cast<int32_t>(i);
      plan->rows = host_rows.to(device);
      plan->inverse = host_inverse.to(device);
    }
    for (int i = 0; i < 3; ++i) plan->inputs[i] = Tensor(with_rows(n, inputs[i].shape), inputs[i].dtype, device);
    plan->local_out = Tensor(Shape{n, heads, head_size_v}, dtype, device);
    plan->local_lse = Tensor(Shape{heads, n}, DType::f32, device);
  }
  const int64_t out_bytes = plan->num_tokens * heads * head_size_v * static_cast<int64_t>(dtype_size(dtype));
  plan->lse_offset = (out_bytes + kLseAlign - 1) / kLseAlign * kLseAlign;
  const int64_t bytes = plan->lse_offset + heads * plan->num_tokens * 4;
  plan->send = Tensor(Shape{bytes}, DType::u8, device);
  plan->recv = Tensor(Shape{config.world_size, bytes}, DType::u8, device);
  return plan;
}

// The global rows [0, T) of a step input: defined, on the plan's device, the row shape and dtype
// the plan gathers (the layer checks the rest).
TensorView step_rows(const DcpPlan& plan, const TensorView& t, const RowShape& row, const char* argument,
                     const char* who) {
  PAGEDATTN_CHECK(t.defined() && t.device() == plan.device && t.ndim() == row.shape.ndim() + 1 &&
                      t.size(0) >= plan.num_tokens && t.dtype() == row.dtype,
                  argument, who, ": ", argument, " is ", t.describe(), ", expected (>= ", plan.num_tokens, ", ",
                  row.shape.str(), ") of ", dtype_name(row.dtype), " on ", device_name(plan.device),
                  " (the planned step's rows)");
  for (int i = 0; i < row.shape.ndim(); ++i) {
    PAGEDATTN_CHECK(t.size(i + 1) == row.shape[i], argument, who, ": ", argument, " is ", t.describe(),
                    ", expected rows of ", row.shape.str());
  }
  return t.narrow(0, 0, plan.num_tokens);
}

// Host copies of the row kernels.
void host_gather_rows(const TensorView& src, std::span<const int32_t> rows, const TensorView& dst) {
  const size_t es = src.element_size();
  const int64_t a = src.size(1), b = src.ndim() == 3 ? src.size(2) : 1;
  auto* out = static_cast<uint8_t*>(dst.data());
  for (size_t i = 0; i < rows.size(); ++i) {
    for (int64_t j = 0; j < a; ++j) {
      for (int64_t k = 0; k < b; ++k) {
        int64_t o = rows[i] * src.stride(0) + j * src.stride(1);
        if (src.ndim() == 3) o += k * src.stride(2);
        std::memcpy(out, static_cast<const uint8_t*>(src.data()) + o * static_cast<int64_t>(es), es);
        out += es;
      }
    }
  }
}

void host_pack_rows(const DcpPlan& plan) {
  const int64_t t = plan.num_tokens, h = plan.num_heads, n = plan.num_local_rows();
  const size_t row_bytes = static_cast<size_t>(h * plan.head_size_v) * dtype_size(plan.dtype);
  auto* out = static_cast<uint8_t*>(plan.send.data());
  auto* lse = reinterpret_cast<float*>(out + plan.lse_offset);
  std::memset(out, 0, static_cast<size_t>(t) * row_bytes);
  std::fill_n(lse, h * t, kNegInf);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = plan.step.rows[static_cast<size_t>(i)];
    std::memcpy(out + static_cast<size_t>(row) * row_bytes,
                static_cast<const uint8_t*>(plan.local_out.data()) + static_cast<size_t>(i) * row_bytes, row_bytes);
    for (int64_t j = 0; j < h; ++j) lse[j * t + row] = plan.local_lse.data_as<const float>()[j * n + i];
  }
}

void gather_rows(const DcpPlan& plan, const TensorView& src, const Tensor& dst) {
  if (plan.device == Device::cpu) {
    host_gather_rows(src, plan.step.rows, dst);
    return;
  }
#if PAGEDATTN_HAS_CUDA
  dcp_detail::cuda_gather_rows(src, plan.rows, dst);
#endif
}

void pack_rows(const DcpPlan& plan) {
  if (plan.device == Device::cpu) {
    host_pack_rows(plan);
    return;
  }
#if PAGEDATTN_HAS_CUDA
  dcp_detail::cuda_pack_rows(plan.local_out, plan.local_lse, plan.inverse, plan.send_out(), plan.send_lse());
#endif
}

// The local attention of a planned step: in place on the step's rows (identity), or over the
// gathered rows, then packed. forward(in0, in1, in2, out, lse) runs the layer.
template <class Forward>
void attend(DcpPlan& plan, const TensorView (&in)[3], Forward&& forward) {
  if (plan.identity) {
    if (plan.num_tokens > 0) forward(in[0], in[1], in[2], plan.send_out(), plan.send_lse());
    return;
  }
  if (plan.num_local_rows() > 0) {
    for (int i = 0; i < 3; ++i) gather_rows(plan, in[i], plan.inputs[i]);
    forward(plan.inputs[0].view(), plan.inputs[1].view(), plan.inputs[2].view(), plan.local_out.view(),
            plan.local_lse.view());
  }
  pack_rows(plan);
}

std::array<RowShape, 3> standard_rows(const AttentionLayerParams& p) {
  const int64_t kv = p.num_kv_heads.value_or(p.num_heads);
  const int64_t dv = p.head_size_v > 0 ? p.head_size_v : p.head_size;
  return {RowShape{Shape{p.num_heads, p.head_size}, p.dtype}, RowShape{Shape{kv, p.head_size}, p.dtype},
          RowShape{Shape{kv, dv}, p.dtype}};
}

std::array<RowShape, 3> mla_rows(const MLAAttentionLayerParams& p) {
  return {RowShape{Shape{p.num_heads, p.qk_head_dim}, p.dtype}, RowShape{Shape{p.kv_lora_rank}, p.dtype},
          RowShape{Shape{p.qk_rope_head_dim}, p.dtype}};
}

// What dcp_combine reads besides the plan; dcp_forward checks it before dcp_attend writes the cache.
void check_combine(const DcpPlan& plan, const DcpCommunicator& comm, const TensorView& out, const TensorView& lse) {
  constexpr const char* kWho = "dcp_combine";
  PAGEDATTN_CHECK(comm.world_size() == plan.config.world_size && comm.rank() == plan.config.rank, "comm", kWho,
                  ": the communicator is rank ", comm.rank(), " of ", comm.world_size(), ", the plan rank ",
                  plan.config.rank, " of ", plan.config.world_size);
  PAGEDATTN_CHECK(comm.device() == plan.device, "comm", kWho, ": the communicator works on ",
                  device_name(comm.device()), " tensors, the plan on ", device_name(plan.device),
                  " (host: make_in_memory_dcp_group; cuda: pagedattn/dcp_nccl.h)");
  const int64_t t = plan.num_tokens, h = plan.num_heads, d = plan.head_size_v;
  PAGEDATTN_CHECK(out.defined() && out.device() == plan.device && out.ndim() == 3 && out.size(0) >= t &&
                      out.size(1) == h && out.size(2) == d && out.dtype() == plan.dtype,
                  "out", kWho, ": out is ", out.describe(), ", expected (>= ", t, ", ", h, ", ", d, ") of ",
                  dtype_name(plan.dtype), " on ", device_name(plan.device));
  if (lse.defined()) {
    PAGEDATTN_CHECK(lse.device() == plan.device && lse.ndim() == 2 && lse.size(0) == h && lse.size(1) >= t &&
                        lse.dtype() == DType::f32,
                    "lse", kWho, ": lse is ", lse.describe(), ", expected float32 (", h, ", >= ", t, ") on ",
                    device_name(plan.device));
  }
}

}  // namespace

TensorView DcpPlan::send_out() const {
  return TensorView(send.data(), dtype, Shape{num_tokens, num_heads, head_size_v}, device, send.view().device_index());
}

TensorView DcpPlan::send_lse() const {
  return TensorView(static_cast<uint8_t*>(send.data()) + lse_offset, DType::f32, Shape{num_heads, num_tokens}, device,
                    send.view().device_index());
}

std::unique_ptr<DcpPlan> dcp_plan(const Attention& layer, AttentionMetadataBuilder& builder, const DcpConfig& config,
                                  const CommonAttentionMetadataArgs& global) {
  constexpr const char* kWho = "dcp_plan";
  const AttentionLayerParams& p = layer.params();
  check_dcp_layer(config, p.dcp, p.block_size, kWho);
  PAGEDATTN_CHECK(p.attn_type == AttentionType::decoder && p.alibi_slopes.empty() && !p.sliding_window &&
                      !p.attention_chunk_size && p.sinks.empty() && !p.kv_sharing_target_layer_name,
                  "layer", kWho, ": layer '", p.prefix,
                  "' uses ALiBi, a sliding window, chunked local attention, sinks, KV sharing or a non-decoder "
                  "type: DCP computes each rank's share on local positions and merges one sink-free softmax per "
                  "rank, so none of them is supported");
  const std::array<RowShape, 3> rows = standard_rows(p);
  const RowShape in[3] = {rows[0], rows[1], rows[2]};
  return make_plan(builder, config, global, p.block_size, p.num_heads, rows[2].shape[1], p.dtype, p.device, in);
}

std::unique_ptr<DcpPlan> dcp_plan(const MLAAttention& layer, AttentionMetadataBuilder& builder,
                                  const DcpConfig& config, const CommonAttentionMetadataArgs& global) {
  const MLAAttentionLayerParams& p = layer.params();
  check_dcp_layer(config, p.dcp, p.block_size, "dcp_plan (MLA)");
  const std::array<RowShape, 3> rows = mla_rows(p);
  const RowShape in[3] = {rows[0], rows[1], rows[2]};
  return make_plan(builder, config, global, p.block_size, p.num_heads, p.v_head_dim, p.dtype, p.device, in);
}

void dcp_attend(Attention& layer, DcpPlan& plan, const TensorView& query, const TensorView& key,
                const TensorView& value, const TensorView& kv_cache) {
  constexpr const char* kWho = "dcp_attend";
  check_dcp_layer(plan.config, layer.params().dcp, layer.params().block_size, kWho);
  const std::array<RowShape, 3> rows = standard_rows(layer.params());
  const TensorView in[3] = {step_rows(plan, query, rows[0], "query", kWho), step_rows(plan, key, rows[1], "key", kWho),
                            step_rows(plan, value, rows[2], "value", kWho)};
  attend(plan, in, [&](const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                       const TensorView& l) { layer.forward(q, k, v, kv_cache, *plan.attention, o, l); });
}

void dcp_attend(MLAAttention& layer, DcpPlan& plan, const TensorView& q, const TensorView& kv_c_normed,
                const TensorView& k_pe, const TensorView& kv_cache) {
  constexpr const char* kWho = "dcp_attend (MLA)";
  check_dcp_layer(plan.config, layer.params().dcp, layer.params().block_size, kWho);
  const std::array<RowShape, 3> rows = mla_rows(layer.params());
  const TensorView in[3] = {step_rows(plan, q, rows[0], "q", kWho),
                            step_rows(plan, kv_c_normed, rows[1], "kv_c_normed", kWho),
                            step_rows(plan, k_pe, rows[2], "k_pe", kWho)};
  attend(plan, in, [&](const TensorView& a, const TensorView& b, const TensorView& c, const TensorView& o,
                       const TensorView& l) { layer.forward(a, b, c, kv_cache, *plan.attention, o, l); });
}

void dcp_combine(DcpPlan& plan, DcpCommunicator& comm, const TensorView& out, const TensorView& lse) {
  check_combine(plan, comm, out, lse);
  const int64_t t = plan.num_tokens, h = plan.num_heads, d = plan.head_size_v;
  comm.all_gather(plan.send, plan.recv);
  const int n = plan.config.world_size;
  const int64_t bytes = plan.send.view().size(0);
  const int64_t es = static_cast<int64_t>(dtype_size(plan.dtype));
  const int index = plan.recv.view().device_index();
  auto* base = static_cast<uint8_t*>(plan.recv.data());
  const TensorView outs(base, plan.dtype, Shape{n, t, h, d}, Shape{bytes / es, h * d, d, 1}, plan.device, index);
  const TensorView lses(base + plan.lse_offset, DType::f32, Shape{n, h, t}, Shape{bytes / 4, t, 1}, plan.device, index);
  const TensorView out_rows = out.narrow(0, 0, t);
  const TensorView lse_rows = lse.defined() ? lse.narrow(1, 0, t) : TensorView{};
  if (plan.device == Device::cpu) {
    std::vector<TensorView> out_views, lse_views;
    for (int r = 0; r < n; ++r) {
      out_views.push_back(outs.select(0, r));
      lse_views.push_back(lses.select(0, r));
    }
    merge_attn_states_n(out_views, lse_views, out_rows, lse_rows);
    return;
  }
#if PAGEDATTN_HAS_CUDA
  dcp_detail::cuda_merge_states(outs, lses, out_rows, lse_rows);
#endif
}

void dcp_forward(Attention& layer, DcpPlan& plan, DcpCommunicator& comm, const TensorView& query,
                 const TensorView& key, const TensorView& value, const TensorView& kv_cache, const TensorView& out,
                 const TensorView& lse) {
  check_combine(plan, comm, out, lse);
  dcp_attend(layer, plan, query, key, value, kv_cache);
  dcp_combine(plan, comm, out, lse);
}

void dcp_forward(MLAAttention& layer, DcpPlan& plan, DcpCommunicator& comm, const TensorView& q,
                 const TensorView& kv_c_normed, const TensorView& k_pe, const TensorView& kv_cache,
                 const TensorView& out, const TensorView& lse) {
  check_combine(plan, comm, out, lse);
  dcp_attend(layer, plan, q, kv_c_normed, k_pe, kv_cache);
  dcp_combine(plan, comm, out, lse);
}

void dcp_forward(Attention& layer, AttentionMetadataBuilder& builder, DcpCommunicator& comm, const DcpConfig& config,
                 const CommonAttentionMetadataArgs& global, const TensorView& query, const TensorView& key,
                 const TensorView& value, const TensorView& kv_cache, const TensorView& out, const TensorView& lse) {
  check_group(config, comm, "dcp_forward");
  const std::unique_ptr<DcpPlan> plan = dcp_plan(layer, builder, config, global);
  dcp_forward(layer, *plan, comm, query, key, value, kv_cache, out, lse);
}

void dcp_forward(MLAAttention& layer, AttentionMetadataBuilder& builder, DcpCommunicator& comm, const DcpConfig& config,
                 const CommonAttentionMetadataArgs& global, const TensorView& q, const TensorView& kv_c_normed,
                 const TensorView& k_pe, const TensorView& kv_cache, const TensorView& out, const TensorView& lse) {
  check_group(config, comm, "dcp_forward (MLA)");
  const std::unique_ptr<DcpPlan> plan = dcp_plan(layer, builder, config, global);
  dcp_forward(layer, *plan, comm, q, kv_c_normed, k_pe, kv_cache, out, lse);
}

}  // namespace pagedattn
