// Batch-invariance harness (see batch_invariance.h).
#include "conformance/batch_invariance.h"

#include <gtest/gtest.h>

#include "conformance/env_guard.h"
#include "conformance/mla_harness.h"
#include "conformance/uniform_float.h"
#include "sanitized_build.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <tuple>

namespace pagedattn::conformance::invariance {
namespace {

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A contiguous host tensor of uniform(-1, 1) values rounded into `dtype` (never zeros).
Tensor random_host(Shape shape, DType dtype, std::mt19937_64& rng) {
  Tensor t(shape, dtype, Device::cpu);
  void* const data = t.data();
  const int64_t n = t.numel();  // read once: per element it costs more than the store
  for (int64_t i = 0; i < n; ++i) store_f32(data, dtype, i, uniform_float(rng, -1.f, 1.f));
  return t;
}

// Finite "stale data" in every byte of a cache (its pages that no request owns included).
Tensor stale_cache(Tensor host_cache, std::mt19937_64& rng) {
  void* const data = host_cache.data();
  const DType dtype = host_cache.dtype();
  const int64_t n = host_cache.numel();
  for (int64_t i = 0; i < n; ++i) store_f32(data, dtype, i, uniform_float(rng, -2.f, 2.f));
  return host_cache;
}

Tensor i64_host(const std::vector<int64_t>& values) {
  Tensor t(Shape{static_cast<int64_t>(values.size())}, DType::i64, Device::cpu);
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * sizeof(int64_t));
  return t;
}

// Rows [0, rows) of each tensor of `parts`, one after another (all contiguous, same trailing
// shape and dtype).
Tensor concat_rows(const std::vector<const Tensor*>& parts) {
  Shape shape = parts.front()->shape();
  int64_t rows = 0;
  for (const Tensor* p : parts) rows += p->shape()[0];
  shape[0] = rows;
  Tensor out(shape, parts.front()->dtype(), Device::cpu);
  char* dst = static_cast<char*>(out.data());
  for (const Tensor* p : parts) {
    std::memcpy(dst, p->data(), p->nbytes());
    dst += p->nbytes();
  }
  return out;
}

// The bytes of one request's output rows and LSE entries in one run.
struct RequestBits {
  std::vector<uint8_t> out;  // (query_len, H, Dv) in the output dtype
  std::vector<uint8_t> lse;  // (H, query_len) f32
};

// One layer under test, kind-specific parts only (standard or MLA); the pool layout and the
// batch assembly are the harness's.
struct LayerUnderTest {
  const AttentionBackend* backend = nullptr;
  KVCacheSpec spec;
  BuilderConfig config;            // batch_invariant and num_sms are set per batch
  int out_heads = 0, out_dim = 0;  // output (T, out_heads, out_dim), LSE (out_heads, T)
  DType out_dtype = DType::f32;
  std::vector<std::vector<Tensor>> inputs;  // [request][i]: host (query_len, ...) tensors
  Tensor kv_cache;
  // inputs of the batch (device tensors, in the order of `inputs[r]`), plan, output, LSE.
  std::function<void(const std::vector<Tensor>&, const AttentionMetadata&, const TensorView&,
                     const TensorView&)>
      forward;
};

class Harness {
 public:
  Harness(const AttentionBackend& backend, Device device, const InvarianceCase& c, uint64_t seed,
          bool batch_invariant)
      : c_(c), device_(device), rng_(seed), batch_invariant_(batch_invariant) {
    const int n = static_cast<int>(c.pool.size());
    PAGEDATTN_CHECK(n >= 2, "c.pool", "check_batch_invariance: the pool has ", n,
                    " requests: expected at least 2");
    int num_blocks = 4;  // spare pages no request owns
    for (const RequestShape& r : c.pool) {
      PAGEDATTN_CHECK(r.query_len >= 1 && r.context_len >= 0, "c.pool",
                      "check_batch_invariance: a request has context_len ", r.context_len,
                      ", query_len ", r.query_len, ": expected >= 0 and >= 1");
      seq_lens_.push_back(r.context_len + r.query_len);
      query_lens_.push_back(r.query_len);
      cols_ = std::max<int>(cols_, static_cast<int>(cdiv(seq_lens_.back(), c.block_size)));
      num_blocks += static_cast<int>(cdiv(seq_lens_.back(), c.block_size));
    }
    num_blocks_ = num_blocks;
    std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng_);
    size_t next = 0;
    for (int r = 0; r < n; ++r) {
      std::vector<int32_t> row(static_cast<size_t>(cols_), ids.back());  // unused columns: a spare
      for (int64_t b = 0; b < cdiv(seq_lens_[r], c.block_size); ++b) row[b] = ids[next++];
      blocks_.push_back(std::move(row));
    }
    if (c.mla) {
      make_mla_layer(backend);
    } else {
      make_standard_layer(backend);
    }
  }

  int reorder_threshold() { return builder(c_.num_sms.front()).reorder_batch_threshold(); }

  // Runs the requests `order` (pool indices) as one batch; their bits, in `order`.
  std::vector<RequestBits> run(const std::vector<int>& order, int num_sms) {
    CommonAttentionMetadataArgs args;
    args.query_start_loc.push_back(0);
    args.max_num_blocks_per_req = cols_;
    for (int r : order) {
      args.query_start_loc.push_back(args.query_start_loc.back() + query_lens_[r]);
      args.seq_lens.push_back(seq_lens_[r]);
      args.block_table.insert(args.block_table.end(), blocks_[r].begin(), blocks_[r].end());
      for (int pos = seq_lens_[r] - query_lens_[r]; pos < seq_lens_[r]; ++pos) {
        args.slot_mapping.push_back(slot(r, pos));
      }
    }
    const int tokens = args.query_start_loc.back();
    OwnedCommonAttentionMetadata common =
        make_common_attention_metadata(args, device_, num_blocks_, c_.block_size);
    const std::shared_ptr<const AttentionMetadata> plan = builder(num_sms).build(0, common.common);
    PAGEDATTN_CHECK(plan->batch_invariant == batch_invariant_, "batch_invariant",
                    "check_batch_invariance: the plan says batch_invariant = ",
                    plan->batch_invariant, ", the builder was asked for ", batch_invariant_);

    std::vector<Tensor> batch_inputs;
    for (size_t i = 0; i < layer_.inputs.front().size(); ++i) {
      std::vector<const Tensor*> parts;
      for (int r : order) parts.push_back(&layer_.inputs[r][i]);
      batch_inputs.push_back(concat_rows(parts).to(device_));
    }
    Tensor out(Shape{tokens, layer_.out_heads, layer_.out_dim}, layer_.out_dtype, device_);
    Tensor lse(Shape{layer_.out_heads, tokens}, DType::f32, device_);
    out.fill_bytes(0xFF);  // NaN in every float dtype
    lse.fill_bytes(0xFF);
    layer_.forward(batch_inputs, *plan, out.view(), lse.view());
    const Tensor host_out = out.to(Device::cpu), host_lse = lse.to(Device::cpu);

    std::vector<RequestBits> bits;
    const size_t row_bytes = static_cast<size_t>(layer_.out_heads) * layer_.out_dim *
                             dtype_size(layer_.out_dtype);
    for (size_t i = 0; i < order.size(); ++i) {
      const int q0 = args.query_start_loc[i], q = query_lens_[order[i]];
      RequestBits b;
      const auto* o = static_cast<const uint8_t*>(host_out.data()) + q0 * row_bytes;
      b.out.assign(o, o + q * row_bytes);
      const auto* l = static_cast<const float*>(host_lse.data());
      for (int h = 0; h < layer_.out_heads; ++h) {
        const auto* row = reinterpret_cast<const uint8_t*>(l + static_cast<int64_t>(h) * tokens + q0);
        b.lse.insert(b.lse.end(), row, row + q * sizeof(float));
      }
      bits.push_back(std::move(b));
    }
    return bits;
  }

  int query_len(int r) const { return query_lens_[r]; }

 private:
  int64_t slot(int r, int pos) const {
    return static_cast<int64_t>(blocks_[r][pos / c_.block_size]) * c_.block_size + pos % c_.block_size;
  }

  // Slots of request r's cached context (positions [0, context_len)).
  std::vector<int64_t> context_slots(int r) const {
    std::vector<int64_t> slots;
    for (int pos = 0; pos < seq_lens_[r] - query_lens_[r]; ++pos) slots.push_back(slot(r, pos));
    return slots;
  }

  AttentionMetadataBuilder& builder(int num_sms) {
    auto& b = builders_[num_sms];
    if (!b) {
      BuilderConfig config = layer_.config;
      config.batch_invariant = batch_invariant_;
      config.num_sms = num_sms;
      b = layer_.backend->make_builder(layer_.spec, config, device_);
    }
    return *b;
  }

  BuilderConfig limits(BuilderConfig config) const {
    config.max_num_seqs = static_cast<int>(c_.pool.size());
    config.max_num_batched_tokens = std::accumulate(query_lens_.begin(), query_lens_.end(), 0);
    config.max_model_len = *std::max_element(seq_lens_.begin(), seq_lens_.end());
    return config;
  }

  // The layer parameters both layer kinds share.
  template <class Params>
  void set_common_params(Params& p, const AttentionBackend& backend, const char* prefix) const {
    p.num_heads = c_.num_heads;
    p.kv_cache_dtype = c_.kv_cache_dtype;
    p.block_size = c_.block_size;
    p.dtype = c_.dtype;
    p.device = device_;
    p.backend = std::string(backend.name());
    p.prefix = prefix;
  }

  // One request's new-token inputs, random, in the activation dtype.
  void add_inputs(std::initializer_list<Shape> shapes) {
    std::vector<Tensor> tensors;
    for (const Shape& shape : shapes) tensors.push_back(random_host(shape, c_.dtype, rng_));
    layer_.inputs.push_back(std::move(tensors));
  }

  void make_standard_layer(const AttentionBackend& backend) {
    AttentionLayerParams p;
    set_common_params(p, backend, "invariance.attn");
    p.head_size = c_.head_size;
    p.num_kv_heads = c_.num_kv_heads;
    p.sliding_window = c_.sliding_window;
    auto layer = std::make_shared<Attention>(p);
    layer_.backend = &layer->backend();
    layer_.spec = layer->kv_cache_spec();
    layer_.config = limits(layer->builder_config(1, 1, 1));
    layer_.out_heads = c_.num_heads;
    layer_.out_dim = c_.head_size;
    layer_.out_dtype = c_.dtype;
    Tensor host_cache = backend.allocate_kv_cache(num_blocks_, c_.block_size, c_.num_kv_heads,
                                                  c_.head_size, layer->kv_cache_storage_dtype(),
                                                  Device::cpu);
    layer_.kv_cache = stale_cache(std::move(host_cache), rng_).to(device_);
    const KVCacheViews views = split_kv_cache(layer_.kv_cache, c_.head_size, c_.head_size);
    for (int r = 0; r < static_cast<int>(c_.pool.size()); ++r) {
      const int context = c_.pool[r].context_len, q = query_lens_[r];
      if (context > 0) {
        const Tensor k = random_host(Shape{context, c_.num_kv_heads, c_.head_size}, c_.dtype, rng_);
        const Tensor v = random_host(Shape{context, c_.num_kv_heads, c_.head_size}, c_.dtype, rng_);
        reshape_and_cache_flash(k.to(device_), v.to(device_), views.key_cache, views.value_cache,
                                i64_host(context_slots(r)).to(device_), c_.kv_cache_dtype,
                                layer->scales());
      }
      add_inputs({Shape{q, c_.num_heads, c_.head_size}, Shape{q, c_.num_kv_heads, c_.head_size},
                  Shape{q, c_.num_kv_heads, c_.head_size}});
    }
    layer_.forward = [layer, cache = layer_.kv_cache.view()](
                         const std::vector<Tensor>& in, const AttentionMetadata& plan,
                         const TensorView& out, const TensorView& lse) {
      layer->forward(in[0], in[1], in[2], cache, plan, out, lse);
    };
  }

  void make_mla_layer(const AttentionBackend& backend) {
    const MLADimensions& d = c_.mla_dims;
    MLAAttentionLayerParams p;
    set_common_params(p, backend, "invariance.mla");
    p.kv_lora_rank = d.kv_lora_rank;
    p.qk_nope_head_dim = d.qk_nope_head_dim;
    p.qk_rope_head_dim = d.qk_rope_head_dim;
    p.qk_head_dim = d.qk_head_dim();
    p.v_head_dim = d.v_head_dim;
    auto layer = std::make_shared<MLAAttention>(p);
    const int64_t h = c_.num_heads;
    layer->process_weights_after_loading(
        random_host(Shape{h * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank}, c_.dtype, rng_)
            .to(device_));
    layer_.backend = &layer->backend();
    layer_.spec = layer->kv_cache_spec();
    layer_.config = limits(layer->builder_config(1, 1, 1));
    layer_.config = layer->builder_config(layer_.config.max_num_seqs,
                                          layer_.config.max_num_batched_tokens,
                                          layer_.config.max_model_len, c_.mla_workspace_tokens);
    layer_.out_heads = c_.num_heads;
    layer_.out_dim = d.v_head_dim;
    layer_.out_dtype = c_.dtype;
    layer_.kv_cache = stale_cache(layer->allocate_kv_cache(num_blocks_).to(Device::cpu), rng_).to(device_);
    for (int r = 0; r < static_cast<int>(c_.pool.size()); ++r) {
      const int context = c_.pool[r].context_len, q = query_lens_[r];
      if (context > 0) {
        const Tensor kv_c = random_host(Shape{context, d.kv_lora_rank}, c_.dtype, rng_);
        const Tensor k_pe = random_host(Shape{context, d.qk_rope_head_dim}, c_.dtype, rng_);
        concat_and_cache_mla(kv_c.to(device_), k_pe.to(device_), layer_.kv_cache,
                             i64_host(context_slots(r)).to(device_), c_.kv_cache_dtype,
                             layer->scales().k_scale);
      }
      add_inputs({Shape{q, h, d.qk_head_dim()}, Shape{q, d.kv_lora_rank},
                  Shape{q, d.qk_rope_head_dim}});
    }
    layer_.forward = [layer, cache = layer_.kv_cache.view()](
                         const std::vector<Tensor>& in, const AttentionMetadata& plan,
                         const TensorView& out, const TensorView& lse) {
      layer->forward(in[0], in[1], in[2], cache, plan, out, lse);
    };
  }

  InvarianceCase c_;
  Device device_;
  std::mt19937_64 rng_;
  bool batch_invariant_;
  std::vector<int> seq_lens_, query_lens_;
  std::vector<std::vector<int32_t>> blocks_;  // [request][column] page ids
  int cols_ = 1;
  int num_blocks_ = 0;
  LayerUnderTest layer_;
  std::map<int, std::unique_ptr<AttentionMetadataBuilder>> builders_;
};

// "(ctx 900, q 1)"
std::string request_string(const RequestShape& r) {
  std::ostringstream os;
  os << "(ctx " << r.context_len << ", q " << r.query_len << ")";
  return os.str();
}

// Where two runs of one request differ: "output byte 37 of 2048 (row 0): 0x3f vs 0x40", or "".
std::string first_difference(const RequestBits& alone, const RequestBits& batched, size_t row_bytes) {
  std::ostringstream os;
  for (const auto& [name, a, b] : {std::tuple{"output", &alone.out, &batched.out},
                                   std::tuple{"lse", &alone.lse, &batched.lse}}) {
    const auto mismatch = std::mismatch(a->begin(), a->end(), b->begin(), b->end());
    if (mismatch.first == a->end() && mismatch.second == b->end()) continue;
    const size_t at = static_cast<size_t>(mismatch.first - a->begin());
    os << name << " byte " << at << " of " << a->size();
    if (std::string_view(name) == "output") os << " (token " << at / row_bytes << ")";
    os << std::hex << ": alone 0x" << int(*mismatch.first) << ", in the batch 0x"
       << int(*mismatch.second);
    return os.str();
  }
  return {};
}

}  // namespace

std::string InvarianceCase::describe() const {
  std::ostringstream os;
  os << name << ": " << dtype_name(dtype) << " kv=" << kv_cache_dtype;
  if (mla) {
    os << " mla " << mla_dims.to_string() << " H=" << num_heads;
  } else {
    os << " D=" << head_size << " Hq=" << num_heads << " Hkv=" << num_kv_heads;
  }
  os << " bs=" << block_size;
  if (sliding_window) os << " window=" << *sliding_window;
  os << " pool=[";
  for (size_t i = 0; i < pool.size(); ++i) os << (i ? "," : "") << request_string(pool[i]);
  os << "] num_sms={";
  for (size_t i = 0; i < num_sms.size(); ++i) os << (i ? "," : "") << num_sms[i];
  os << "}";
  return os.str();
}

std::string InvarianceReport::describe() const {
  std::ostringstream os;
  os << batches << " batches (" << decode_only_batches << " decode-only, " << mixed_batches
     << " mixed), each request in >= " << min_appearances << "; " << differing_requests
     << " (request, batch) pairs differ from the request alone";
  for (const std::string& d : differences) os << "\n  " << d;
  return os.str();
}

InvarianceReport check_batch_invariance(const AttentionBackend& backend, Device device,
                                        const InvarianceCase& c, uint64_t seed,
                                        bool batch_invariant) {
  Harness harness(backend, device, c, seed, batch_invariant);
  const int n = static_cast<int>(c.pool.size());
  std::mt19937_64 rng(seed ^ 0x9E3779B97F4A7C15ull);
  const int threshold = std::max(1, harness.reorder_threshold());
  const bool reorder = harness.reorder_threshold() > 0;
  const auto is_decode = [&](int r) { return harness.query_len(r) <= threshold; };
  const size_t row_bytes = static_cast<size_t>(c.num_heads) *
                           (c.mla ? c.mla_dims.v_head_dim : c.head_size) * dtype_size(c.dtype);

  // Each request alone, on the first num_sms.
  std::vector<RequestBits> alone;
  for (int r = 0; r < n; ++r) alone.push_back(std::move(harness.run({r}, c.num_sms.front()).front()));

  InvarianceReport report;
  std::vector<int> appearances(static_cast<size_t>(n), 0);
  std::vector<int> decodes;
  for (int r = 0; r < n; ++r) {
    if (is_decode(r)) decodes.push_back(r);
  }
  const int compositions = checked_compositions(c);
  while (*std::min_element(appearances.begin(), appearances.end()) < compositions) {
    // The request seen least, with others: every third batch of a decode only decodes (a
    // decode-only step), else any of the pool; in random order (decodes first when the builder
    // reorders, with vLLM's swaps).
    const int target = static_cast<int>(std::min_element(appearances.begin(), appearances.end()) -
                                        appearances.begin());
    std::vector<int> candidates;
    const bool decode_only = is_decode(target) && decodes.size() > 1 && report.batches % 3 == 0;
    for (int r = 0; r < n; ++r) {
      if (r != target && (!decode_only || is_decode(r))) candidates.push_back(r);
    }
    std::shuffle(candidates.begin(), candidates.end(), rng);
    const int others = std::uniform_int_distribution<int>(1, static_cast<int>(candidates.size()))(rng);
    std::vector<int> order(candidates.begin(), candidates.begin() + others);
    order.push_back(target);
    std::shuffle(order.begin(), order.end(), rng);
    if (reorder) {
      std::vector<int32_t> lens;
      for (int r : order) lens.push_back(harness.query_len(r));
      const BatchReorder swaps = reorder_batch_to_split_decodes_and_prefills(lens, threshold);
      std::vector<int> reordered;
      for (int i : swaps.order) reordered.push_back(order[static_cast<size_t>(i)]);
      order = reordered;
    }
    const int num_sms = c.num_sms[static_cast<size_t>(report.batches) % c.num_sms.size()];
    const std::vector<RequestBits> bits = harness.run(order, num_sms);
    ++report.batches;
    const bool all_decodes = std::all_of(order.begin(), order.end(), is_decode);
    ++(all_decodes ? report.decode_only_batches : report.mixed_batches);
    for (size_t i = 0; i < order.size(); ++i) {
      const int r = order[i];
      ++appearances[r];
      const std::string where = first_difference(alone[r], bits[i], row_bytes);
      if (where.empty()) continue;
      ++report.differing_requests;
      if (report.differences.size() < 8) {
        std::ostringstream os;
        os << "request " << r << " " << request_string(c.pool[r]) << " at position " << i
           << " of batch " << report.batches << " [";
        for (size_t j = 0; j < order.size(); ++j) os << (j ? "," : "") << order[j];
        os << "] num_sms " << num_sms << ": " << where;
        report.differences.push_back(os.str());
      }
    }
  }
  report.min_appearances = *std::min_element(appearances.begin(), appearances.end());
  return report;
}

int checked_compositions(const InvarianceCase& c) {
  return test_env::kSanitizedBuild ? std::min(c.compositions, kSanitizedCompositions) : c.compositions;
}

void expect_batch_invariant(const AttentionBackend& backend, Device device, const InvarianceCase& c,
                            uint64_t seed) {
  const InvarianceReport report = check_batch_invariance(backend, device, c, seed);
  EXPECT_TRUE(report.invariant()) << backend.name() << " " << c.describe() << "\n" << report.describe();
  EXPECT_GE(report.min_appearances, checked_compositions(c)) << report.describe();
  EXPECT_GT(report.decode_only_batches, 0) << report.describe();
  EXPECT_GT(report.mixed_batches, 0) << report.describe();
}

const AttentionBackend& registered_backend(const char* name) {
  const AttentionBackend* backend = find_backend(name);
  if (backend == nullptr) throw Error("name", detail::concat(name, " is not registered"));
  return *backend;
}

ModeConformance conformance_in_the_mode(const AttentionBackend& backend, Device device, bool mla,
                                        bool full_mla_grid) {
  EnvGuard env(kBatchInvariantEnv, "1");
  ModeConformance out;
  if (mla) {
    for (const mla::MLAResult& r : mla::run_mla_grid(backend, "", device, mla::mla_grid(full_mla_grid), 7)) {
      out.ran += r.skipped ? 0 : 1;
      if (!r.passed()) out.failures.push_back(r.describe());
    }
    return out;
  }
  for (const ConformanceCase& c : conformance_grid(false)) {
    if (!unsupported_reasons(backend, device, c).empty()) continue;
    const ConformanceResult r = run_case(backend, device, c, 7);
    ++out.ran;
    if (!r.passed() || r.used_cascade) {
      out.failures.push_back((r.used_cascade ? "took the cascade path: " : "") + r.describe());
    }
  }
  return out;
}

}  // namespace pagedattn::conformance::invariance
