// The CPU MLA prefill backend: the up-projected (MHA) part of MLA prefill, on the CPU backend's
// flash-style tile kernels (cpu_attention_tile.h).
//
// What it computes (H heads, qk head P + R, value head V; prefill i has query tokens
// [qsl[i], qsl[i+1]) of the step's prefill token axis):
//   run_prefill_new_tokens:     out[t, h] = softmax_j(scale · q[t,h]·k[j,h]) · v[j,h] over the
//                               request's own new tokens j <= t (causal), LSE (natural log) when
//                               asked. Keys/values are the given k (Tp, H, P+R) / v (Tp, H, V).
//   run_prefill_context_chunk:  the same, non-causal, over keys [cu[c][i], cu[c][i+1]) of the
//                               chunk's k / v; an empty chunk gives out 0, LSE -inf.
// As the CPU backend's kernels see it: num_kv_heads = H (group size 1), no cache (KvSource over
// k / v; context chunks add a per-request key start, KvSource::key_start_loc).
//
// Tiling: one work item per (request, head, q tile of kMaxItemRows tokens), sorted largest
// first and run with dynamic OpenMP scheduling; inside an item, 64-key tiles of K (packed
// transposed) and V are shared by the item's 128 query rows (cpu_attention_tile.h).
// Memory traffic: q and out once; each head's K/V once per q tile of 128 tokens, i.e. about
// (query tokens / 128) times the K/V bytes (causal: half that) — small next to the
// 2·H·(P+R+V)·(causal pairs) FLOPs, so the floor is the bf16 dot rate (compute-bound).
// Precision: as the CPU backend (bf16 activations: bf16 dot products — vdpbf16ps, or AMX tiles
// where present — with f32 accumulation, P rounded to bf16; f32 / f16: f32 FMA; output rounded
// once at the store). Measured (bench/cpu_mla_bench.cpp, Zen 5, 2 threads, 16 heads, 1 x 2048
// new tokens, bf16): ~29 ms, ~730 GFLOP/s = ~65% of the vdpbf16ps peak.
//
// Memory: the per-thread scratch (thread_scratch_bytes for P+R, V, 128 rows) is allocated when
// the first instance with a given (threads, dims) is created and shared by every instance with
// the same sizes (one per MLA layer): layers run one after another, and a mutex serialises any
// concurrent use instead of letting two runs share a scratch. The item lists are built in
// prepare_metadata (once per step); the run allocates nothing.
#include "backends/cpu/cpu_mla_prefill.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "backends/cpu/cpu_internal.h"
#include "backends/host_backend_common.h"
#include "pagedattn/error.h"

namespace pagedattn {
namespace cpu {

void run_mla_work(const std::vector<WorkItem>& items, const std::vector<MergeTask>& merges,
                  const AttentionArgs& args, int threads, const KernelTable& kernels) {
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t num_merges = static_cast<int64_t>(merges.size());
  if (num_items == 0) return;
  const int used = static_cast<int>(std::min<int64_t>(threads, num_items));
  if (used <= 1) {
    for (int64_t i = 0; i < num_items; ++i) kernels.run_item(args, items[i], args.scratch);
    for (int64_t i = 0; i < num_merges; ++i) kernels.merge(args, merges[i]);
    return;
  }
#pragma omp parallel num_threads(used)
  {
    char* scratch = args.scratch + static_cast<size_t>(omp_get_thread_num()) * args.scratch_stride;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) kernels.run_item(args, items[i], scratch);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_merges; ++i) kernels.merge(args, merges[i]);
  }
}

Precision mla_precision(const KernelTable& kernels, DType activation_dtype, DType kv_dtype) {
  const bool bf16_operands = activation_dtype == DType::bf16 || is_fp8(kv_dtype);
  return kernels.has_bf16_dot && bf16_operands ? Precision::bf16_dot : Precision::f32;
}

namespace {

bool kernel_head_size(int size) {
  return size >= kHeadSizeMultiple && size <= kMaxKernelHeadSize && size % kHeadSizeMultiple == 0;
}

// Per-thread scratch shared by the instances of one (threads, D, Dv).
struct SharedScratch {
  Tensor memory;        // (threads * stride,) u8
  size_t stride = 0;    // bytes per thread, multiple of 64
  std::mutex in_use;    // held for the duration of a run
};

std::shared_ptr<SharedScratch> shared_scratch(int threads, int head_size, int head_size_v) {
  static std::mutex registry_mutex;
  static std::map<std::tuple<int, int, int>, std::weak_ptr<SharedScratch>> registry;
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& slot = registry[{threads, head_size, head_size_v}];
  if (auto existing = slot.lock()) return existing;
  auto scratch = std::make_shared<SharedScratch>();
  scratch->stride = (thread_scratch_bytes(head_size, head_size_v, kMaxItemRows) + 63) &
                    ~static_cast<size_t>(63);
  scratch->memory = Tensor(Shape{static_cast<int64_t>(scratch->stride) * threads}, DType::u8);
  slot = scratch;
  return scratch;
}

// Items of one attention call: (request, head, q tile), largest first. key_lens[r] keys per
// request; causal: query t of request r sits at position t - qsl[r] and sees keys [0, pos].
void plan_items(int num_reqs, const int32_t* qsl, const int32_t* key_lens, bool causal,
                int num_heads, int64_t dims, std::vector<WorkItem>& items) {
  items.clear();
  for (int r = 0; r < num_reqs; ++r) {
    const int q_first = qsl[r], q_end = qsl[r + 1];
    for (int t = q_first; t < q_end; t += kMaxItemRows) {
      const int t_end = std::min(q_end, t + kMaxItemRows);
      int64_t keys = 0;
      for (int u = t; u < t_end; ++u) {
        keys += causal ? std::min<int64_t>(key_lens[r], u - q_first + 1) : key_lens[r];
      }
      for (int h = 0; h < num_heads; ++h) {
        WorkItem item;
        item.kv_head = h;
        item.req_begin = r;
        item.req_end = r + 1;
        item.tok_begin = t;
        item.tok_end = t_end;
        item.kv_begin = 0;
        item.kv_end = key_lens[r];
        item.cost = keys * dims + 1;
        items.push_back(item);
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
}

void check_params(const MLAPrefillParams& p) {
  const char* who = "CPU MLA prefill: ";
  PAGEDATTN_CHECK(p.device == Device::cpu, "device", who, "device = ", device_name(p.device),
                  " is not supported: the CPU MLA prefill backend runs on the cpu");
  PAGEDATTN_CHECK(host::is_activation_dtype(p.dtype), "dtype", who, "dtype = ",
                  dtype_name(p.dtype), " is not supported: expected float32, float16 or bfloat16");
  PAGEDATTN_CHECK(p.num_heads > 0, "num_heads", who, "num_heads = ", p.num_heads,
                  " must be positive");
  PAGEDATTN_CHECK(p.qk_nope_head_dim >= 0 && p.qk_rope_head_dim >= 0 &&
                      kernel_head_size(p.qk_nope_head_dim + p.qk_rope_head_dim),
                  "qk_nope_head_dim", who, "qk_nope_head_dim + qk_rope_head_dim = ",
                  p.qk_nope_head_dim, " + ", p.qk_rope_head_dim, " is not supported: expected a "
                  "multiple of ", kHeadSizeMultiple, " from ", kHeadSizeMultiple, " to ",
                  kMaxKernelHeadSize);
  PAGEDATTN_CHECK(kernel_head_size(p.v_head_dim), "v_head_dim", who, "v_head_dim = ",
                  p.v_head_dim, " is not supported: expected a multiple of ", kHeadSizeMultiple,
                  " from ", kHeadSizeMultiple, " to ", kMaxKernelHeadSize);
  PAGEDATTN_CHECK(std::isfinite(p.scale), "scale", who, "scale = ", p.scale, " must be finite");
}

class CpuMlaPrefill final : public MLAPrefillBackend {
 public:
  explicit CpuMlaPrefill(const MLAPrefillParams& params)
      : MLAPrefillBackend(params),
        threads_(resolve_num_threads(0)),
        qk_dim_(params.qk_nope_head_dim + params.qk_rope_head_dim),
        scratch_(shared_scratch(threads_, qk_dim_, params.v_head_dim)) {
    active_kernels();  // surfaces a bad PAGEDATTN_CPU_ISA at creation
  }

  std::string_view get_name() const override { return "CPU"; }

  void prepare_metadata(const MLAPrefillMetadata& md) override {
    const char* who = "CPU MLA prefill prepare_metadata: ";
    const int n = md.num_prefills;
    PAGEDATTN_CHECK(n >= 0 && static_cast<int>(md.query_start_loc.size()) == n + 1 &&
                        static_cast<int>(md.seq_lens.size()) == n &&
                        static_cast<int>(md.context_lens.size()) == n,
                    "prefill_metadata", who, "num_prefills = ", n, " but query_start_loc has ",
                    md.query_start_loc.size(), " entries, seq_lens ", md.seq_lens.size(),
                    " and context_lens ", md.context_lens.size(),
                    ": expected num_prefills + 1, num_prefills, num_prefills");
    PAGEDATTN_CHECK(md.query_start_loc[0] == 0 && md.query_start_loc[n] == md.num_prefill_tokens,
                    "prefill_metadata", who, "query_start_loc runs from ", md.query_start_loc[0],
                    " to ", md.query_start_loc[n], ": expected 0 to num_prefill_tokens = ",
                    md.num_prefill_tokens);
    query_lens_.resize(static_cast<size_t>(n));
    first_pos_.assign(static_cast<size_t>(n), 0);
    for (int i = 0; i < n; ++i) {
      query_lens_[i] = md.query_start_loc[i + 1] - md.query_start_loc[i];
      PAGEDATTN_CHECK(query_lens_[i] >= 0, "prefill_metadata", who, "query_start_loc[", i + 1,
                      "] = ", md.query_start_loc[i + 1], " < query_start_loc[", i, "] = ",
                      md.query_start_loc[i], ": expected non-decreasing");
    }
    const int64_t dims = qk_dim_ + params_.v_head_dim;
    plan_items(n, md.query_start_loc.data(), query_lens_.data(), true, params_.num_heads, dims,
               new_items_);
    const int chunks = md.chunked_context ? md.chunked_context->num_chunks : 0;
    if (static_cast<int>(chunk_items_.size()) < chunks) chunk_items_.resize(chunks);
    chunk_lens_.resize(static_cast<size_t>(chunks) * n);
    for (int c = 0; c < chunks; ++c) {
      const MLAChunkedContextMetadata& cc = *md.chunked_context;
      PAGEDATTN_CHECK(cc.cu_seq_lens.size() >= static_cast<size_t>(c + 1) * (n + 1) &&
                          cc.chunk_total_tokens.size() > static_cast<size_t>(c),
                      "prefill_metadata", who, "chunked_context has ", cc.cu_seq_lens.size(),
                      " cu_seq_lens entries and ", cc.chunk_total_tokens.size(),
                      " chunk totals: expected num_chunks * (num_prefills + 1) = ",
                      static_cast<int64_t>(chunks) * (n + 1), " and num_chunks = ", chunks);
      const int32_t* cu = cc.cu_seq_lens.data() + static_cast<size_t>(c) * (n + 1);
      int32_t* lens = chunk_lens_.data() + static_cast<size_t>(c) * n;
      for (int i = 0; i < n; ++i) {
        lens[i] = cu[i + 1] - cu[i];
        PAGEDATTN_CHECK(cu[0] >= 0 && lens[i] >= 0, "prefill_metadata", who,
                        "chunked_context cu_seq_lens[", c, "] is not non-decreasing from >= 0 at "
                        "prefill ", i);
      }
      plan_items(n, md.query_start_loc.data(), lens, false, params_.num_heads, dims,
                 chunk_items_[c]);
    }
    num_chunks_ = chunks;
    prefill_metadata_ = &md;
  }

  void run_prefill_new_tokens(const TensorView& q, const TensorView& k, const TensorView& v,
                              bool return_softmax_lse, const TensorView& out,
                              const TensorView& lse, const TensorView& output_scale) override {
    const char* entry = "run_prefill_new_tokens";
    const MLAPrefillMetadata& md = checked_metadata(entry);
    PAGEDATTN_CHECK(!output_scale.defined(), "output_scale", "CPU MLA prefill ", entry,
                    ": output_scale is given but this backend does not write quantized output "
                    "(supports_quant_output is false)");
    const int64_t tokens = md.num_prefill_tokens;
    check_qkv(q, k, v, tokens, tokens, entry);
    check_out_lse(out, lse, return_softmax_lse, tokens, entry);
    if (tokens == 0) return;
    AttentionArgs args = make_args(q, k, v, out, return_softmax_lse ? lse : TensorView{});
    args.causal = true;
    args.seq_lens = query_lens_.data();
    run(new_items_, args);
  }

  std::pair<TensorView, TensorView> run_prefill_context_chunk(int chunk_idx, const TensorView& q,
                                                              const TensorView& k,
                                                              const TensorView& v,
                                                              const TensorView& out,
                                                              const TensorView& lse) override {
    const char* entry = "run_prefill_context_chunk";
    const MLAPrefillMetadata& md = checked_metadata(entry);
    PAGEDATTN_CHECK(chunk_idx >= 0 && chunk_idx < num_chunks_, "chunk_idx", "CPU MLA prefill ",
                    entry, ": chunk_idx = ", chunk_idx, " is out of range: the step has ",
                    num_chunks_, " context chunks");
    const MLAChunkedContextMetadata& cc = *md.chunked_context;
    const int n = md.num_prefills;
    const int64_t tokens = md.num_prefill_tokens;
    check_qkv(q, k, v, tokens, cc.chunk_total_tokens[chunk_idx], entry);
    check_out_lse(out, lse, true, tokens, entry);
    if (tokens > 0) {
      AttentionArgs args = make_args(q, k, v, out, lse);
      args.causal = false;
      args.seq_lens = chunk_lens_.data() + static_cast<size_t>(chunk_idx) * n;
      args.kv.key_start_loc = cc.cu_seq_lens.data() + static_cast<size_t>(chunk_idx) * (n + 1);
      run(chunk_items_[chunk_idx], args);
    }
    return {out, lse};
  }

 private:
  const MLAPrefillMetadata& checked_metadata(const char* entry) const {
    PAGEDATTN_CHECK(prefill_metadata_ != nullptr, "prefill_metadata", "CPU MLA prefill ", entry,
                    ": prepare_metadata was not called for this step");
    return *prefill_metadata_;
  }

  void check_qkv(const TensorView& q, const TensorView& k, const TensorView& v, int64_t q_rows,
                 int64_t kv_rows, const char* entry) const {
    const DType activation[] = {params_.dtype};
    const int h = params_.num_heads;
    for (const auto& [t, arg, rows, dim] :
         {std::tuple{&q, "q", q_rows, qk_dim_}, std::tuple{&k, "k", kv_rows, qk_dim_},
          std::tuple{&v, "v", kv_rows, params_.v_head_dim}}) {
      check_defined(*t, arg);
      check_device(*t, arg, Device::cpu);
      check_dtype(*t, arg, activation);
      check_ndim(*t, arg, 3);
      PAGEDATTN_CHECK(t->size(0) >= rows && t->size(1) == h && t->size(2) == dim &&
                          t->stride(2) == 1,
                      arg, "CPU MLA prefill ", entry, ": ", arg, " is ", t->describe(),
                      " with strides ", t->strides().str(), ": expected (>= ", rows, ", ", h, ", ",
                      dim, ") with a contiguous last dim");
    }
  }

  void check_out_lse(const TensorView& out, const TensorView& lse, bool want_lse, int64_t tokens,
                     const char* entry) const {
    const DType activation[] = {params_.dtype};
    const int h = params_.num_heads;
    check_defined(out, "out");
    check_device(out, "out", Device::cpu);
    check_dtype(out, "out", activation);
    check_ndim(out, "out", 3);
    PAGEDATTN_CHECK(out.size(0) >= tokens && out.size(1) == h &&
                        out.size(2) == params_.v_head_dim && out.stride(2) == 1,
                    "out", "CPU MLA prefill ", entry, ": out is ", out.describe(), " with strides ",
                    out.strides().str(), ": expected (>= ", tokens, ", ", h, ", ",
                    params_.v_head_dim, ") with a contiguous last dim");
    if (!want_lse) return;
    const DType f32[] = {DType::f32};
    check_defined(lse, "lse");
    check_device(lse, "lse", Device::cpu);
    check_dtype(lse, "lse", f32);
    check_ndim(lse, "lse", 2);
    PAGEDATTN_CHECK(lse.size(0) == h && lse.size(1) >= tokens, "lse", "CPU MLA prefill ", entry,
                    ": lse has shape ", lse.shape().str(), ": expected (", h, ", >= ", tokens, ")");
  }

  AttentionArgs make_args(const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& out, const TensorView& lse) const {
    const KernelTable& kernels = active_kernels();
    AttentionArgs args;
    args.query = q.data();
    args.q_stride_t = q.stride(0);
    args.q_stride_h = q.stride(1);
    args.q_dtype = q.dtype();
    KvSource& kv = args.kv;
    kv.key = k.data();
    kv.value = v.data();
    kv.k_token_stride = k.stride(0);
    kv.k_head_stride = k.stride(1);
    kv.v_token_stride = v.stride(0);
    kv.v_head_stride = v.stride(1);
    kv.dtype = params_.dtype;
    kv.paged = false;
    args.output = out.data();
    args.o_stride_t = out.stride(0);
    args.o_stride_h = out.stride(1);
    args.o_dtype = out.dtype();
    if (lse.defined()) {
      args.lse = lse.data_as<float>();
      args.lse_stride_h = lse.stride(0);
      args.lse_stride_t = lse.stride(1);
    }
    args.num_heads = params_.num_heads;
    args.num_kv_heads = params_.num_heads;
    args.group_size = 1;
    args.head_size = qk_dim_;
    args.head_size_v = params_.v_head_dim;
    args.scale = params_.scale;
    args.precision = mla_precision(kernels, params_.dtype, params_.dtype);
    args.query_start_loc = prefill_metadata_->query_start_loc.data();
    args.first_query_pos = first_pos_.data();
    args.max_rows = kMaxItemRows;
    args.scratch = static_cast<char*>(scratch_->memory.data());
    args.scratch_stride = scratch_->stride;
    return args;
  }

  void run(const std::vector<WorkItem>& items, const AttentionArgs& args) {
    static const std::vector<MergeTask> kNoMerges;
    std::lock_guard<std::mutex> lock(scratch_->in_use);
    run_mla_work(items, kNoMerges, args, threads_, active_kernels());
  }

  int threads_;
  int qk_dim_;
  std::shared_ptr<SharedScratch> scratch_;
  // The step's plan (prepare_metadata): per-request query lengths, zero first positions, the
  // new-token items and, per context chunk, its key counts and items.
  std::vector<int32_t> query_lens_, first_pos_, chunk_lens_;
  std::vector<WorkItem> new_items_;
  std::vector<std::vector<WorkItem>> chunk_items_;
  int num_chunks_ = 0;
};

class CpuMlaPrefillClass final : public MLAPrefillBackendClass {
 public:
  std::string_view get_name() const override { return "CPU"; }
  Device device() const override { return Device::cpu; }
  std::vector<DType> supported_dtypes() const override {
    return {DType::f32, DType::f16, DType::bf16};
  }
  std::vector<std::string> validate_configuration(
      const DeviceCapability& capability, const MLAPrefillSelectorConfig& config) const override {
    std::vector<std::string> reasons =
        MLAPrefillBackendClass::validate_configuration(capability, config);
    const MLADimensions& d = config.mla_dimensions;
    if (!kernel_head_size(d.qk_head_dim())) {
      reasons.push_back(detail::concat(
          "qk_nope_head_dim + qk_rope_head_dim = ", d.qk_nope_head_dim, " + ", d.qk_rope_head_dim,
          " = ", d.qk_head_dim(), " is not supported: the CPU MLA prefill backend supports query/"
          "key head sizes that are multiples of ", kHeadSizeMultiple, " from ", kHeadSizeMultiple,
          " to ", kMaxKernelHeadSize, "."));
    }
    if (!kernel_head_size(d.v_head_dim)) {
      reasons.push_back(detail::concat(
          "v_head_dim = ", d.v_head_dim, " is not supported: the CPU MLA prefill backend supports "
          "value head sizes that are multiples of ", kHeadSizeMultiple, " from ",
          kHeadSizeMultiple, " to ", kMaxKernelHeadSize, "."));
    }
    return reasons;
  }
  std::unique_ptr<MLAPrefillBackend> create(const MLAPrefillParams& params) const override {
    check_params(params);
    return std::make_unique<CpuMlaPrefill>(params);
  }
};

}  // namespace
}  // namespace cpu

const MLAPrefillBackendClass& cpu_mla_prefill_backend_class() {
  static const cpu::CpuMlaPrefillClass backend;
  return backend;
}

}  // namespace pagedattn
