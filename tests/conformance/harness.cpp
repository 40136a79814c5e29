// Conformance harness (see harness.h).
#include "conformance/harness.h"
#include "conformance/uniform_float.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string_view>

namespace pagedattn::conformance {
namespace {

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- device handling: the ONE place inputs go to a device and results come back -------------
Tensor upload(const Tensor& host, Device device) { return host.to(device); }
Tensor download(const Tensor& t) { return t.to(Device::cpu); }

// Sets the KV-cache layout for the lifetime of the guard (cache allocation reads it).
class LayoutGuard {
 public:
  explicit LayoutGuard(KVCacheLayout layout) { set_kv_cache_layout(layout); }
  ~LayoutGuard() { set_kv_cache_layout(std::nullopt); }
  LayoutGuard(const LayoutGuard&) = delete;
  LayoutGuard& operator=(const LayoutGuard&) = delete;
};

class RandomValues {
 public:
  RandomValues(uint64_t seed, Distribution distribution)
      : rng_(seed), distribution_(distribution) {}
  float next() {
    return distribution_ == Distribution::uniform ? uniform_float(rng_, -1.f, 1.f) : normal_(rng_);
  }
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng_); }
  std::mt19937_64& engine() { return rng_; }

 private:
  std::mt19937_64 rng_;
  Distribution distribution_;
  std::normal_distribution<float> normal_{0.f, 1.f};
};

// A contiguous host tensor of random values, rounded into `dtype`.
// (The element loops here and in compare read the size, data pointer and strides once: asked per
// element they cost more than the kernels under test, 5-10x more under ASan.)
Tensor random_tensor(Shape shape, DType dtype, RandomValues& values) {
  Tensor t(shape, dtype, Device::cpu);
  void* const data = t.data();
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) store_f32(data, dtype, i, values.next());
  return t;
}

// Fills the whole storage of a dense host tensor (any stride order) with finite "stale data".
void fill_stale(Tensor& t, uint64_t seed) {
  std::mt19937_64 rng(seed);
  void* const data = t.data();
  const DType dtype = t.dtype();
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) store_f32(data, dtype, i, uniform_float(rng, -2.f, 2.f));
}

Tensor f32_vector(const std::vector<float>& values) {
  Tensor t(Shape{static_cast<int64_t>(values.size())}, DType::f32, Device::cpu);
  std::copy(values.begin(), values.end(), t.data_as<float>());
  return t;
}

// Reads elements of a host view by index; the strides are read once.
class ElementReader {
 public:
  explicit ElementReader(const TensorView& t) : data_(t.data()), dtype_(t.dtype()) {
    for (int d = 0; d < t.ndim() && d < kMaxDims; ++d) strides_[d] = t.stride(d);
  }
  double operator()(int64_t i0, int64_t i1) const {
    return load_f64(data_, dtype_, i0 * strides_[0] + i1 * strides_[1]);
  }
  double operator()(int64_t i0, int64_t i1, int64_t i2) const {
    return load_f64(data_, dtype_, i0 * strides_[0] + i1 * strides_[1] + i2 * strides_[2]);
  }
  double operator()(int64_t i0, int64_t i1, int64_t i2, int64_t i3, int64_t i4) const {
    return load_f64(data_, dtype_,
                    i0 * strides_[0] + i1 * strides_[1] + i2 * strides_[2] + i3 * strides_[3] +
                        i4 * strides_[4]);
  }

 private:
  const void* data_;
  DType dtype_;
  int64_t strides_[kMaxDims] = {};
};

AttentionLayerParams layer_params(const AttentionBackend& backend, Device device,
                                  const CaseInputs& in) {
  const ConformanceCase& c = in.c;
  AttentionLayerParams p;
  p.num_heads = c.num_heads;
  p.head_size = c.head_size;
  p.head_size_v = c.head_size_v;
  p.scale = in.scale;
  p.num_kv_heads = c.num_kv_heads;
  p.alibi_slopes = in.alibi_slopes;
  p.sliding_window = c.sliding_window;
  p.logits_soft_cap = c.soft_cap;
  p.attn_type = c.attn_type;
  p.kv_cache_dtype = c.kv_cache_dtype;
  p.block_size = c.block_size;
  p.sinks = in.sinks;
  p.prefix = "conformance.layers.0.attn";
  p.dtype = c.dtype;
  p.device = device;
  p.backend = std::string(backend.name());
  return p;
}

int num_context_tokens(const CaseInputs& in) { return in.context_start.back(); }

DType storage_dtype(const ConformanceCase& c) {
  return kv_cache_storage_dtype(c.kv_cache_dtype, c.dtype);
}

// The layer's KV-cache spec (as Attention::kv_cache_spec makes it). encoder / encoder_only layers
// have no cache; their builders still take a spec, the full-attention one.
KVCacheSpec case_spec(const ConformanceCase& c) {
  const int dv = c.head_size_v == c.head_size ? 0 : c.head_size_v;
  if (c.attn_type == AttentionType::encoder_decoder) {
    return KVCacheSpec::cross_attention(c.block_size, c.num_kv_heads, c.head_size, storage_dtype(c),
                                        dv);
  }
  if (c.sliding_window && c.attn_type == AttentionType::decoder) {
    return KVCacheSpec::sliding_window_attention(c.block_size, c.num_kv_heads, c.head_size,
                                                 storage_dtype(c), *c.sliding_window, dv);
  }
  return KVCacheSpec::full_attention(c.block_size, c.num_kv_heads, c.head_size, storage_dtype(c),
                                     dv);
}

// Builder limits generous enough for the case's step and its context-fill pseudo-request.
BuilderConfig case_builder_config(const ConformanceCase& c, int max_num_seqs, int max_tokens,
                                  int max_model_len) {
  BuilderConfig b;
  b.num_heads = c.num_heads;
  b.num_kv_heads = c.num_kv_heads;
  b.head_size = c.head_size;
  b.head_size_v = c.value_head_size();
  b.max_num_seqs = std::max(max_num_seqs, 8);
  b.max_num_batched_tokens = std::max(max_tokens, 256);
  b.max_model_len = std::max(max_model_len, 256);
  b.sliding_window = c.sliding_window;
  b.use_alibi = c.alibi;
  b.attn_type = c.attn_type;
  b.num_speculative_tokens = c.num_speculative_tokens;
  return b;
}

BuilderConfig case_builder_config(const CaseInputs& in) {
  const int max_seq =
      in.seq_lens.empty() ? 1 : *std::max_element(in.seq_lens.begin(), in.seq_lens.end());
  const int most_tokens = std::max({in.num_tokens, num_context_tokens(in), 1});
  return case_builder_config(in.c, in.num_reqs(), most_tokens, std::max(max_seq, most_tokens));
}

// The impl parameters of the case (as the Attention layer passes them), for backends driven
// without a layer.
AttentionImplParams case_impl_params(const CaseInputs& in, Device device) {
  const ConformanceCase& c = in.c;
  AttentionImplParams p;
  p.num_heads = c.num_heads;
  p.head_size = c.head_size;
  p.head_size_v = c.head_size_v;
  p.scale = in.scale;
  p.num_kv_heads = c.num_kv_heads;
  p.alibi_slopes = in.alibi_slopes;
  p.sliding_window = c.sliding_window;
  p.kv_cache_dtype = c.kv_cache_dtype;
  p.logits_soft_cap = c.soft_cap;
  p.attn_type = c.attn_type;
  p.sinks = in.sinks;
  p.dtype = c.dtype;
  p.device = device;
  p.block_size = c.block_size;
  return p;
}

bool is_registered(const AttentionBackend& backend) {
  return find_backend(backend.name()) == &backend;
}

std::string batch_string(const std::vector<RequestShape>& batch) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < batch.size(); ++i) {
    os << (i ? "," : "") << "(" << batch[i].context_len << "," << batch[i].query_len << ")";
  }
  os << "]";
  return os.str();
}

}  // namespace

// ---- cases
// ---------------------------------------------------------------------------------------

bool ConformanceCase::fp8_kv() const {
  return kv_cache_dtype == "fp8" || kv_cache_dtype == "fp8_e4m3" || kv_cache_dtype == "fp8_e5m2";
}

std::string ConformanceCase::describe() const {
  std::ostringstream os;
  os << attention_type_name(attn_type) << " " << dtype_name(dtype) << " kv=" << kv_cache_dtype
     << " D=" << head_size;
  if (head_size_v > 0 && head_size_v != head_size) os << " Dv=" << head_size_v;
  os << " Hq=" << num_heads << " Hkv=" << num_kv_heads << " bs=" << block_size << " "
     << kv_cache_layout_name(layout);
  if (sliding_window) os << " window=" << *sliding_window;
  if (soft_cap) os << " soft_cap=" << *soft_cap;
  if (alibi) os << " alibi";
  if (sinks) os << " sinks";
  if (return_lse) os << " lse";
  if (fp8_output) os << " fp8_output";
  if (quant_query) os << " quant_query";
  if (per_head_kv_scales) os << " per_head_scales";
  if (cascade_prefix > 0) os << " cascade_prefix=" << cascade_prefix;
  if (pad_tokens > 0) os << " pad=" << pad_tokens;
  if (num_speculative_tokens > 0) os << " spec=" << num_speculative_tokens;
  os << (distribution == Distribution::uniform ? " uniform" : " normal");
  os << " batch=" << batch_string(batch);
  return os.str();
}

SelectorConfig ConformanceCase::selector_config(Device device) const {
  SelectorConfig s;
  s.head_size = head_size;
  s.dtype = dtype;
  s.kv_cache_dtype = kv_cache_dtype;
  s.block_size = block_size;
  s.has_sink = sinks;
  s.attn_type = attn_type;
  s.device = device;
  s.head_size_v = head_size_v;
  s.use_alibi = alibi;
  s.use_sliding_window = sliding_window.has_value();
  s.use_logits_soft_cap = soft_cap.has_value();
  s.fp8_output = fp8_output;
  return s;
}

double tolerance(const ConformanceCase& c) {
  if (c.fp8_kv() || c.fp8_output) return 6e-2;
  switch (c.dtype) {
    case DType::f32:
      return 1e-5;
    case DType::f16:
      return 2e-3;
    default:
      return 8e-3;
  }
}

bool full_grid_requested() {
  const char* env = std::getenv("PAGEDATTN_FULL_GRID");
  return env != nullptr && std::string_view(env) == "1";
}

std::vector<ConformanceCase> conformance_grid() { return conformance_grid(full_grid_requested()); }

namespace {

// Batch shapes by attention type. Every list mixes lengths; see the comments.
const std::vector<std::vector<RequestShape>>& decoder_batches() {
  static const std::vector<std::vector<RequestShape>> batches = {
      {{0, 5}, {17, 1}, {9, 0}, {33, 7}, {5, 1}},   // mixed: prefill, decodes, empty query, chunk
      {{20, 1}, {3, 1}, {40, 1}, {1, 1}},           // 1-token decodes
      {{8, 45}, {30, 1}},                           // a long chunk with context + a decode
      {{0, 1}, {50, 0}, {0, 0}, {12, 12}, {2, 3}},  // ragged, empty requests
  };
  return batches;
}
const std::vector<std::vector<RequestShape>>& encoder_batches() {
  static const std::vector<std::vector<RequestShape>> batches = {
      {{0, 5}, {0, 1}, {0, 12}, {0, 0}, {0, 9}},
      {{0, 30}},
      {{0, 2}, {0, 17}},
  };
  return batches;
}
const std::vector<std::vector<RequestShape>>& cross_batches() {
  static const std::vector<std::vector<RequestShape>> batches = {
      {{12, 1}, {20, 3}, {7, 0}, {0, 0}},  // decodes over encoder outputs, an empty encoder
      {{33, 33}, {5, 1}},                  // first decoder step as long as the encoder
      {{48, 2}},
  };
  return batches;
}
// Every context >= 32 so a 32-token prefix (a multiple of 1, 16 and 32) is common.
const std::vector<RequestShape>& cascade_batch() {
  static const std::vector<RequestShape> batch = {{40, 3}, {35, 1}, {48, 9}, {33, 1}};
  return batch;
}

// A feature variant applied on top of a base case; `index` rotates the batch shapes.
enum class Feature {
  plain,
  gqa,
  mqa,
  window,
  soft_cap,
  alibi,
  sinks_lse,
  lse,
  fp8_e4m3,
  fp8_e5m2_per_head,
  fp8_output,
  quant_query,
  head_size_v_smaller,
  head_size_v_larger,
  cascade,
  encoder_only_window,
  encoder_alibi,
  cross,
  hnd_block1,
  padded_block32,
  kv_float16,
  big_head,
  speculative
};

ConformanceCase apply_feature(ConformanceCase c, Feature f, size_t index) {
  const auto pick = [index](const std::vector<std::vector<RequestShape>>& list) {
    return list[index % list.size()];
  };
  c.batch = pick(decoder_batches());
  c.distribution = index % 2 == 0 ? Distribution::uniform : Distribution::normal;
  switch (f) {
    case Feature::plain:
      break;
    case Feature::gqa:
      c.num_heads = 8;
      c.num_kv_heads = 2;
      break;
    case Feature::mqa:
      c.num_heads = 4;
      c.num_kv_heads = 1;
      c.head_size = 80;
      break;
    case Feature::window:
      c.sliding_window = 8;
      break;
    case Feature::soft_cap:
      c.soft_cap = 0.5f;  // small enough that the cap bends the uniform inputs' logits (|s| ~ 0.3-1)
      break;
    case Feature::alibi:
      c.alibi = true;
      break;
    case Feature::sinks_lse:
      c.sinks = true;
      c.return_lse = true;
      break;
    case Feature::lse:
      c.return_lse = true;
      break;
    case Feature::fp8_e4m3:
      c.kv_cache_dtype = "fp8_e4m3";
      break;
    case Feature::fp8_e5m2_per_head:
      c.kv_cache_dtype = "fp8_e5m2";
      c.per_head_kv_scales = true;
      c.num_heads = 8;
      c.num_kv_heads = 2;
      break;
    case Feature::fp8_output:
      c.fp8_output = true;
      break;
    case Feature::quant_query:  // a pre-quantized query over an fp8 cache, GQA
      c.kv_cache_dtype = "fp8_e4m3";
      c.quant_query = true;
      c.num_heads = 8;
      c.num_kv_heads = 2;
      c.return_lse = true;
      break;
    case Feature::head_size_v_smaller:
      c.head_size_v = c.head_size / 2;
      break;
    case Feature::head_size_v_larger:
      c.head_size = 32;
      c.head_size_v = 48;
      break;
    case Feature::cascade:
      c.batch = cascade_batch();
      c.cascade_prefix = 32;
      c.return_lse = true;
      break;
    case Feature::encoder_only_window:
      c.attn_type = AttentionType::encoder_only;
      c.batch = pick(encoder_batches());
      c.sliding_window = 4;
      break;
    case Feature::encoder_alibi:
      c.attn_type = AttentionType::encoder;
      c.batch = pick(encoder_batches());
      c.alibi = true;
      c.return_lse = true;
      break;
    case Feature::cross:
      c.attn_type = AttentionType::encoder_decoder;
      c.batch = pick(cross_batches());
      c.sinks = index % 2 == 0;
      c.soft_cap = index % 2 == 1 ? std::optional<float>(3.0f) : std::nullopt;
      c.return_lse = true;
      break;
    case Feature::hnd_block1:
      c.layout = KVCacheLayout::HND;
      c.block_size = 1;
      break;
    case Feature::padded_block32:
      c.pad_tokens = 3;
      c.block_size = 32;
      break;
    case Feature::kv_float16:
      c.kv_cache_dtype = c.dtype == DType::f16 ? "bfloat16" : "float16";
      break;
    case Feature::big_head:
      c.head_size = index % 2 == 0 ? 128 : 256;
      c.num_heads = 2;
      c.num_kv_heads = 1;
      c.batch = {{20, 1}, {0, 6}};
      break;
    case Feature::speculative:
      // Speculative decodes (the last sampled token + drafts) of 2, 4 and 8 tokens beside
      // 1-token decodes and a prefill, with the builders told k (1 + k = the decode threshold).
      c.num_speculative_tokens = index % 2 == 0 ? 7 : 3;
      c.num_heads = 8;
      c.num_kv_heads = 2;
      c.return_lse = true;
      c.batch = {{50, 2}, {33, 4}, {7, 1}, {100, 8}, {0, 9}, {17, 4}};
      break;
  }
  return c;
}

constexpr Feature kAllFeatures[] = {Feature::plain,
                                    Feature::gqa,
                                    Feature::mqa,
                                    Feature::window,
                                    Feature::soft_cap,
                                    Feature::alibi,
                                    Feature::sinks_lse,
                                    Feature::lse,
                                    Feature::fp8_e4m3,
                                    Feature::fp8_e5m2_per_head,
                                    Feature::fp8_output,
                                    Feature::quant_query,
                                    Feature::head_size_v_smaller,
                                    Feature::head_size_v_larger,
                                    Feature::cascade,
                                    Feature::encoder_only_window,
                                    Feature::encoder_alibi,
                                    Feature::cross,
                                    Feature::hnd_block1,
                                    Feature::padded_block32,
                                    Feature::kv_float16,
                                    Feature::big_head,
                                    Feature::speculative};

}  // namespace

std::vector<ConformanceCase> conformance_grid(bool full) {
  std::vector<ConformanceCase> cases;
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  if (!full) {
    // CI: every feature once per activation dtype, base D = 64 (32 for f16 / bf16 to vary it),
    // batch shapes, block sizes and layouts rotated.
    size_t index = 0;
    // Block size and layout rotate too (features that need one set it themselves).
    const int block_sizes[] = {16, 32, 16, 8};
    for (DType dtype : dtypes) {
      for (Feature f : kAllFeatures) {
        ConformanceCase base;
        base.dtype = dtype;
        base.head_size = dtype == DType::f32 ? 64 : 32;
        base.block_size = block_sizes[index % 4];
        base.layout = (index / 2) % 2 == 0 ? KVCacheLayout::NHD : KVCacheLayout::HND;
        cases.push_back(apply_feature(base, f, index++));
      }
    }
    return cases;
  }
  // Full: the Cartesian product of the storage/shape axes, each combination with two features
  // (rotated through every feature) and rotated batch shapes.
  const char* kv_dtypes[] = {"auto", "fp8_e4m3", "fp8_e5m2"};
  const int head_sizes[] = {32, 64, 80, 128, 256};
  const std::pair<int, int> heads[] = {{4, 4}, {8, 2}, {8, 1}};
  const int block_sizes[] = {1, 16, 32};
  const KVCacheLayout layouts[] = {KVCacheLayout::NHD, KVCacheLayout::HND};
  constexpr size_t kNumFeatures = std::size(kAllFeatures);
  size_t index = 0;
  for (DType dtype : dtypes)
    for (const char* kv : kv_dtypes)
      for (int d : head_sizes)
        for (auto [hq, hkv] : heads)
          for (int bs : block_sizes)
            for (KVCacheLayout layout : layouts)
              for (int k = 0; k < 2; ++k) {
                ConformanceCase base;
                base.dtype = dtype;
                base.kv_cache_dtype = kv;
                base.head_size = d;
                base.num_heads = hq;
                base.num_kv_heads = hkv;
                base.block_size = bs;
                base.layout = layout;
                const Feature f = kAllFeatures[(index * 7 + k * 11) % kNumFeatures];
                cases.push_back(apply_feature(base, f, index));
                ++index;
              }
  return cases;
}

// ---- inputs
// --------------------------------------------------------------------------------------

CaseInputs make_inputs(const ConformanceCase& c, uint64_t seed) {
  const int num_reqs = static_cast<int>(c.batch.size());
  const bool cached = uses_kv_cache(c.attn_type);
  const bool cross = c.attn_type == AttentionType::encoder_decoder;
  const int bs = c.block_size;
  const int hq = c.num_heads, hkv = c.num_kv_heads, d = c.head_size, dv = c.value_head_size();
  for (int r = 0; r < num_reqs; ++r) {
    const RequestShape& s = c.batch[r];
    PAGEDATTN_CHECK(s.context_len >= 0 && s.query_len >= 0, "batch", "request ", r,
                    " has negative lengths");
    PAGEDATTN_CHECK(cached || s.context_len == 0, "batch", "request ", r,
                    " has context_len = ", s.context_len,
                    ": encoder types have no cache (expected 0)");
    PAGEDATTN_CHECK(!cross || s.query_len <= s.context_len, "batch", "request ", r,
                    ": cross-attention query_len = ", s.query_len, " exceeds the encoder length ",
                    s.context_len);
    PAGEDATTN_CHECK(c.cascade_prefix <= s.context_len, "cascade_prefix",
                    "cascade_prefix = ", c.cascade_prefix, " exceeds request ", r,
                    "'s context_len = ", s.context_len);
  }
  PAGEDATTN_CHECK(c.cascade_prefix % bs == 0 &&
                      (c.cascade_prefix == 0 || c.attn_type == AttentionType::decoder),
                  "cascade_prefix", "cascade_prefix = ", c.cascade_prefix,
                  " must be a multiple of block_size = ", bs, " on a decoder case");

  CaseInputs in;
  in.c = c;
  in.seed = seed;
  in.cache_fill_seed = seed * 0x9E3779B97F4A7C15ull + 17;
  RandomValues values(seed, c.distribution);

  in.query_start_loc.assign(1, 0);
  for (int r = 0; r < num_reqs; ++r) {
    const RequestShape& s = c.batch[r];
    in.query_start_loc.push_back(in.query_start_loc.back() + s.query_len);
    in.seq_lens.push_back(cross ? s.context_len : s.context_len + s.query_len);
  }
  in.num_actual_tokens = in.query_start_loc.back();
  in.num_tokens = in.num_actual_tokens + c.pad_tokens;

  // Block tables: shared prefix blocks first, then each request's own, from shuffled ids.
  const int prefix_blocks = c.cascade_prefix / bs;
  int max_blocks = 0, distinct = prefix_blocks;
  for (int r = 0; r < num_reqs; ++r) {
    const int blocks = cached ? static_cast<int>(cdiv(in.seq_lens[r], bs)) : 0;
    max_blocks = std::max(max_blocks, blocks);
    distinct += std::max(blocks - prefix_blocks, 0);
  }
  const int spare = 3;
  in.num_blocks = distinct + spare;
  in.block_table_cols = std::max(max_blocks + 1, 1);
  std::vector<int32_t> ids(static_cast<size_t>(in.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), values.engine());
  size_t next_id = static_cast<size_t>(prefix_blocks);
  const std::vector<int32_t> spare_ids(ids.end() - spare, ids.end());
  in.block_table.assign(static_cast<size_t>(num_reqs) * in.block_table_cols, 0);
  for (int r = 0; r < num_reqs; ++r) {
    int32_t* row = in.block_table.data() + static_cast<size_t>(r) * in.block_table_cols;
    const int blocks = cached ? static_cast<int>(cdiv(in.seq_lens[r], bs)) : 0;
    for (int b = 0; b < in.block_table_cols; ++b) {
      if (b < std::min(prefix_blocks, blocks)) {
        row[b] = ids[static_cast<size_t>(b)];
      } else if (b < blocks) {
        row[b] = ids[next_id++];
      } else {
        row[b] = spare_ids[static_cast<size_t>(b + r) % spare_ids.size()];  // unused column
      }
    }
  }
  const auto slot_of = [&](int r, int64_t pos) -> int64_t {
    const int32_t block = in.block_table[static_cast<size_t>(r) * in.block_table_cols + pos / bs];
    return static_cast<int64_t>(block) * bs + pos % bs;
  };

  // Context (decoder: cached tokens; cross: encoder K/V). Rows of the shared prefix are equal
  // across requests and written once (by request 0).
  in.context_start.assign(1, 0);
  for (int r = 0; r < num_reqs; ++r) {
    in.context_start.push_back(in.context_start.back() + (cached ? c.batch[r].context_len : 0));
  }
  const int64_t num_context = in.context_start.back();
  in.context_key = random_tensor(Shape{num_context, hkv, d}, c.dtype, values);
  in.context_value = random_tensor(Shape{num_context, hkv, dv}, c.dtype, values);
  in.context_slot_mapping.assign(static_cast<size_t>(num_context), -1);
  for (int r = 0; r < num_reqs; ++r) {
    for (int64_t p = 0; p < c.batch[r].context_len && cached; ++p) {
      const int64_t row = in.context_start[r] + p;
      if (r > 0 && p < c.cascade_prefix) {
        // Same tokens as request 0: copy its rows, do not write them again.
        const int64_t source = in.context_start[0] + p;
        for (int64_t i = 0; i < hkv * d; ++i) {
          store_f32(in.context_key.data(), c.dtype, row * hkv * d + i,
                    load_f32(in.context_key.data(), c.dtype, source * hkv * d + i));
        }
        for (int64_t i = 0; i < hkv * dv; ++i) {
          store_f32(in.context_value.data(), c.dtype, row * hkv * dv + i,
                    load_f32(in.context_value.data(), c.dtype, source * hkv * dv + i));
        }
        continue;
      }
      in.context_slot_mapping[static_cast<size_t>(row)] = slot_of(r, p);
    }
  }

  // The step's tokens.
  in.query = random_tensor(Shape{in.num_tokens, hq, d}, c.dtype, values);
  if (!cross) {
    in.key = random_tensor(Shape{in.num_tokens, hkv, d}, c.dtype, values);
    in.value = random_tensor(Shape{in.num_tokens, hkv, dv}, c.dtype, values);
  }
  in.step_slot_mapping.assign(static_cast<size_t>(in.num_tokens), -1);
  if (c.attn_type == AttentionType::decoder) {
    for (int r = 0; r < num_reqs; ++r) {
      for (int i = 0; i < in.query_len(r); ++i) {
        in.step_slot_mapping[static_cast<size_t>(in.query_start_loc[r] + i)] =
            slot_of(r, c.batch[r].context_len + i);
      }
    }
  }

  // Layer constants.
  in.scale = values.uniform(0.8f, 1.3f) / std::sqrt(static_cast<float>(d));
  if (c.fp8_kv()) {
    in.k_scale = values.uniform(0.3f, 1.2f);
    in.v_scale = values.uniform(0.3f, 1.2f);
    if (c.per_head_kv_scales) {
      for (int g = 0; g < hkv; ++g) {
        in.k_scale_per_head.push_back(values.uniform(0.3f, 1.2f));
        in.v_scale_per_head.push_back(values.uniform(0.3f, 1.2f));
      }
    }
  }
  if (c.alibi) {
    // The ALiBi geometric slopes 2^(-8 (h+1) / Hq).
    for (int h = 0; h < hq; ++h) {
      in.alibi_slopes.push_back(
          std::exp2(-8.f * static_cast<float>(h + 1) / static_cast<float>(hq)));
    }
  }
  if (c.sinks) {
    for (int h = 0; h < hq; ++h) in.sinks.push_back(values.uniform(-1.f, 2.f));
  }
  in.output_scale = 1.f / 128.f;
  if (c.quant_query) {
    // The query as a caller quantizes it: e4m3(q / q_scale), q_scale not a power of two.
    in.q_scale = values.uniform(0.01f, 0.02f);
    Tensor q8(in.query.shape(), DType::fp8_e4m3, Device::cpu);
    for (int64_t i = 0; i < q8.numel(); ++i) {
      store_f32(q8.data(), DType::fp8_e4m3, i, load_f32(in.query.data(), c.dtype, i) / in.q_scale);
    }
    in.query = std::move(q8);
  }
  return in;
}

// ---- one backend run
// -----------------------------------------------------------------------------

PreparedRun prepare_run(const AttentionBackend& backend, Device device, const CaseInputs& in,
                        const RunOptions& options) {
  const ConformanceCase& c = in.c;
  const bool cached = uses_kv_cache(c.attn_type);
  const int bs = c.block_size;
  PreparedRun run;
  run.backend = &backend;
  run.device = device;
  run.case_attn_type = c.attn_type;
  if (is_registered(backend)) {
    run.layer = std::make_unique<Attention>(layer_params(backend, device, in));
  } else {
    run.own_impl = backend.make_impl(case_impl_params(in, device));
  }
  LayerScales& scales = run.scales();
  scales.q_scale = in.q_scale;
  scales.k_scale = in.k_scale;
  scales.v_scale = in.v_scale;
  if (!in.k_scale_per_head.empty()) {
    run.k_scale_per_head = upload(f32_vector(in.k_scale_per_head), device);
    run.v_scale_per_head = upload(f32_vector(in.v_scale_per_head), device);
    scales.k_scale_per_head = run.k_scale_per_head.view();
    scales.v_scale_per_head = run.v_scale_per_head.view();
  }
  run.builder = backend.make_builder(case_spec(c), case_builder_config(in), device);

  if (cached) {
    // The cache in the backend's own shape and stride order, full of finite stale data.
    Tensor host_cache;
    {
      LayoutGuard layout(c.layout);
      host_cache = backend.allocate_kv_cache(in.num_blocks, bs, c.num_kv_heads,
                                             std::max(c.head_size, c.value_head_size()),
                                             storage_dtype(c), Device::cpu);
    }
    fill_stale(host_cache, in.cache_fill_seed);
    run.kv_cache = device == Device::cpu ? std::move(host_cache) : upload(host_cache, device);

    // Step 1: the context, through the backend's own do_kv_cache_update, as one pseudo-request.
    const int num_context = num_context_tokens(in);
    if (num_context > 0) {
      CommonAttentionMetadataArgs args;
      args.query_start_loc = {0, num_context};
      args.seq_lens = {num_context};
      args.max_num_blocks_per_req = static_cast<int>(cdiv(num_context, bs));
      for (int b = 0; b < args.max_num_blocks_per_req; ++b)
        args.block_table.push_back(b % in.num_blocks);
      args.slot_mapping = in.context_slot_mapping;
      args.causal = c.attn_type == AttentionType::decoder;
      OwnedCommonAttentionMetadata fill =
          make_common_attention_metadata(args, device, in.num_blocks, bs);
      std::shared_ptr<const AttentionMetadata> fill_metadata = run.builder->build(0, fill.common);
      const Tensor context_key = upload(in.context_key, device);
      const Tensor context_value = upload(in.context_value, device);
      run.impl().do_kv_cache_update(scales, context_key, context_value, run.kv_cache,
                                    *fill_metadata);
    }
  }

  // Step 2's plan.
  CommonAttentionMetadataArgs args;
  args.query_start_loc = in.query_start_loc;
  args.seq_lens = in.seq_lens;
  args.block_table = in.block_table;
  args.max_num_blocks_per_req = in.block_table_cols;
  args.slot_mapping = in.step_slot_mapping;
  args.causal = options.causal.value_or(c.attn_type == AttentionType::decoder);
  args.num_tokens_padded = in.num_tokens;
  run.step_common =
      make_common_attention_metadata(args, device, cached ? in.num_blocks : -1, cached ? bs : 0);
  run.step_metadata = run.builder->build(options.common_prefix_len.value_or(c.cascade_prefix),
                                         run.step_common.common);

  run.query = upload(in.query, device);
  if (in.key.defined()) {
    run.key = upload(in.key, device);
    run.value = upload(in.value, device);
  }
  run.output = Tensor(Shape{in.num_tokens, c.num_heads, c.value_head_size()},
                      c.fp8_output ? DType::fp8_e4m3 : c.dtype, device);
  run.output.fill_bytes(0xFF);  // NaN in every float dtype: unwritten elements show
  if (c.return_lse) {
    run.output_lse = Tensor(Shape{c.num_heads, in.num_tokens}, DType::f32, device);
    run.output_lse.fill_bytes(0xFF);
  }
  if (c.fp8_output) run.output_scale = upload(f32_vector({in.output_scale}), device);
  return run;
}

void execute(PreparedRun& run) {
  if (run.layer) {
    run.layer->forward(run.query, run.key, run.value, run.kv_cache, *run.step_metadata, run.output,
                       run.output_lse, run.output_scale);
  } else {
    // What Attention::forward does after its checks: write the new tokens, then attend.
    if (uses_kv_cache(run.case_attn_type) && run.key.defined()) {
      run.own_impl->do_kv_cache_update(run.own_scales, run.key, run.value, run.kv_cache,
                                       *run.step_metadata);
    }
    run.own_impl->forward(run.own_scales, run.query, run.key, run.value, run.kv_cache,
                          *run.step_metadata, run.output, run.output_scale, run.output_lse);
  }
  if (run.device == Device::cuda) synchronize_cuda();
}

BackendOutputs collect(const PreparedRun& run) {
  BackendOutputs out;
  out.backend_name = std::string(run.backend->name());
  out.output = download(run.output);
  if (run.output_lse.defined()) out.output_lse = download(run.output_lse);
  if (run.kv_cache.defined()) {
    out.kv_cache = download(run.kv_cache);
    const AttentionImplParams& p = run.impl_const().params();
    const int dmax = std::max(p.head_size, p.value_head_size());
    out.standard_cache =
        out.kv_cache.shape() == Shape{2, out.kv_cache.shape()[1], p.block_size, p.kv_heads(), dmax};
  }
  out.used_cascade = run.step_metadata->use_cascade;
  return out;
}

BackendOutputs run_backend(const AttentionBackend& backend, Device device, const CaseInputs& inputs,
                           const RunOptions& options) {
  PreparedRun run = prepare_run(backend, device, inputs, options);
  execute(run);
  return collect(run);
}

// ---- comparison
// ----------------------------------------------------------------------------------

bool ConformanceResult::passed() const {
  return all_written && output_rel_error <= tolerance && lse_rel_error <= tolerance &&
         lse_inf_mismatches == 0 && cache_mismatches == 0;
}

std::string ConformanceResult::describe() const {
  std::ostringstream os;
  os << backend_name << " [" << case_description << "] seed=" << seed << ": output rel error "
     << output_rel_error << ", lse rel error " << lse_rel_error << " (tolerance " << tolerance
     << "), unwritten " << unwritten << ", lse -inf mismatches " << lse_inf_mismatches << ", cache "
     << (cache_compared ? std::to_string(cache_mismatches) + " mismatches"
                        : std::string("not compared"))
     << (used_cascade ? ", cascade" : "");
  return os.str();
}

ConformanceResult compare(const CaseInputs& in, const BackendOutputs& out,
                          const BackendOutputs& ref) {
  const ConformanceCase& c = in.c;
  ConformanceResult res;
  res.backend_name = out.backend_name;
  res.case_description = c.describe();
  res.seed = in.seed;
  res.tolerance = tolerance(c);
  res.used_cascade = out.used_cascade;

  // Output: the first num_actual_tokens rows.
  double diff2 = 0, ref2 = 0;
  const ElementReader o(out.output.view()), r(ref.output.view());
  for (int64_t t = 0; t < in.num_actual_tokens; ++t) {
    for (int64_t h = 0; h < c.num_heads; ++h) {
      for (int64_t d = 0; d < c.value_head_size(); ++d) {
        const double a = o(t, h, d), b = r(t, h, d);
        if (!std::isfinite(a)) {
          ++res.unwritten;
          continue;
        }
        diff2 += (a - b) * (a - b);
        ref2 += b * b;
      }
    }
  }
  res.output_rel_error = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);

  // LSE: finite entries compared; -inf must match exactly.
  if (c.return_lse) {
    double ldiff2 = 0, lref2 = 0;
    const ElementReader ol(out.output_lse.view()), rl(ref.output_lse.view());
    for (int64_t h = 0; h < c.num_heads; ++h) {
      for (int64_t t = 0; t < in.num_actual_tokens; ++t) {
        const double a = ol(h, t), b = rl(h, t);
        if (std::isnan(a) || a == std::numeric_limits<double>::infinity()) {
          ++res.unwritten;
        } else if (std::isinf(a) || std::isinf(b)) {
          if (a != b) ++res.lse_inf_mismatches;
        } else {
          ldiff2 += (a - b) * (a - b);
          lref2 += b * b;
        }
      }
    }
    res.lse_rel_error = lref2 > 0 ? std::sqrt(ldiff2 / lref2) : std::sqrt(ldiff2);
  }
  res.all_written = res.unwritten == 0;

  // Cache: every written entry must hold the same value in both (conversions are bit-exact).
  if (out.kv_cache.defined() && ref.kv_cache.defined() && out.standard_cache &&
      ref.standard_cache) {
    res.cache_compared = true;
    const ElementReader kc(out.kv_cache.view()), rc(ref.kv_cache.view());
    const int bs = c.block_size;
    const auto check_slot = [&](int64_t slot) {
      if (slot < 0) return;
      const int64_t block = slot / bs, offset = slot % bs;
      for (int64_t g = 0; g < c.num_kv_heads; ++g) {
        for (int64_t d = 0; d < c.head_size; ++d) {
          if (kc(0, block, offset, g, d) != rc(0, block, offset, g, d))
            ++res.cache_mismatches;
        }
        for (int64_t d = 0; d < c.value_head_size(); ++d) {
          if (kc(1, block, offset, g, d) != rc(1, block, offset, g, d))
            ++res.cache_mismatches;
        }
      }
    };
    for (int64_t slot : in.context_slot_mapping) check_slot(slot);
    for (int64_t i = 0; i < in.num_actual_tokens; ++i)
      check_slot(in.step_slot_mapping[static_cast<size_t>(i)]);
  }
  return res;
}

// ---- the case runner
// -----------------------------------------------------------------------------

const AttentionBackend& reference() {
  const AttentionBackend* backend = find_backend("REFERENCE");
  PAGEDATTN_CHECK(
      backend != nullptr, "backend",
      "conformance: the REFERENCE backend is not registered (src/backends/registry.cpp)");
  return *backend;
}

std::vector<std::string> unsupported_reasons(const AttentionBackend& backend, Device device,
                                             const ConformanceCase& c) {
  std::vector<std::string> reasons = backend.validate_configuration(c.selector_config(device));
  const BackendCapabilities caps = backend.capabilities();
  const auto has = [&caps](std::string_view feature) {
    return std::find(caps.features.begin(), caps.features.end(), feature) != caps.features.end();
  };
  if (c.quant_query && !has("quant_query")) {
    reasons.push_back(
        "The case gives an fp8_e4m3 query but the backend's capabilities do not list "
        "\"quant_query\".");
  }
  if (c.return_lse && !has("lse")) {
    reasons.push_back(
        "The case asks for the LSE output but the backend's capabilities do not list "
        "\"lse\".");
  }
  return reasons;
}

ConformanceResult run_case(const AttentionBackend& backend, Device device, const ConformanceCase& c,
                           uint64_t seed) {
  // The backend's builder may want decodes first: permute the requests as it asks.
  ConformanceCase ordered = c;
  {
    const auto builder = backend.make_builder(
        case_spec(c), case_builder_config(c, static_cast<int>(c.batch.size()), 0, 0), device);
    std::vector<int32_t> query_lens;
    for (const RequestShape& s : c.batch) query_lens.push_back(s.query_len);
    if (const std::optional<BatchReorder> reorder = builder->reorder_batch(query_lens);
        reorder && reorder->modified) {
      ordered.batch.clear();
      for (int index : reorder->order) ordered.batch.push_back(c.batch[static_cast<size_t>(index)]);
    }
  }
  const CaseInputs inputs = make_inputs(ordered, seed);
  const BackendOutputs out = run_backend(backend, device, inputs);
  const BackendOutputs ref = run_backend(reference(), Device::cpu, inputs);
  return compare(inputs, out, ref);
}

}  // namespace pagedattn::conformance
