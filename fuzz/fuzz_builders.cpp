// libFuzzer target: the host backends' plan (AttentionMetadataBuilder::build) and run (the
// layer's forward) on decoded layers and batches, valid and invalid.
//
// Byte 0 picks the backend: CPU, REFERENCE (Attention layer) or CPU_MLA, REFERENCE_MLA
// (MLAAttention layer). Then: the layer (heads, head sizes, dtype, KV-cache dtype, block size,
// attention type, window / soft cap / ALiBi / sinks, layer scales, cache layout), the builder's
// limits, a batch (fuzz_batch.h: mostly consistent, sometimes corrupted, sometimes with a
// perturbed tensor layout), common_prefix_len, the cache size (usually the batch's block pool,
// sometimes smaller: a plan built for a larger cache) and the activations (row counts, output
// dtype, fp8 output with output_scale, LSE). Properties:
//   1. layer construction and build either throw pagedattn::Error or succeed;
//   2. forward either throws Error and leaves the cache byte-identical, or succeeds with finite
//      output rows (and no NaN / +inf LSE), having changed only the cache slots the plan's
//      slot_mapping names;
//   3. no crash, no ASan / UBSan report.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "fuzz_batch.h"
#include "fuzz_input.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn::fuzz {
namespace {

// Per-tensor scales: ordinary values, or 0 / -1 / NaN / +-inf / the smallest denormal (never a
// huge finite value: a valid scale of 1e38 overflows the f32 scores, garbage in by definition).
float pick_scale(ByteReader& in) {
  const uint8_t b = in.u8();
  constexpr float kOrdinary[] = {1.f, 0.5f, 2.f, 0.25f};
  if (b < 0xF0) return kOrdinary[b % 4];
  constexpr float kCorner[] = {0.f, -1.f, NAN, INFINITY, -INFINITY, 1e-45f, 1.f, 1.f};
  return kCorner[b & 7];
}

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Every element of a contiguous allocation: uniform in [-amplitude, amplitude], stored in dtype.
void fill(const Tensor& t, uint64_t& seed, float amplitude = 1.f) {
  const int64_t n = static_cast<int64_t>(t.nbytes() / dtype_size(t.dtype()));
  for (int64_t i = 0; i < n; ++i) {
    const float u = static_cast<float>(splitmix(seed) >> 40) / static_cast<float>(1 << 24);
    store_f32(t.data(), t.dtype(), i, amplitude * (2.f * u - 1.f));
  }
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return {p, p + t.nbytes()};
}

// Rows [0, rows) of a contiguous (T, ...) output must be finite; lse (H, T) may be -inf only.
void check_outputs(const Tensor& out, int64_t rows, const Tensor* lse) {
  const int64_t per_row = out.numel() / std::max<int64_t>(out.shape()[0], 1);
  for (int64_t i = 0; i < rows * per_row; ++i) {
    const float x = load_f32(out.data(), out.dtype(), i);
    PAGEDATTN_FUZZ_ASSERT(std::isfinite(x), "output element " + std::to_string(i) + " = " + std::to_string(x));
  }
  if (lse == nullptr) return;
  const int64_t heads = lse->shape()[0], cols = lse->shape()[1];
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < rows; ++t) {
      const float x = lse->data_as<float>()[h * cols + t];
      PAGEDATTN_FUZZ_ASSERT(!std::isnan(x) && x != INFINITY, "lse[" + std::to_string(h) + "][" +
                                                                 std::to_string(t) + "] = " + std::to_string(x));
    }
  }
}

// Bytes of the cache that belong to a (block, offset) the plan's slot mapping does not name must
// be unchanged. dims: the cache's logical shape; token_dims: the (block, offset) dims in it.
void check_only_slots_written(const Tensor& cache, const std::vector<uint8_t>& before,
                              const AttentionMetadata& plan, int64_t key_rows, int block_size,
                              int block_dim) {
  std::set<int64_t> written;
  const TensorView& slots = plan.slot_mapping;
  const int64_t n = std::min<int64_t>(slots.defined() ? slots.size(0) : 0, key_rows);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = slots.data_as<const int64_t>()[i * slots.stride(0)];
    if (s >= 0) written.insert(s);
  }
  const TensorView& v = cache.view();
  const int nd = v.ndim();
  const size_t elem = dtype_size(v.dtype());
  std::vector<int64_t> idx(static_cast<size_t>(nd), 0);
  const auto* after = static_cast<const uint8_t*>(v.data());
  for (int64_t e = 0; e < v.numel(); ++e) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) off += idx[static_cast<size_t>(d)] * v.stride(d);
    const int64_t slot = idx[static_cast<size_t>(block_dim)] * block_size + idx[static_cast<size_t>(block_dim + 1)];
    if (!written.count(slot)) {
      PAGEDATTN_FUZZ_ASSERT(std::memcmp(after + off * elem, before.data() + off * elem, elem) == 0,
                            "forward changed cache slot " + std::to_string(slot) + ", which slot_mapping does not name");
    }
    for (int d = nd - 1; d >= 0; --d) {  // next logical index
      if (++idx[static_cast<size_t>(d)] < v.size(d)) break;
      idx[static_cast<size_t>(d)] = 0;
    }
  }
}

// PAGEDATTN_FUZZ_TRACE=1: one line per stage of each input on stderr (to read what a corpus
// input decodes to: build/asan/fuzz/fuzz_builders <file>).
template <typename... Parts>
void trace(const Parts&... parts) {
  static const bool on = std::getenv("PAGEDATTN_FUZZ_TRACE") != nullptr;
  if (on) std::fprintf(stderr, "%s\n", detail::concat(parts...).c_str());
}

// A forward threw Error: the cache must be byte-identical (every value a call reads is checked
// before its first write: DESIGN.md section 1, docs/reliability.md).
void check_rejected_forward(const Error& e, const Tensor& cache, const std::vector<uint8_t>& before) {
  if (!cache.defined() || std::memcmp(cache.data(), before.data(), before.size()) == 0) return;
  property_failed("a forward rejected with Error('" + e.argument() + "', \"" + e.what() + "\") changed the cache");
}

struct Step {
  RawBatch batch;
  std::unique_ptr<BatchViews> views;
  int common_prefix_len = 0;
  bool fast_build = false;
  int64_t cache_blocks = 0;
};

// Limits, batch and cache size shared by both layer kinds.
Step decode_step(ByteReader& in, int block_size, int max_context_len, bool decodes_first) {
  Step s;
  BatchLimits limits;
  limits.block_size = block_size;
  limits.num_blocks = in.small(1, 24);
  const bool no_context = max_context_len == 0;
  limits.max_context_len = max_context_len;
  if (no_context && in.u8() >= 0xF0) limits.max_context_len = 4;  // invalid for encoders
  s.batch = decode_batch(in, limits);
  if (decodes_first && (in.u8() & 0x0F) != 0x0F) {
    // MLA builders want decodes (query_len <= 1) first: rebuild the batch with them in front.
    RawBatch& b = s.batch;
    std::vector<int> order(static_cast<size_t>(b.seq_lens.size()));
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
    auto qlen = [&b](int r) {
      return static_cast<size_t>(r) + 1 < b.query_start_loc.size()
                 ? int64_t{b.query_start_loc[r + 1]} - b.query_start_loc[r] : 0;
    };
    std::stable_partition(order.begin(), order.end(), [&](int r) { return qlen(r) <= 1; });
    RawBatch sorted = b;
    sorted.query_start_loc.assign(1, 0);
    sorted.slot_mapping.clear();
    std::vector<std::vector<int64_t>> slots_of(order.size());
    for (size_t r = 0, t = 0; r < order.size(); ++r) {
      for (int64_t k = 0; k < qlen(static_cast<int>(r)) && t < b.slot_mapping.size(); ++k) slots_of[r].push_back(b.slot_mapping[t++]);
    }
    for (size_t i = 0; i < order.size(); ++i) {
      const int r = order[i];
      sorted.query_start_loc.push_back(wrap_i32(sorted.query_start_loc.back() + qlen(r)));
      sorted.seq_lens[i] = b.seq_lens[static_cast<size_t>(r)];
      sorted.num_computed_tokens[i] = b.num_computed_tokens[static_cast<size_t>(r)];
      for (int c = 0; c < b.cols; ++c) sorted.block_table[i * b.cols + c] = b.block_table[static_cast<size_t>(r) * b.cols + c];
      for (int64_t slot : slots_of[static_cast<size_t>(r)]) sorted.slot_mapping.push_back(slot);
    }
    while (sorted.slot_mapping.size() < b.slot_mapping.size()) sorted.slot_mapping.push_back(-1);
    b = std::move(sorted);
  }
  s.views = std::make_unique<BatchViews>(in, s.batch, /*layout_perturbation=*/in.u8() >= 0xF0);
  const uint8_t p = in.u8();
  if (p >= 0xE0) s.common_prefix_len = in.length(64);
  else if (p >= 0xC0) s.common_prefix_len = block_size * in.small(0, 3);
  s.fast_build = in.flag();
  s.cache_blocks = in.u8() >= 0xE0 ? in.small(1, limits.num_blocks) : limits.num_blocks;
  return s;
}

const char* const kCacheDtypes[] = {"auto", "auto", "fp8", "fp8_e5m2", "bfloat16", "float16", "float32", "auto"};

void fuzz_standard(ByteReader& in, const char* backend) {
  AttentionLayerParams p;
  p.backend = backend;
  p.prefix = "fuzz.attn";
  const int kv_heads = in.small(1, 2);
  p.num_kv_heads = kv_heads;
  p.num_heads = kv_heads * in.small(1, 2);
  p.head_size = in.u8() < 0xF0 ? 16 * in.small(1, 2) : in.small(1, 40);
  const uint8_t hv = in.u8();
  p.head_size_v = hv < 0xC0 ? 0 : 16 * (hv % 3);
  p.dtype = static_cast<DType>(in.small(0, 2));  // f32, f16, bf16
  p.kv_cache_dtype = kCacheDtypes[in.small(0, 7)];
  p.block_size = in.u8() < 0xF0 ? (1 << in.small(0, 4)) : in.length(8);
  if (p.block_size > 256) return;  // a cache of 24 such blocks is an allocation the caller asked for
  const int type = in.small(0, 7);
  p.attn_type = type < 5 ? AttentionType::decoder
              : type == 5 ? AttentionType::encoder
              : type == 6 ? AttentionType::encoder_only : AttentionType::encoder_decoder;
  const uint8_t features = in.u8();
  if (features & 0x01) p.sliding_window = in.small(1, 24);
  if (features & 0x02) p.logits_soft_cap = in.small(1, 3) * 10.f;
  if (features & 0x04) for (int h = 0; h < p.num_heads; ++h) p.alibi_slopes.push_back(std::ldexp(1.f, -(h + 1)));
  if (features & 0x08) for (int h = 0; h < p.num_heads; ++h) p.sinks.push_back(static_cast<float>(in.small(0, 4)) - 2.f);
  set_kv_cache_layout((features & 0x10) ? KVCacheLayout::HND : KVCacheLayout::NHD);
  const bool cached = uses_kv_cache(p.attn_type);

  const int max_num_seqs = in.small(1, 8);
  const int max_num_batched_tokens = in.u8() < 0xF0 ? 64 : in.small(1, 64);
  std::optional<Attention> layer;
  std::unique_ptr<AttentionMetadataBuilder> builder;
  try {
    layer.emplace(p);
    const KVCacheSpec spec = cached ? layer->kv_cache_spec()
                                    : KVCacheSpec::full_attention(p.block_size, kv_heads, p.head_size,
                                                                  p.dtype, p.head_size_v);
    builder = layer->backend().make_builder(
        spec, layer->builder_config(max_num_seqs, max_num_batched_tokens, 128), Device::cpu);
  } catch (const Error& e) {
    trace("layer/builder rejected: ", e.what());
    return;
  }
  LayerScales& scales = layer->scales();
  scales.k_scale = pick_scale(in);
  scales.v_scale = pick_scale(in);
  Tensor k_per_head, v_per_head;
  if (in.u8() >= 0xF0) {
    k_per_head = Tensor(Shape{in.u8() >= 0xF0 ? 3 : kv_heads}, DType::f32);
    v_per_head = Tensor(Shape{kv_heads}, DType::f32);
    for (int64_t h = 0; h < k_per_head.numel(); ++h) k_per_head.data_as<float>()[h] = pick_scale(in);
    for (int64_t h = 0; h < v_per_head.numel(); ++h) v_per_head.data_as<float>()[h] = pick_scale(in);
    scales.k_scale_per_head = k_per_head.view();
    scales.v_scale_per_head = v_per_head.view();
  }

  Step step = decode_step(in, p.block_size, /*max_context_len=*/cached ? 40 : 0, /*decodes_first=*/false);
  std::shared_ptr<const AttentionMetadata> plan;
  try {
    plan = builder->build(step.common_prefix_len, step.views->common, step.fast_build);
  } catch (const Error& e) {
    trace("build rejected: ", e.what());
    return;
  }
  PAGEDATTN_FUZZ_ASSERT(plan != nullptr, "build returned no plan");

  uint64_t seed = 0x5EED0000ull + in.u8();
  Tensor cache;
  if (cached) {
    try {
      cache = layer->allocate_kv_cache(step.cache_blocks);
    } catch (const Error&) {
      return;
    }
    fill(cache, seed);
  }
  const int64_t hv_size = p.head_size_v > 0 ? p.head_size_v : p.head_size;
  const uint8_t rows_byte = in.u8();
  const int64_t rows = std::max<int64_t>(0, plan->num_actual_tokens + (rows_byte < 0xF0 ? rows_byte % 3 : -1));
  Tensor q(Shape{rows, p.num_heads, p.head_size}, p.dtype);
  Tensor k(Shape{rows, kv_heads, p.head_size}, p.dtype);
  Tensor v(Shape{rows, kv_heads, hv_size}, p.dtype);
  fill(q, seed);
  fill(k, seed);
  fill(v, seed);
  const bool no_kv = p.attn_type == AttentionType::encoder_decoder && in.u8() >= 0xC0;  // encoder K/V cached
  const bool fp8_out = in.u8() >= 0xE0;
  Tensor out(Shape{rows, p.num_heads, hv_size}, fp8_out ? DType::fp8_e4m3 : p.dtype);
  out.fill_bytes(0xFF);
  Tensor output_scale;
  if (fp8_out) {
    output_scale = Tensor(Shape{1}, DType::f32);
    output_scale.data_as<float>()[0] = pick_scale(in);
  }
  Tensor lse;
  if (in.flag()) lse = Tensor(Shape{p.num_heads, rows}, DType::f32);

  const std::vector<uint8_t> before = cached ? bytes_of(cache) : std::vector<uint8_t>{};
  try {
    layer->forward(q, no_kv ? TensorView() : k.view(), no_kv ? TensorView() : v.view(), cache, *plan, out,
                   lse, output_scale);
  } catch (const Error& e) {
    trace("forward rejected: ", e.what());
    check_rejected_forward(e, cache, before);
    return;
  }
  trace("forward ran: ", layer->backend().name(), ", ", plan->num_reqs, " requests, ",
        plan->num_actual_tokens, " tokens", plan->use_cascade ? ", cascade" : "");
  check_outputs(out, plan->num_actual_tokens, lse.defined() ? &lse : nullptr);
  if (cached) check_only_slots_written(cache, before, *plan, no_kv ? 0 : rows, p.block_size, 1);
}

void fuzz_mla(ByteReader& in, const char* backend) {
  MLAAttentionLayerParams p;
  p.backend = backend;
  p.prefix = "fuzz.mla";
  p.num_heads = in.small(1, 3);
  p.kv_lora_rank = in.u8() < 0xF0 ? 16 * in.small(1, 2) : in.small(1, 40);
  p.qk_nope_head_dim = 8 * in.small(1, 2);
  p.qk_rope_head_dim = 16;
  p.qk_head_dim = p.qk_nope_head_dim + p.qk_rope_head_dim;
  p.v_head_dim = 8 * in.small(1, 2);
  p.dtype = static_cast<DType>(in.small(0, 2));
  p.kv_cache_dtype = kCacheDtypes[in.small(0, 7)];
  p.block_size = in.u8() < 0xF0 ? 16 * in.small(1, 2) : in.small(1, 20);
  std::optional<MLAAttention> layer;
  std::unique_ptr<AttentionMetadataBuilder> builder;
  uint64_t seed = 0x3D1A0000ull + in.u8();
  const int max_num_seqs = in.small(1, 8);
  // A small chunked-prefill workspace (vLLM's minimum is max_num_seqs * block_size) makes long
  // contexts run in several chunks; 0 = vLLM's rule.
  const int64_t workspace = in.u8() >= 0xC0 ? int64_t{max_num_seqs} * p.block_size * in.small(1, 3) : 0;
  try {
    layer.emplace(p);
    builder = layer->backend().make_builder(
        layer->kv_cache_spec(), layer->builder_config(max_num_seqs, 64, 128, workspace), Device::cpu);
    Tensor weight(Shape{p.num_heads * (p.qk_nope_head_dim + p.v_head_dim), p.kv_lora_rank}, p.dtype);
    fill(weight, seed, 0.25f);
    layer->process_weights_after_loading(weight);
  } catch (const Error& e) {
    trace("layer/builder rejected: ", e.what());
    return;
  }
  layer->scales().k_scale = pick_scale(in);

  Step step = decode_step(in, p.block_size, /*max_context_len=*/100, /*decodes_first=*/true);
  std::shared_ptr<const AttentionMetadata> plan;
  try {
    plan = builder->build(step.common_prefix_len, step.views->common, step.fast_build);
  } catch (const Error& e) {
    trace("build rejected: ", e.what());
    return;
  }
  PAGEDATTN_FUZZ_ASSERT(plan != nullptr, "build returned no plan");
  Tensor cache;
  try {
    cache = layer->allocate_kv_cache(step.cache_blocks);
  } catch (const Error&) {
    return;
  }
  fill(cache, seed);
  const uint8_t rows_byte = in.u8();
  const int64_t rows = std::max<int64_t>(0, plan->num_actual_tokens + (rows_byte < 0xF0 ? rows_byte % 3 : -1));
  const int64_t L = p.kv_lora_rank, R = p.qk_rope_head_dim;
  Tensor q(Shape{rows, p.num_heads, p.qk_head_dim}, p.dtype);
  Tensor kv_c(Shape{rows, L}, p.dtype);
  Tensor k_pe = in.flag() ? Tensor(Shape{rows, 1, R}, p.dtype) : Tensor(Shape{rows, R}, p.dtype);
  fill(q, seed);
  fill(kv_c, seed);
  fill(k_pe, seed);
  Tensor out(Shape{rows, p.num_heads, p.v_head_dim}, p.dtype);
  out.fill_bytes(0xFF);
  Tensor lse;
  if (in.flag()) lse = Tensor(Shape{p.num_heads, rows}, DType::f32);
  const std::vector<uint8_t> before = bytes_of(cache);
  try {
    layer->forward(q, kv_c, k_pe, cache, *plan, out, lse);
  } catch (const Error& e) {
    trace("forward rejected: ", e.what());
    check_rejected_forward(e, cache, before);
    return;
  }
  trace("forward ran: ", layer->backend().name(), ", ", plan->num_reqs, " requests, ",
        plan->num_actual_tokens, " tokens");
  check_outputs(out, plan->num_actual_tokens, lse.defined() ? &lse : nullptr);
  check_only_slots_written(cache, before, *plan, rows, p.block_size, 0);
}

}  // namespace
}  // namespace pagedattn::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pagedattn::fuzz::ByteReader in(data, size);
  switch (in.u8() % 4) {
    case 0: pagedattn::fuzz::fuzz_standard(in, "CPU"); break;
    case 1: pagedattn::fuzz::fuzz_standard(in, "REFERENCE"); break;
    case 2: pagedattn::fuzz::fuzz_mla(in, "CPU_MLA"); break;
    default: pagedattn::fuzz::fuzz_mla(in, "REFERENCE_MLA"); break;
  }
  return 0;
}
