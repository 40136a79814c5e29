// The CPU MLA backend ("CPU_MLA"): the backend object (selector reasons, capabilities), its
// metadata builder (MLACommonMetadataBuilder + the CPU decode plan) and its impl
// (MLACommonImpl + forward_decode on the CPU backend's tile kernels).
//
// What forward_decode computes (absorbed MLA decode = MQA over the latent cache): for decode
// token t of request i and head h < H,
//     s_j        = scale · k_scale · (q_latent[t,h] · cache_row_j)          (L + R dims)
//     o_latent   = Σ_j softmax(s)_j · k_scale · cache_row_j[:L]             (L dims)
//     lse[h, t]  = log Σ_j e^{s_j}                                          (natural log)
// over keys j in [0, seq_len_i - q_i + 1 + j_t) read through the request's block table (token t
// the j_t-th of the request's q_i tokens: 1, or up to 1 + k with speculative decoding, each
// attending causally). To the CPU kernels
// this is one KV head (num_kv_heads 1) with group size H, head_size L + R, head_size_v L, and
// a KvSource whose key and value pointers are the same cache base with the same strides: the
// value of a key is the first L elements of its row (no separate V cache exists).
//
// Tiling: one work item per (decode request, run of up to tokens_per_item of its tokens, key
// split): the item's rows (every query head of its tokens; a speculative decode's tokens share
// the tiles up to kMaxItemRows rows) share each 64-key tile of the latent cache, packed once for
// Q·Kᵀ (576 dims) and once for P·V (its first 512 dims, re-read from L1/L2). Split-KV: when the
// decodes give fewer than kItemsPerThread items per thread, each run's keys are split in 64-key-aligned ranges
// of >= kMinSplitKeys keys; splits write unnormalised partial rows (O, max, sum) that merge
// tasks combine (LSE merge), exactly as the CPU backend (cpu_plan.cpp). A batch-invariant builder
// never splits (one item per token run over all its keys: the same bits in any batch).
//
// Memory traffic and floor: every latent row of a decode request is read once from DRAM
// (Σ seq_len · (L + R) · cache bytes); q_latent (H · (L + R)) and o_latent (H · L) per token
// once. Compute: 2 · H · (L + R + L) FLOPs per key and decode token. With H = 16 heads and
// bf16 the ratio is ~16 FLOP per cache byte, so on a CPU with ~1 TFLOP/s of bf16 dot products
// and ~100 GB/s the decode is compute-bound (floor = FLOPs / dot rate), unlike standard GQA
// decode. Measured with bench/cpu_mla_bench.cpp (Zen 5, 2 threads, AVX-512 BF16, 16 x 4k bf16):
// ~4.3 ms = ~45-52% of the vdpbf16ps peak; ~20% of the time is the transpose of the 576-wide K
// rows at pack (a Q·Kᵀ on the untransposed rows would avoid it).
//
// Precision: as the CPU backend (cpu_attention_tile.h): bf16 activations or fp8 caches use bf16
// dot products (vdpbf16ps, or AMX tiles where present; fp8 values are exact in bf16, f16/f32
// queries are rounded to bf16 in that mode), other cases f32 FMA; f32 accumulation; fp8 read =
// x · k_scale (k_scale for keys AND values: vLLM's MLA cache has one scale), folded into the
// logit scale and the final normalisation.
#include "backends/cpu/cpu_mla_backend.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "backends/cpu/cpu_internal.h"
#include "backends/cpu/cpu_mla_prefill.h"
#include "backends/host_backend_common.h"
#include "backends/mla/mla_common.h"
#include "pagedattn/error.h"

namespace pagedattn {
namespace cpu {

namespace {

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool kernel_head_size(int size) {
  return size >= kHeadSizeMultiple && size <= kMaxKernelHeadSize && size % kHeadSizeMultiple == 0;
}

constexpr const char* kName = "CPU_MLA";

}  // namespace

std::shared_ptr<CpuMlaDecodeWorkspace> make_mla_decode_workspace(int num_threads, int num_heads,
                                                                 const MLADimensions& dims,
                                                                 bool split_kv, int max_query_len) {
  auto ws = std::make_shared<CpuMlaDecodeWorkspace>();
  ws->num_threads = resolve_num_threads(num_threads);
  ws->split_kv = split_kv;
  ws->num_heads = num_heads;
  ws->tokens_per_item = std::max(1, std::min(max_query_len, kMaxItemRows / std::max(1, num_heads)));
  ws->max_rows = num_heads * ws->tokens_per_item;
  ws->head_size = dims.latent_head_size();
  ws->head_size_v = dims.kv_lora_rank;
  ws->scratch_stride = (thread_scratch_bytes(ws->head_size, ws->head_size_v, ws->max_rows) + 63) &
                       ~static_cast<size_t>(63);
  // Splits exist only while the token runs < target = kItemsPerThread * threads; each run then
  // gets <= cdiv(target, runs) splits, < 2 * target splits in all, <= max_rows partial rows each.
  if (ws->num_threads > 1 && split_kv) {
    ws->partial_capacity_rows =
        2 * static_cast<int64_t>(kItemsPerThread) * ws->num_threads * ws->max_rows;
    ws->partial_o_stride = (ws->head_size_v + 15) / 16 * 16;
  }
  ws->buffers.start([threads = ws->num_threads, stride = ws->scratch_stride,
                     rows = ws->partial_capacity_rows, row_floats = ws->partial_o_stride] {
    return make_run_buffers(threads, stride, rows, row_floats);
  });
  return ws;
}

void plan_mla_decode(CpuMlaMetadata& plan, const CpuMlaDecodeWorkspace& ws, bool fast_build) {
  const int num_decodes = plan.num_decodes;
  const int heads = ws.num_heads;
  const int64_t dims = ws.head_size + ws.head_size_v;
  const int64_t target_items = static_cast<int64_t>(kItemsPerThread) * ws.num_threads;
  const int32_t* qsl = plan.decode.query_start_loc.data();
  const int32_t* seq_lens = plan.decode.seq_lens.data();
  plan.items.clear();
  plan.merges.clear();
  plan.partial_rows_used = 0;
  // Items take runs of up to tokens_per_item tokens of one request (a speculative decode's tokens
  // share each key tile), the unit of an item and of its splits.
  const int per_item = ws.tokens_per_item;
  int64_t base_items = 0;
  for (int r = 0; r < num_decodes; ++r) base_items += cdiv(qsl[r + 1] - qsl[r], per_item);
  const bool split_kv = !fast_build && ws.split_kv && ws.num_threads > 1 && base_items > 0 &&
                        base_items < target_items;
  const int64_t want_splits = split_kv ? cdiv(target_items, base_items) : 1;

  // Keys [0, visible_end) a token sees (causal: position first_pos + (tok - qsl[r])).
  auto visible_end = [&](int r, int tok) {
    return std::min(seq_lens[r], plan.decode_first_pos[r] + (tok - qsl[r]) + 1);
  };
  auto item_for = [&](int r, int t0, int t1, int kb, int ke) {
    WorkItem item;
    item.kv_head = 0;
    item.req_begin = r;
    item.req_end = r + 1;
    item.tok_begin = t0;
    item.tok_end = t1;
    item.kv_begin = kb;
    item.kv_end = ke;
    int64_t keys = 0;  // keys of [kb, ke) its tokens see
    for (int tok = t0; tok < t1; ++tok) keys += std::max(0, std::min(visible_end(r, tok), ke) - kb);
    item.cost = keys * heads * dims + 1;
    return item;
  };

  for (int r = 0; r < num_decodes; ++r) {
    for (int t0 = qsl[r]; t0 < qsl[r + 1]; t0 += per_item) {
      const int t1 = std::min(qsl[r + 1], t0 + per_item);
      const int hi = visible_end(r, t1 - 1);  // the run's last token sees the most
      const int64_t rows = static_cast<int64_t>(t1 - t0) * heads;
      int64_t splits = std::min<int64_t>({want_splits, hi / kMinSplitKeys, kMaxSplits});
      if (splits >= 2) {
        const int64_t chunk = cdiv(cdiv(hi, splits), kKeyTile) * kKeyTile;
        splits = cdiv(hi, chunk);
        if (splits >= 2 && plan.partial_rows_used + splits * rows <= ws.partial_capacity_rows) {
          MergeTask merge;
          merge.kv_head = 0;
          merge.tok_begin = t0;
          merge.tok_end = t1;
          merge.num_splits = static_cast<int32_t>(splits);
          merge.partial_base = static_cast<int32_t>(plan.partial_rows_used);
          for (int64_t s = 0; s < splits; ++s) {
            const int kb = static_cast<int>(s * chunk);
            const int ke = static_cast<int>(std::min<int64_t>(hi, (s + 1) * chunk));
            WorkItem item = item_for(r, t0, t1, kb, ke);
            item.partial_base = merge.partial_base;
            item.split_index = static_cast<int32_t>(s);
            plan.items.push_back(item);
          }
          plan.merges.push_back(merge);
          plan.partial_rows_used += splits * rows;
          continue;
        }
      }
      plan.items.push_back(item_for(r, t0, t1, 0, seq_lens[r]));
    }
  }
  if (fast_build) return;  // batch order (dynamic scheduling balances the threads)
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
}

void run_latent_decode(const CpuMlaMetadata& plan, const TensorView& q_latent,
                       const TensorView& kv_cache, DType activation, float scale, float k_scale,
                       const TensorView& o_latent, const TensorView& lse) {
  if (plan.items.empty()) return;
  CpuMlaDecodeWorkspace& ws = *plan.cpu_workspace;  // shared_ptr to non-const: the pool hands out sets
  const int heads = ws.num_heads;
  const int latent = ws.head_size;
  const int rank = ws.head_size_v;
  const int64_t cols = plan.decode_block_table_cols;
  const DType cache_dtype = kv_cache.dtype();
  // -- kernel arguments (no allocation) --
  const KernelTable& kernels = active_kernels();
  AttentionArgs args;
  args.query = q_latent.data();
  args.q_stride_t = q_latent.stride(0);
  args.q_stride_h = q_latent.stride(1);
  args.q_dtype = q_latent.dtype();
  KvSource& kv = args.kv;
  // (num_blocks, block_size, L + R): keys are whole rows, values their first L elements.
  kv.key = kv_cache.data();
  kv.value = kv_cache.data();
  kv.k_block_stride = kv.v_block_stride = kv_cache.stride(0);
  kv.k_token_stride = kv.v_token_stride = kv_cache.stride(1);
  kv.k_head_stride = kv.v_head_stride = 0;
  kv.dtype = cache_dtype;
  kv.paged = true;
  kv.block_table = plan.decode_block_table.data();
  kv.block_table_stride = cols;
  kv.block_size = plan.block_size;
  args.output = o_latent.data();
  args.o_stride_t = o_latent.stride(0);
  args.o_stride_h = o_latent.stride(1);
  args.o_dtype = o_latent.dtype();
  if (lse.defined()) {
    args.lse = lse.data_as<float>();
    args.lse_stride_h = lse.stride(0);
    args.lse_stride_t = lse.stride(1);
  }
  args.num_heads = heads;
  args.num_kv_heads = 1;
  args.group_size = heads;
  args.head_size = latent;
  args.head_size_v = rank;
  args.scale = scale;
  args.k_scale = k_scale;  // vLLM's MLA cache has one scale: keys and values
  args.v_scale = k_scale;
  args.causal = true;
  args.precision = mla_precision(kernels, activation, cache_dtype);
  args.query_start_loc = plan.decode.query_start_loc.data();
  args.seq_lens = plan.decode.seq_lens.data();
  args.first_query_pos = plan.decode_first_pos.data();
  // This decode's own scratch and partial rows (a new set only while decodes overlap).
  const auto buffers = ws.buffers.acquire();
  args.max_rows = ws.max_rows;
  args.scratch = static_cast<char*>(buffers->scratch.data());
  args.scratch_stride = ws.scratch_stride;
  args.partial_o = buffers->partial_o.defined() ? buffers->partial_o.data_as<float>() : nullptr;
  args.partial_ml = buffers->partial_ml.defined() ? buffers->partial_ml.data_as<float>() : nullptr;
  args.partial_o_stride = ws.partial_o_stride;
  run_mla_work(plan.items, plan.merges, args, ws.num_threads, kernels);
}

namespace {

// ---- builder ------------------------------------------------------------------------------------

class CpuMlaMetadataBuilder final : public mla::MLACommonMetadataBuilder {
 public:
  CpuMlaMetadataBuilder(KVCacheSpec spec, const BuilderConfig& config, Device device)
      : MLACommonMetadataBuilder(std::move(spec), config, device) {
    const char* who = "CPU_MLA make_builder: ";
    const MLADimensions& dims = config_.mla_dimensions;
    PAGEDATTN_CHECK(config_.num_heads > 0, "config.num_heads", who, "BuilderConfig.num_heads = ",
                    config_.num_heads, " must be positive: the decode scratch is sized from it");
    PAGEDATTN_CHECK(kernel_head_size(dims.latent_head_size()) && kernel_head_size(dims.kv_lora_rank),
                    "config.mla_dimensions", who, "mla_dimensions kv_lora_rank = ",
                    dims.kv_lora_rank, ", qk_rope_head_dim = ", dims.qk_rope_head_dim,
                    " are not supported: kv_lora_rank and kv_lora_rank + qk_rope_head_dim must be "
                    "multiples of ", kHeadSizeMultiple, " from ", kHeadSizeMultiple, " to ",
                    kMaxKernelHeadSize);
    // Batch-invariant builders (config_ resolved by the common builder): no split-KV.
    cpu_workspace_ = make_mla_decode_workspace(config_.num_sms, config_.num_heads, dims,
                                               !config_.batch_invariant, reorder_batch_threshold());
  }

  size_t workspace_bytes() const override {
    return MLACommonMetadataBuilder::workspace_bytes() + cpu_workspace_->bytes();
  }

 protected:
  std::shared_ptr<MLAMetadata> make_metadata() const override {
    auto plan = std::make_shared<CpuMlaMetadata>();
    plan->block_size = spec_.block_size;
    plan->cpu_workspace = cpu_workspace_;  // set even without decodes: forward_decode reads it
    return plan;
  }

  void plan_decode(MLAMetadata& metadata, const CommonAttentionMetadata& /*common*/,
                   bool fast_build) override {
    auto* plan = dynamic_cast<CpuMlaMetadata*>(&metadata);
    PAGEDATTN_CHECK(plan != nullptr, "metadata",
                    "CPU_MLA build: the plan is not a CpuMlaMetadata (make_metadata not used)");
    // Decode r is the plan's r-th decode request (padding requests left out by the builder): its
    // q tokens are the step's [qsl[r], qsl[r + 1]), at positions seq_len - q .. seq_len - 1; its
    // block-table row is row r.
    const int n = metadata.num_decodes;
    const std::vector<int32_t>& qsl = metadata.decode.query_start_loc;
    plan->decode_first_pos.resize(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) plan->decode_first_pos[r] = metadata.decode.seq_lens[r] - (qsl[r + 1] - qsl[r]);
    plan->block_size = spec_.block_size;
    const TensorView& table = metadata.decode.block_table;
    const int64_t cols = cdiv(metadata.decode.max_seq_len, spec_.block_size);
    PAGEDATTN_CHECK(table.device() == Device::cpu && table.dtype() == DType::i32 &&
                        table.ndim() == 2 && table.size(0) >= n && table.size(1) >= cols,
                    "common.block_table_tensor", "CPU_MLA build: the decode block table is ",
                    table.describe(), ": expected i32 on the cpu with >= ", n, " rows and >= ",
                    cols, " columns");
    plan->decode_block_table.resize(static_cast<size_t>(n * cols));
    plan->decode_block_table_cols = cols;
    for (int r = 0; r < n; ++r) {
      const int32_t* row = table.data_as<const int32_t>() + r * table.stride(0);
      for (int64_t b = 0; b < cols; ++b) {
        plan->decode_block_table[r * cols + b] = row[b * table.stride(1)];
      }
    }
    plan->cpu_workspace = cpu_workspace_;
    plan_mla_decode(*plan, *cpu_workspace_, fast_build);
  }

 private:
  std::shared_ptr<CpuMlaDecodeWorkspace> cpu_workspace_;
};

// ---- impl ---------------------------------------------------------------------------------------

MLAImplParams checked_params(MLAImplParams p) {
  const char* who = "CPU_MLA impl: ";
  PAGEDATTN_CHECK(p.device == Device::cpu, "device", who, "device = ", device_name(p.device),
                  " is not supported: the CPU_MLA backend runs on the cpu");
  PAGEDATTN_CHECK(host::is_activation_dtype(p.dtype), "dtype", who, "dtype = ", dtype_name(p.dtype),
                  " is not supported: expected float32, float16 or bfloat16");
  PAGEDATTN_CHECK(host::is_accepted_kv_cache_dtype(p.kv_cache_dtype), "kv_cache_dtype", who,
                  "kv_cache_dtype = '", p.kv_cache_dtype, "' is not supported: expected one of ",
                  host::accepted_kv_cache_dtypes());
  PAGEDATTN_CHECK(p.num_heads > 0, "num_heads", who, "num_heads = ", p.num_heads, " must be positive");
  PAGEDATTN_CHECK(kernel_head_size(p.dims.latent_head_size()) && kernel_head_size(p.dims.kv_lora_rank),
                  "dims", who, "kv_lora_rank = ", p.dims.kv_lora_rank, ", qk_rope_head_dim = ",
                  p.dims.qk_rope_head_dim, " are not supported: kv_lora_rank and kv_lora_rank + "
                  "qk_rope_head_dim must be multiples of ", kHeadSizeMultiple, " from ",
                  kHeadSizeMultiple, " to ", kMaxKernelHeadSize);
  PAGEDATTN_CHECK(p.block_size > 0 && p.block_size % kHeadSizeMultiple == 0, "block_size", who,
                  "block_size = ", p.block_size, " is not supported: expected a multiple of 16");
  PAGEDATTN_CHECK(std::isfinite(p.scale), "scale", who, "scale = ", p.scale, " must be finite");
  return p;
}

class CpuMlaImpl final : public mla::MLACommonImpl {
 public:
  explicit CpuMlaImpl(MLAImplParams params) : MLACommonImpl(checked_params(std::move(params))) {
    cache_dtype_ = kv_cache_storage_dtype(params_.kv_cache_dtype, params_.dtype);
    active_kernels();  // surfaces a bad PAGEDATTN_CPU_ISA at construction
  }

 protected:
  void check_decode(const LayerScales& scales, const TensorView& kv_cache,
                    const MLAMetadata& metadata, const TensorView& lse) const override {
    const char* who = "CPU_MLA forward_decode: ";
    const auto* plan = dynamic_cast<const CpuMlaMetadata*>(&metadata);
    PAGEDATTN_CHECK(plan != nullptr, "metadata", who,
                    "metadata was not built by the CPU_MLA backend's builder");
    const CpuMlaDecodeWorkspace& ws = *plan->cpu_workspace;
    const int heads = params_.num_heads;
    const int latent = params_.dims.latent_head_size();
    const int rank = params_.dims.kv_lora_rank;
    const int64_t tokens = plan->num_decode_tokens;
    PAGEDATTN_CHECK(ws.num_heads == heads && ws.head_size == latent && ws.head_size_v == rank,
                    "metadata", who, "metadata was built for num_heads = ", ws.num_heads,
                    ", latent head size ", ws.head_size, ", kv_lora_rank ", ws.head_size_v,
                    " but this layer has ", heads, ", ", latent, ", ", rank);
    if (lse.defined()) {
      const DType f32[] = {DType::f32};
      check_device(lse, "lse", Device::cpu);
      check_dtype(lse, "lse", f32);
      check_ndim(lse, "lse", 2);
      PAGEDATTN_CHECK(lse.size(0) == heads && lse.size(1) >= tokens, "lse", who, "lse has shape ",
                      lse.shape().str(), ": expected (", heads, ", >= ", tokens, ")");
    }
    const DType cache_dtypes[] = {cache_dtype_};
    check_defined(kv_cache, "kv_cache");
    check_device(kv_cache, "kv_cache", Device::cpu);
    check_dtype(kv_cache, "kv_cache", cache_dtypes);
    check_ndim(kv_cache, "kv_cache", 3);
    PAGEDATTN_CHECK(kv_cache.size(1) == plan->block_size && kv_cache.size(2) == latent &&
                        kv_cache.stride(2) == 1,
                    "kv_cache", who, "kv_cache is ", kv_cache.describe(), " with strides ",
                    kv_cache.strides().str(), ": expected (num_blocks, ", plan->block_size, ", ",
                    latent, ") with a contiguous last dim");
    const bool fp8 = is_fp8(cache_dtype_);
    PAGEDATTN_CHECK(!fp8 || (std::isfinite(scales.k_scale) && scales.k_scale > 0.f), "k_scale", who,
                    "k_scale = ", scales.k_scale, " must be a positive finite number with an fp8 "
                    "cache (read = fp8 * k_scale)");
    // Block ids: plan->cache_footprint, checked against this cache by check_forward.
  }

  void forward_decode(const LayerScales& scales, const TensorView& q_latent,
                      const TensorView& kv_cache, const MLAMetadata& metadata,
                      const TensorView& o_latent, const TensorView& lse) override {
    const char* who = "CPU_MLA forward_decode: ";
    // -- every check before anything is read or written --
    check_decode(scales, kv_cache, metadata, lse);
    metadata.cache_footprint.check_fits(kv_cache.size(0), kv_cache.size(1), "CPU_MLA",
                                        "forward_decode");
    const auto* plan = static_cast<const CpuMlaMetadata*>(&metadata);
    const int heads = params_.num_heads;
    const int latent = params_.dims.latent_head_size();
    const int rank = params_.dims.kv_lora_rank;
    const int64_t tokens = plan->num_decode_tokens;
    const DType activation[] = {params_.dtype};
    const DType outputs[] = {DType::f32, DType::f16, DType::bf16};
    check_defined(q_latent, "q_latent");
    check_device(q_latent, "q_latent", Device::cpu);
    check_dtype(q_latent, "q_latent", activation);
    check_ndim(q_latent, "q_latent", 3);
    PAGEDATTN_CHECK(q_latent.size(0) >= tokens && q_latent.size(1) == heads &&
                        q_latent.size(2) == latent && q_latent.stride(2) == 1,
                    "q_latent", who, "q_latent is ", q_latent.describe(), " with strides ",
                    q_latent.strides().str(), ": expected (>= ", tokens, ", ", heads, ", ", latent,
                    ") with a contiguous last dim");
    check_defined(o_latent, "o_latent");
    check_device(o_latent, "o_latent", Device::cpu);
    check_dtype(o_latent, "o_latent", outputs);
    check_ndim(o_latent, "o_latent", 3);
    PAGEDATTN_CHECK(o_latent.size(0) >= tokens && o_latent.size(1) == heads &&
                        o_latent.size(2) == rank && o_latent.stride(2) == 1,
                    "o_latent", who, "o_latent is ", o_latent.describe(), " with strides ",
                    o_latent.strides().str(), ": expected (>= ", tokens, ", ", heads, ", ", rank,
                    ") with a contiguous last dim");
    if (tokens == 0 || plan->items.empty()) return;

    run_latent_decode(*plan, q_latent, kv_cache, params_.dtype, params_.scale, scales.k_scale,
                      o_latent, lse);
  }

 private:
  DType cache_dtype_ = DType::bf16;
};

// ---- backend ------------------------------------------------------------------------------------

class CpuMlaBackend final : public MLABackend {
 public:
  std::string_view name() const override { return kName; }

  std::unique_ptr<MLAAttentionImpl> make_mla_impl(const MLAImplParams& params) const override {
    return std::make_unique<CpuMlaImpl>(params);
  }

  std::unique_ptr<AttentionMetadataBuilder> make_backend_builder(const KVCacheSpec& spec,
                                                                 const BuilderConfig& config,
                                                                 Device device) const override {
    const char* who = "CPU_MLA make_builder: ";
    PAGEDATTN_CHECK(device == Device::cpu, "device", who, "device = ", device_name(device),
                    " is not supported: the CPU_MLA backend runs on the cpu");
    PAGEDATTN_CHECK(spec.kind == KVCacheSpecKind::mla, "spec", who, "spec is ", spec.describe(),
                    ": the CPU_MLA backend reads MLA latent caches only (KVCacheSpec::mla)");
    PAGEDATTN_CHECK(spec.block_size > 0 && spec.block_size % kHeadSizeMultiple == 0,
                    "spec.block_size", who, "block_size = ", spec.block_size,
                    " is not supported: expected a multiple of 16");
    return std::make_unique<CpuMlaMetadataBuilder>(spec, config, device);
  }

  std::vector<KernelBlockSize> supported_kernel_block_sizes() const override {
    return {MultipleOf{kHeadSizeMultiple}};
  }

  std::vector<std::string> validate_configuration(const SelectorConfig& config) const override {
    std::vector<std::string> reasons;
    auto add = [&reasons](auto&&... parts) {
      reasons.push_back(detail::concat(std::forward<decltype(parts)>(parts)...));
    };
    mla::add_mla_common_reasons(kName, config, reasons);
    if (!config.use_mla) return reasons;
    // Device, dtype and kv_cache_dtype vocabulary of the host backends (sparse is one of the
    // common MLA reasons above: not repeated).
    SelectorConfig host_config = config;
    host_config.use_sparse = false;
    host::add_host_selector_reasons(host_config, kName, reasons);
    if (!kernel_head_size(config.head_size)) {
      add("head_size = ", config.head_size, " is not supported: the CPU_MLA backend supports "
          "latent head sizes (kv_lora_rank + qk_rope_head_dim) that are multiples of ",
          kHeadSizeMultiple, " from ", kHeadSizeMultiple, " to ", kMaxKernelHeadSize,
          " (DeepSeek: 576).");
    }
    const MLADimensions& dims = config.mla_dimensions;
    if (!dims.empty() && !kernel_head_size(dims.kv_lora_rank)) {
      add("kv_lora_rank = ", dims.kv_lora_rank, " is not supported: the CPU_MLA backend supports "
          "kv_lora_rank (the value size of the latent decode) that is a multiple of ",
          kHeadSizeMultiple, " from ", kHeadSizeMultiple, " to ", kMaxKernelHeadSize,
          " (DeepSeek: 512).");
    }
    const auto block_sizes = supported_kernel_block_sizes();
    if (!block_size_supported(block_sizes, config.block_size)) {
      add("block_size = ", config.block_size, " is not supported: the CPU_MLA backend supports "
          "block sizes that are ", describe_block_sizes(block_sizes), ".");
    }
    return reasons;
  }

  BackendCapabilities capabilities() const override {
    BackendCapabilities caps;
    caps.devices = {Device::cpu};
    caps.dtypes = {DType::f32, DType::f16, DType::bf16};
    caps.kv_cache_dtypes = host::kv_cache_dtype_names();
    for (int d = kHeadSizeMultiple; d <= kMaxKernelHeadSize; d += kHeadSizeMultiple) {
      caps.head_sizes.push_back(d);
    }
    caps.attn_types = {AttentionType::decoder};
    caps.features = {"mla",  "lse",  "split_kv", "fp8_kv_cache", "avx512_bf16",
                     "avx2", "openmp", "batch_invariant"};
    return caps;
  }
};

}  // namespace
}  // namespace cpu

const AttentionBackend& cpu_mla_backend() {
  static const cpu::CpuMlaBackend backend;
  return backend;
}

}  // namespace pagedattn
