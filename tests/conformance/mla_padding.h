// Padding requests (query_len 0) in MLA batches: a step that holds them, anywhere (among the
// decodes, between decodes and prefills, among the prefills, at the end; with and without context
// pages), must compute exactly what the same step without them computes. Runs one MLAAttention
// layer of a given backend on a device over both batches (separate caches with the same context)
// and returns the two outputs and LSEs, byte for byte. The batch without padding is the one the
// conformance grids check against the oracle; equality here is what makes padding a no-op.
// Header-only: used by tests/mla (CPU_MLA, REFERENCE_MLA) and tests/gpu (CUDA_MLA).
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "pagedattn/pagedattn.h"

namespace pagedattn::conformance::mla_padding {

struct Request {
  int context_len = 0;
  int query_len = 0;  // 0: a padding request
};

struct Outputs {
  std::vector<uint8_t> output, lse;  // the step's T rows (host bytes)
  int num_decodes = 0, num_prefills = 0;  // the plan's parts
};

inline std::vector<uint8_t> host_bytes(const TensorView& t) {
  Tensor h(t.shape(), t.dtype(), Device::cpu);
  h.copy_from(t);
  const auto* p = static_cast<const uint8_t*>(h.data());
  return {p, p + h.nbytes()};
}

// One step of `requests` (ordered decodes first, padding anywhere) on `backend` / `device`;
// skip_padding drops the query_len 0 requests from the batch (and nothing else).
inline Outputs run_step(const std::string& backend, Device device, DType dtype, const std::vector<Request>& requests,
                        bool skip_padding, uint64_t seed, MLADimensions dims = {64, 32, 16, 32},
                        int num_heads = 4) {
  const int kL = dims.kv_lora_rank, kP = dims.qk_nope_head_dim, kR = dims.qk_rope_head_dim, kV = dims.v_head_dim;
  const int kH = num_heads, kBlock = 16;
  MLAAttentionLayerParams p;
  p.num_heads = kH;
  p.kv_lora_rank = kL;
  p.qk_nope_head_dim = kP;
  p.qk_rope_head_dim = kR;
  p.qk_head_dim = kP + kR;
  p.v_head_dim = kV;
  p.block_size = kBlock;
  p.dtype = dtype;
  p.device = device;
  p.backend = backend;
  p.prefix = "model.layers.0.self_attn.mla";
  MLAAttention layer(p);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  const auto random = [&](Shape shape) {
    Tensor t(shape, dtype, Device::cpu);
    for (int64_t i = 0; i < t.numel(); ++i) store_f32(t.data(), dtype, i, dist(rng));
    return t;
  };
  layer.process_weights_after_loading(random(Shape{kH * (kP + kV), kL}).to(device));

  // Pages: request r owns blocks first_block[r] .. (all requests, padding included, so that both
  // batches see the same cache); the context rows are drawn for every request in order.
  std::vector<int> first_block;
  int blocks = 0, max_blocks = 1;
  for (const Request& r : requests) {
    const int n = (r.context_len + r.query_len + kBlock - 1) / kBlock;
    first_block.push_back(blocks);
    blocks += n;
    max_blocks = std::max(max_blocks, n);
  }
  Tensor cache = layer.allocate_kv_cache(blocks + 1);
  cache.fill_bytes(0);
  std::vector<int64_t> ctx_slots;
  for (size_t i = 0; i < requests.size(); ++i) {
    for (int pos = 0; pos < requests[i].context_len; ++pos) ctx_slots.push_back(int64_t{first_block[i]} * kBlock + pos);
  }
  const int64_t C = static_cast<int64_t>(ctx_slots.size());
  if (C > 0) {
    Tensor slots(Shape{C}, DType::i64, Device::cpu);
    std::memcpy(slots.data(), ctx_slots.data(), ctx_slots.size() * sizeof(int64_t));
    concat_and_cache_mla(random(Shape{C, kL}).to(device), random(Shape{C, kR}).to(device), cache,
                         slots.to(device), "auto");
  }

  // The step: the live requests' tokens in order (the same rows in both batches).
  CommonAttentionMetadataArgs a;
  a.query_start_loc = {0};
  a.max_num_blocks_per_req = max_blocks;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    if (skip_padding && r.query_len == 0) continue;
    a.query_start_loc.push_back(a.query_start_loc.back() + r.query_len);
    a.seq_lens.push_back(r.context_len + r.query_len);
    for (int b = 0; b < max_blocks; ++b) {
      const int n = (r.context_len + r.query_len + kBlock - 1) / kBlock;
      a.block_table.push_back(b < n ? first_block[i] + b : 0);
    }
    for (int t = 0; t < r.query_len; ++t) a.slot_mapping.push_back(int64_t{first_block[i]} * kBlock + r.context_len + t);
  }
  const int64_t T = a.query_start_loc.back();
  const auto common = make_common_attention_metadata(a, device);
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(16, 256, 512), device);
  const auto md = builder->build(0, common.common);
  const auto* mla_md = dynamic_cast<const MLAMetadata*>(md.get());
  Outputs outs;
  if (mla_md != nullptr) {
    outs.num_decodes = mla_md->num_decodes;
    outs.num_prefills = mla_md->num_prefills;
  }
  const Tensor q = random(Shape{T, kH, kP + kR}).to(device);
  const Tensor kv_c = random(Shape{T, kL}).to(device), k_pe = random(Shape{T, kR}).to(device);
  Tensor out(Shape{T, kH, kV}, dtype, device), lse(Shape{kH, T}, DType::f32, device);
  out.fill_bytes(0xff);
  lse.fill_bytes(0xff);
  layer.forward(q, kv_c, k_pe, cache, *md, out, lse);
  outs.output = host_bytes(out);
  outs.lse = host_bytes(lse);
  return outs;
}

// Batches of the tests: padding among decodes (with and without context), between the decodes
// and the prefills, among the prefills and at the end.
inline std::vector<std::vector<Request>> padded_batches() {
  return {
      {{40, 1}, {0, 0}, {70, 1}, {33, 0}, {5, 1}, {90, 0}, {20, 7}, {0, 0}, {64, 19}, {12, 0}},
      {{0, 0}, {0, 0}, {100, 1}},
      {{50, 0}, {0, 12}, {17, 0}, {30, 5}},
      {{3, 1}, {9, 1}, {0, 0}},
  };
}

}  // namespace pagedattn::conformance::mla_padding
