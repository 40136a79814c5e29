// CUDA MLA against the host and fp64 oracles:
//   CudaMlaOps.*     the device primitives vs the same ops on the cpu (cache writes and gathers
//                    bit-exact; cuBLAS batched GEMM within f32-accumulation rounding; copy_3d exact)
//   CudaMlaDecode.*  the latent decode kernels (mma.sync; wgmma for > 16 rows a request on
//                    sm_90a, 16-bit and fp8 caches) + split-KV combine vs an fp64 oracle of the absorbed
//                    formula, over head counts, cache dtypes, block sizes, partitions
//   CudaMlaPrefill.* the "CUDA" prefill backend vs the REFERENCE prefill backend (fp64, cpu)
//   CudaMlaLayer.*   MLAAttention on CUDA_MLA vs MLAAttention on REFERENCE_MLA (the un-absorbed
//                    fp64 oracle) at DeepSeek dims: decode only, new tokens only, new + 1 / 2 /
//                    many context chunks, mixed, fp8 cache, 16 and 128 heads
// Every output is poisoned (NaN) before the run and every element checked finite. Fused fp8
// output (output_scale): test_gpu_mla_fp8_output.cpp.
// PAGEDATTN_GPU_SMALL_GRID=1 (the sanitizer runs) keeps the smallest cases only.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../../src/backends/cuda/mla/mla_cuda_backend.h"
#include "../../src/backends/cuda/mla/mla_decode.h"
#include "../../src/backends/cuda/mla/mla_decode_wgmma.h"
#include "../../src/backends/mla/mla_common.h"
#include "../../src/backends/reference/reference_mla.h"
#include "conformance/mla_harness.h"
#include "conformance/mla_padding.h"
#include "gpu_test_util.h"
#include "pagedattn/device.h"
#include "pagedattn/mla.h"

namespace pagedattn {
namespace {

using gpu_test::random_host;
using gpu_test::rel_error;

constexpr int kL = 512, kR = 64, kP = 128, kV = 128;

bool small_grid() {
  const char* e = std::getenv("PAGEDATTN_GPU_SMALL_GRID");
  return e != nullptr && *e == '1';
}

Tensor to_host(const TensorView& t) {
  synchronize_cuda();
  Tensor h(t.shape(), t.dtype(), Device::cpu);
  h.copy_from(t);
  return h;
}
Tensor to_dev(const TensorView& t) {
  Tensor d(t.shape(), t.dtype(), Device::cuda);
  d.copy_from(t);
  return d;
}
Tensor i32_tensor(const std::vector<int32_t>& v, Device device, Shape shape = {}) {
  if (shape.ndim() == 0) shape = Shape{static_cast<int64_t>(v.size())};
  Tensor h(shape, DType::i32, Device::cpu);
  std::copy(v.begin(), v.end(), h.data_as<int32_t>());
  return device == Device::cpu ? std::move(h) : to_dev(h);
}
Tensor i64_tensor(const std::vector<int64_t>& v, Device device) {
  Tensor h(Shape{static_cast<int64_t>(v.size())}, DType::i64, Device::cpu);
  std::copy(v.begin(), v.end(), h.data_as<int64_t>());
  return device == Device::cpu ? std::move(h) : to_dev(h);
}
bool bytes_equal(const TensorView& a, const TensorView& b) {
  return a.span_bytes() == b.span_bytes() && std::memcmp(a.data(), b.data(), a.span_bytes()) == 0;
}
bool all_finite(const TensorView& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!std::isfinite(load_f64(t.data(), t.dtype(), i))) return false;
  return true;
}

// ---- ops -------------------------------------------------------------------------------------

TEST(CudaMlaOps, ConcatAndCacheMatchesCpu) {
  PAGEDATTN_REQUIRE_GPU();
  struct Case {
    DType input;
    const char* cache;
    bool k_pe_3d;
  };
  for (const Case c : {Case{DType::bf16, "auto", false}, Case{DType::f16, "auto", true},
                       Case{DType::bf16, "fp8_e4m3", false}, Case{DType::f32, "fp8_e5m2", true},
                       Case{DType::f32, "auto", false}}) {
    SCOPED_TRACE(detail::concat(dtype_name(c.input), " cache=", c.cache));
    const int64_t n = 37, blocks = 5, bs = 16;
    const DType storage = kv_cache_storage_dtype(c.cache, c.input);
    const Tensor kv_c = random_host(Shape{n, kL}, c.input, 11, -3.f, 3.f);
    const Tensor k_pe = random_host(c.k_pe_3d ? Shape{n, 1, kR} : Shape{n, kR}, c.input, 12, -3.f, 3.f);
    std::vector<int64_t> slots(blocks * bs);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), std::mt19937(3));
    slots.resize(n - 2);  // N' < N: the last two tokens are not written
    slots[3] = -1;
    slots[9] = -1;
    Tensor cache_h(Shape{blocks, bs, kL + kR}, storage, Device::cpu);
    cache_h.fill_bytes(0x3c);
    Tensor cache_d = to_dev(cache_h);
    const float scale = 0.37f;
    concat_and_cache_mla(kv_c, k_pe, cache_h, i64_tensor(slots, Device::cpu), c.cache, scale);
    const Tensor kv_c_d = to_dev(kv_c), k_pe_d = to_dev(k_pe);
    // The device also skips slots outside the cache (the host op rejects them).
    std::vector<int64_t> dev_slots = slots;
    dev_slots[3] = blocks * bs + 5;
    concat_and_cache_mla(kv_c_d, k_pe_d, cache_d, i64_tensor(dev_slots, Device::cuda), c.cache, scale);
    EXPECT_TRUE(bytes_equal(to_host(cache_d), cache_h));
  }
}

TEST(CudaMlaOps, GatherMatchesCpu) {
  PAGEDATTN_REQUIRE_GPU();
  for (const char* cache_dtype : {"auto", "fp8_e4m3", "fp8_e5m2"}) {
    for (const DType dst_dtype : {DType::bf16, DType::f32}) {
      if (std::string(cache_dtype) == "auto" && dst_dtype != DType::bf16) continue;  // auto: dst = cache dtype
      SCOPED_TRACE(detail::concat("cache=", cache_dtype, " dst=", dtype_name(dst_dtype)));
      const int64_t blocks = 12, bs = 16, batch = 3, cols = 4;
      const DType storage = kv_cache_storage_dtype(cache_dtype, DType::bf16);
      Tensor cache_h(Shape{blocks, bs, kL + kR}, storage, Device::cpu);
      // Written through the op so fp8 bytes are real values.
      const Tensor rows = random_host(Shape{blocks * bs, kL + kR}, DType::bf16, 21, -2.f, 2.f);
      std::vector<int64_t> all(blocks * bs);
      std::iota(all.begin(), all.end(), 0);
      concat_and_cache_mla(rows.view().narrow(1, 0, kL), rows.view().narrow(1, kL, kR), cache_h,
                           i64_tensor(all, Device::cpu), cache_dtype, 0.5f);
      std::vector<int32_t> bt(batch * cols);
      std::iota(bt.begin(), bt.end(), 0);
      std::shuffle(bt.begin(), bt.end(), std::mt19937(5));
      const std::vector<int32_t> cu = {0, 20, 20, 57};   // request 1 empty
      const std::vector<int32_t> starts = {5, 0, 3};
      Tensor dst_h(Shape{60, kL + kR}, dst_dtype, Device::cpu);
      dst_h.fill_bytes(0x41);
      Tensor dst_d = to_dev(dst_h);
      gather_and_maybe_dequant_cache(cache_h, dst_h, i32_tensor(bt, Device::cpu, Shape{batch, cols}),
                                     i32_tensor(cu, Device::cpu), batch, cache_dtype, 0.5f,
                                     i32_tensor(starts, Device::cpu));
      const Tensor cache_d = to_dev(cache_h);
      gather_and_maybe_dequant_cache(cache_d, dst_d, i32_tensor(bt, Device::cuda, Shape{batch, cols}),
                                     i32_tensor(cu, Device::cuda), batch, cache_dtype, 0.5f,
                                     i32_tensor(starts, Device::cuda));
      EXPECT_TRUE(bytes_equal(to_host(dst_d), dst_h));
    }
  }
}

TEST(CudaMlaOps, BatchedGemmMatchesCpu) {
  PAGEDATTN_REQUIRE_GPU();
  struct Case {
    DType in, out;
    bool a_t, b_t, broadcast_b;
  };
  const int batch = 3, m = 7, n = 40, k = 48;
  for (const Case c : {Case{DType::bf16, DType::bf16, false, false, false}, Case{DType::bf16, DType::f32, true, false, false},
                       Case{DType::f16, DType::f16, false, true, true}, Case{DType::f32, DType::f32, true, true, false},
                       Case{DType::bf16, DType::bf16, false, true, true}}) {
    SCOPED_TRACE(detail::concat(dtype_name(c.in), "->", dtype_name(c.out), " a_t=", c.a_t, " b_t=", c.b_t,
                                " bcast=", c.broadcast_b));
    // A (batch, m, k): stored (batch, k, m) when transposed; B likewise.
    const Tensor a = random_host(c.a_t ? Shape{batch, k, m} : Shape{batch, m, k}, c.in, 31);
    const Tensor b = random_host(c.b_t ? Shape{batch, n, k} : Shape{batch, k, n}, c.in, 32);
    auto ref = [&](const Tensor& t, bool transposed, int rows, int cols, bool bcast) {
      mla::MatrixRef r;
      r.data = t.data();
      r.dtype = t.dtype();
      r.batch_stride = bcast ? 0 : static_cast<int64_t>(rows) * cols;
      r.row_stride = transposed ? 1 : cols;
      r.col_stride = transposed ? rows : 1;
      return r;
    };
    const Tensor a_d = to_dev(a), b_d = to_dev(b);
    Tensor c_h(Shape{batch, m, n + 3}, c.out, Device::cpu), c_d(Shape{batch, m, n + 3}, c.out, Device::cuda);
    c_h.fill_bytes(0);
    c_d.fill_bytes(0);
    auto out = [&](const Tensor& t) {
      mla::MutableMatrixRef r;
      r.data = t.data();
      r.dtype = t.dtype();
      r.batch_stride = static_cast<int64_t>(m) * (n + 3);
      r.row_stride = n + 3;
      return r;
    };
    mla::batched_gemm(Device::cpu, batch, m, n, k, ref(a, c.a_t, m, k, false), ref(b, c.b_t, k, n, c.broadcast_b), out(c_h));
    mla::batched_gemm(Device::cuda, batch, m, n, k, ref(a_d, c.a_t, m, k, false), ref(b_d, c.b_t, k, n, c.broadcast_b),
                      out(c_d));
    const Tensor got = to_host(c_d);
    const double tol = c.out == DType::f32 ? 1e-6 : c.out == DType::f16 ? 1e-3 : 4e-3;
    EXPECT_LT(rel_error(got, c_h), tol);
  }
}

TEST(CudaMlaOps, Copy3dMatchesCpu) {
  PAGEDATTN_REQUIRE_GPU();
  const Tensor src = random_host(Shape{5, 1, 64}, DType::bf16, 41);
  // src broadcast over dim 1 (stride 0), dst (5, 3, 64) inside a (5, 3, 80) buffer.
  const TensorView src_b(src.data(), DType::bf16, Shape{5, 3, 64}, Shape{64, 0, 1}, Device::cpu);
  const Tensor src_d = to_dev(src);
  const TensorView src_db(src_d.data(), DType::bf16, Shape{5, 3, 64}, Shape{64, 0, 1}, Device::cuda);
  for (const DType out : {DType::bf16, DType::f32, DType::f16}) {
    Tensor dst_h(Shape{5, 3, 80}, out, Device::cpu), dst_d(Shape{5, 3, 80}, out, Device::cuda);
    dst_h.fill_bytes(0x7f);
    dst_d.fill_bytes(0x7f);
    mla::copy_3d(src_b, dst_h.view().narrow(2, 8, 64));
    mla::copy_3d(src_db, dst_d.view().narrow(2, 8, 64));
    EXPECT_TRUE(bytes_equal(to_host(dst_d), dst_h)) << dtype_name(out);
  }
}

// ---- decode kernel ---------------------------------------------------------------------------

namespace md = cuda::mla_decode;

struct DecodeCase {
  int heads = 16;
  DType act = DType::bf16;
  DType cache = DType::bf16;
  int block_size = 64;
  int parts = 132;
  std::vector<int32_t> seq_lens;    // per request: the keys of its last token
  std::vector<int32_t> query_lens;  // per request (speculative decodes: 2..8), or empty: 1 each
};

void run_decode_case(const DecodeCase& c, uint64_t seed) {
  const int nr = static_cast<int>(c.seq_lens.size());
  std::vector<int32_t> qsl = {0}, token_req, token_len;  // per token: request, keys seen
  for (int r = 0; r < nr; ++r) {
    const int q = c.query_lens.empty() ? 1 : c.query_lens[r];
    qsl.push_back(qsl.back() + q);
    for (int t = 0; t < q; ++t) {
      token_req.push_back(r);
      token_len.push_back(c.seq_lens[r] - q + 1 + t);
    }
  }
  const int b = qsl.back();  // decode tokens
  SCOPED_TRACE(detail::concat("H=", c.heads, " act=", dtype_name(c.act), " cache=", dtype_name(c.cache), " bs=",
                              c.block_size, " parts=", c.parts, " requests=", nr, " tokens=", b));
  const int h = c.heads;
  const int max_seq = *std::max_element(c.seq_lens.begin(), c.seq_lens.end());
  const int cols = std::max(1, (max_seq + c.block_size - 1) / c.block_size);
  const int blocks = nr * cols + 3;
  const bool fp8 = is_fp8(c.cache);
  const float k_scale = fp8 ? 0.125f : 1.f;
  const float scale = 0.09f;
  const Tensor q = random_host(Shape{b, h, kL + kR}, c.act, seed);
  const Tensor cache = random_host(Shape{blocks, c.block_size, kL + kR}, c.cache, seed + 1, fp8 ? -12.f : -1.f,
                                   fp8 ? 12.f : 1.f);
  std::vector<int32_t> req_bt(static_cast<size_t>(nr) * cols);  // a row per request
  std::iota(req_bt.begin(), req_bt.end(), 2);
  std::shuffle(req_bt.begin(), req_bt.end(), std::mt19937(static_cast<uint32_t>(seed)));

  // fp64 oracle of the absorbed formula, per token (token t of q sees seq_len - q + 1 + t keys).
  std::vector<double> ref_o(static_cast<size_t>(b) * h * kL), ref_lse(static_cast<size_t>(b) * h);
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int i = 0; i < b; ++i) {
    for (int hh = 0; hh < h; ++hh) {
      const int r = token_req[i];
      const int s = token_len[i];
      std::vector<double> logits(std::max(s, 0));
      double mx = -INFINITY;
      for (int n = 0; n < s; ++n) {
        const int64_t row = (static_cast<int64_t>(req_bt[r * cols + n / c.block_size]) * c.block_size + n % c.block_size) * (kL + kR);
        double dot = 0;
        for (int d = 0; d < kL + kR; ++d)
          dot += load_f64(q.data(), c.act, (static_cast<int64_t>(i) * h + hh) * (kL + kR) + d) *
                 load_f64(cache.data(), c.cache, row + d) * k_scale;
        logits[n] = dot * scale;
        mx = std::max(mx, logits[n]);
      }
      double sum = 0;
      std::vector<double> o(kL, 0.0);
      for (int n = 0; n < s; ++n) {
        const double w = std::exp(logits[n] - mx);
        sum += w;
        const int64_t row = (static_cast<int64_t>(req_bt[r * cols + n / c.block_size]) * c.block_size + n % c.block_size) * (kL + kR);
        for (int d = 0; d < kL; ++d) o[d] += w * load_f64(cache.data(), c.cache, row + d) * k_scale;
      }
      for (int d = 0; d < kL; ++d) ref_o[(static_cast<size_t>(i) * h + hh) * kL + d] = s > 0 ? o[d] / sum : 0.0;
      ref_lse[static_cast<size_t>(hh) * b + i] = s > 0 ? mx + std::log(sum) : -INFINITY;
    }
  }

  int tokens = 1;  // the plan's tokens_per_request: the largest q
  for (const int32_t q_len : c.query_lens) tokens = std::max<int>(tokens, q_len);
  const md::DecodeKernel kernel = md::resolve_decode_kernel(tokens * h, c.cache);
  const md::Plan plan = md::make_plan(c.seq_lens, c.query_lens.empty() ? std::vector<int32_t>{} : qsl, c.parts, kernel);
  ASSERT_LE(plan.num_parts, c.parts);
  ASSERT_EQ(plan.tokens_per_request, tokens);
  const int rows = plan.tokens_per_request * h;  // rows of a request
  const Tensor q_d = to_dev(q), cache_d = to_dev(cache);
  const Tensor bt_d = i32_tensor(req_bt, Device::cuda, Shape{nr, cols});
  const Tensor part_d = i32_tensor(plan.part_begin, Device::cuda);
  Tensor seg_h(Shape{static_cast<int64_t>(plan.segments.size()) * 4}, DType::i32, Device::cpu);
  std::memcpy(seg_h.data(), plan.segments.data(), plan.segments.size() * sizeof(md::Segment));
  const Tensor seg_d = to_dev(seg_h);
  static_assert(sizeof(md::DecodeRequest) == 5 * sizeof(int32_t));
  Tensor req_h(Shape{static_cast<int64_t>(nr) * 5}, DType::i32, Device::cpu);
  std::memcpy(req_h.data(), plan.requests.data(), plan.requests.size() * sizeof(md::DecodeRequest));
  const Tensor req_d = to_dev(req_h);
  const int64_t slots = std::max(1, plan.num_partial_slots);
  Tensor partial_o(Shape{slots, rows, kL}, DType::f32, Device::cuda), partial_l(Shape{slots, rows}, DType::f32, Device::cuda);
  Tensor out(Shape{b, h, kL}, c.act, Device::cuda), lse(Shape{h, b}, DType::f32, Device::cuda);
  out.fill_bytes(0xff);
  lse.fill_bytes(0xff);
  partial_o.fill_bytes(0xff);

  md::DecodeParams p{};
  p.q = q_d.data();
  p.q_token_stride = h * (kL + kR);
  p.q_head_stride = kL + kR;
  p.cache = cache_d.data();
  p.block_stride = static_cast<int64_t>(c.block_size) * (kL + kR);
  p.token_stride = kL + kR;
  p.num_blocks = blocks;
  p.block_table = bt_d.data_as<const int32_t>();
  p.bt_stride = cols;
  p.block_size = c.block_size;
  p.num_heads = h;
  p.out = out.data();
  p.o_token_stride = static_cast<int64_t>(h) * kL;
  p.o_head_stride = kL;
  p.lse = lse.data_as<float>();
  p.lse_head_stride = b;
  p.lse_token_stride = 1;
  p.segments = reinterpret_cast<const md::Segment*>(seg_d.data());
  p.part_begin = part_d.data_as<const int32_t>();
  p.requests = reinterpret_cast<const md::DecodeRequest*>(req_d.data());
  p.partial_out = partial_o.data_as<float>();
  p.partial_lse = partial_l.data_as<float>();
  p.num_requests = nr;
  p.tokens_per_request = plan.tokens_per_request;
  p.scale_log2 = scale * k_scale * 1.4426950408889634f;
  p.out_scale = k_scale;
  SCOPED_TRACE(detail::concat("kernel ", static_cast<int>(kernel), ", ", rows, " rows a request"));
  md::launch_decode(p, c.act, c.cache, kernel, plan.num_parts, md::plan_combine(plan), current_cuda_stream());
  const Tensor got = to_host(out), got_lse = to_host(lse);
  ASSERT_TRUE(all_finite(got)) << "an output element was not written";
  double d2 = 0, r2 = 0, lse_err = 0;
  for (size_t i = 0; i < ref_o.size(); ++i) {
    const double x = load_f64(got.data(), c.act, static_cast<int64_t>(i));
    d2 += (x - ref_o[i]) * (x - ref_o[i]);
    r2 += ref_o[i] * ref_o[i];
  }
  for (size_t i = 0; i < ref_lse.size(); ++i) {
    const double x = got_lse.data_as<float>()[i];
    lse_err = std::max(lse_err, std::isinf(ref_lse[i]) ? (x == ref_lse[i] ? 0.0 : INFINITY) : std::abs(x - ref_lse[i]));
  }
  const double tol = fp8 ? 2e-2 : c.act == DType::f16 ? 2e-3 : 8e-3;  // fp8 inputs exact: only P rounding
  EXPECT_LT(std::sqrt(d2 / r2), tol);
  EXPECT_LT(lse_err, 1e-3);
}

TEST(CudaMlaDecode, KernelMatchesOracle) {
  PAGEDATTN_REQUIRE_GPU();
  const std::vector<int32_t> mixed = {1, 63, 64, 65, 777, 2100};
  std::vector<DecodeCase> cases = {
      {16, DType::bf16, DType::bf16, 64, 132, mixed},
      {16, DType::bf16, DType::bf16, 64, 5, mixed},        // long splits + uncut requests
      {16, DType::bf16, DType::fp8_e4m3, 16, 7, mixed},
      {16, DType::f16, DType::f16, 32, 1, {300, 17}},      // one part: no split
      {20, DType::bf16, DType::bf16, 64, 9, {500, 90}},    // heads not a multiple of 16
      {128, DType::bf16, DType::bf16, 64, 66, {1, 700, 1300}},
      {128, DType::bf16, DType::fp8_e5m2, 64, 3, {400, 129}},
      {72, DType::f16, DType::fp8_e4m3, 48, 11, {250, 3}},  // 64-row tiles, last one partial
      // More than 16 rows: the wgmma kernel on sm_90a (mla_decode_wgmma.cu; fp8 caches through its
      // converted tile).
      {128, DType::bf16, DType::bf16, 16, 1, {300, 17, 64, 0}},  // one part: unsplit, 4 segments a CTA
      {128, DType::f16, DType::f16, 64, 9, {1000, 129, 1}},      // split
      {128, DType::bf16, DType::bf16, 16, 132, {2100, 65, 333}},
      {64, DType::f16, DType::f16, 64, 5, {777, 64}},
      {96, DType::bf16, DType::bf16, 16, 7, {450, 31}},           // second head tile half empty
      // make_plan's whole-request partition (longest first to the least loaded part): parts of
      // non-adjacent requests ({0, 1}, {4, 5}, {2, 6}, {3, 7}); and an e5m2 cache with cut requests.
      {128, DType::bf16, DType::bf16, 64, 4, {700, 100, 650, 640, 90, 660, 80, 600}},
      {128, DType::bf16, DType::fp8_e5m2, 64, 66, {400, 129, 1300}},
      // Speculative decodes: a request's q tokens are its rows (t * H + h), each with its own
      // causal end; unequal q leaves rows of the shorter requests idle.
      {16, DType::bf16, DType::bf16, 64, 132, {777, 2100, 65}, {2, 2, 2}},     // 32 rows: wgmma (sm_90a)
      {16, DType::bf16, DType::fp8_e4m3, 64, 132, {777, 2100, 65}, {2, 1, 2}},  // 32 rows: 16-row kernel, 2 tiles
      {16, DType::bf16, DType::bf16, 16, 5, {777, 4, 2100, 130}, {4, 4, 1, 3}},  // 64 rows: wgmma (sm_90a)
      {16, DType::f16, DType::f16, 64, 1, {300, 70}, {3, 3}},                 // 48 rows, one part
      {16, DType::bf16, DType::fp8_e4m3, 16, 9, {900, 65, 8}, {8, 2, 8}},     // 128 rows, fp8: 2 wgmma tiles
      {16, DType::bf16, DType::bf16, 64, 132, {1000, 2100}, {8, 5}},          // 128 rows: 2 wgmma tiles
      {128, DType::bf16, DType::bf16, 16, 11, {500, 129, 64}, {2, 4, 3}},     // 512 rows: 8 tiles
      {128, DType::f16, DType::fp8_e5m2, 64, 3, {300, 90}, {2, 1}},
      {20, DType::bf16, DType::bf16, 64, 7, {200, 70}, {3, 2}},               // rows cross tile edges
  };
  if (small_grid()) {
    cases = {{16, DType::bf16, DType::bf16, 64, 5, {65, 130}}, {128, DType::bf16, DType::fp8_e4m3, 16, 3, {70}},
             {128, DType::bf16, DType::bf16, 16, 3, {70, 130}},
             {16, DType::bf16, DType::bf16, 16, 5, {200, 70}, {4, 2}}, {16, DType::bf16, DType::bf16, 64, 3, {130}, {2}}};
  }
  uint64_t seed = 100;
  for (const DecodeCase& c : cases) run_decode_case(c, seed += 10);
}

// More than 16 rows a request run the wgmma kernel on Hopper, 16-bit and fp8 caches alike (so the
// oracle cases above cover it); everything else stays on the mma.sync kernel. The choice is the
// builder's, made once and stored in each plan; mla=mma (PAGEDATTN_CUDA_KERNEL) switches it off.
TEST(CudaMlaDecode, WgmmaKernelCoversHopperHeads) {
  PAGEDATTN_REQUIRE_GPU();
  int device = 0, major = 0, minor = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (major != 9 || minor != 0) GTEST_SKIP() << "the wgmma kernel needs compute capability 9.0";
  ASSERT_TRUE(md::wgmma_decode_available()) << "the sm_90a image is not the one the device runs";
  const md::DecodeKernel expected128 =
      cuda::kernel_override().mla == cuda::MlaDecodeKernelChoice::mma ? md::DecodeKernel::mma_64_rows
                                                                      : md::DecodeKernel::wgmma;
  EXPECT_EQ(md::resolve_decode_kernel(128, DType::bf16), expected128);
  EXPECT_EQ(md::resolve_decode_kernel(16, DType::bf16), md::DecodeKernel::mma_16_rows);
  EXPECT_EQ(md::resolve_decode_kernel(128, DType::fp8_e4m3), expected128);
  EXPECT_EQ(md::resolve_decode_kernel(16, DType::fp8_e4m3), md::DecodeKernel::mma_16_rows);
  cuda::set_kernel_override(cuda::parse_kernel_override("mla=mma"));
  EXPECT_EQ(md::resolve_decode_kernel(128, DType::bf16), md::DecodeKernel::mma_64_rows);
  EXPECT_EQ(md::resolve_decode_kernel(128, DType::fp8_e5m2), md::DecodeKernel::mma_64_rows);
  cuda::set_kernel_override(cuda::parse_kernel_override("mla=auto"));
  EXPECT_EQ(md::resolve_decode_kernel(64, DType::f16), md::DecodeKernel::wgmma);
  cuda::set_kernel_override(std::nullopt);
  // A 16-bit cache of another dtype than the activations is an Error, not a conversion.
  md::DecodeParams p{};
  p.num_requests = 1;
  p.num_heads = 128;
  EXPECT_THROW(md::launch_decode(p, DType::bf16, DType::f16, md::DecodeKernel::wgmma, 1, md::Combine::none,
                                 current_cuda_stream()),
               Error);
}

TEST(CudaMlaDecode, PlanBalancesParts) {
  // Pure host: every key of every request lands in exactly one segment, parts <= requested.
  for (const int parts : {1, 3, 66, 132}) {
    const std::vector<int32_t> seqs = {0, 1, 4096, 64, 65, 9000, 3};
    const md::Plan plan = md::make_plan(seqs, {}, parts, md::DecodeKernel::wgmma);
    ASSERT_LE(plan.num_parts, parts);
    ASSERT_EQ(plan.part_begin.size(), static_cast<size_t>(plan.num_parts) + 1);
    ASSERT_LE(plan.segments.size(), static_cast<size_t>(md::max_segments(7, parts)));
    ASSERT_LE(plan.num_partial_slots, md::max_partial_slots(parts));
    std::vector<int64_t> covered(seqs.size(), 0);
    std::vector<int> next(seqs.size(), 0), count(seqs.size(), 0);
    for (const md::Segment& s : plan.segments) {
      EXPECT_EQ(s.kv_start, next[s.request]);
      EXPECT_EQ(s.kv_start % md::kKeysPerTile, 0);
      next[s.request] = s.kv_end;
      covered[s.request] += s.kv_end - s.kv_start;
      ++count[s.request];
    }
    // Balanced: no part holds more than about twice the mean work (tiles + 2 per segment).
    int64_t total = 0, worst = 0;
    for (int pi = 0; pi < plan.num_parts; ++pi) {
      int64_t cost = 0;
      for (int si = plan.part_begin[pi]; si < plan.part_begin[pi + 1]; ++si) {
        const md::Segment& s = plan.segments[si];
        cost += (s.kv_end - s.kv_start + md::kKeysPerTile - 1) / md::kKeysPerTile + 2;
      }
      total += cost;
      worst = std::max(worst, cost);
    }
    EXPECT_LE(worst, 2 * total / parts + 4) << parts << " parts";
    int most_splits = 1;
    for (size_t r = 0; r < seqs.size(); ++r) {
      EXPECT_EQ(covered[r], seqs[r]);
      EXPECT_EQ(plan.requests[r].num_splits, std::max(1, count[r]));
      EXPECT_GE(count[r], 1);
      most_splits = std::max(most_splits, count[r]);
    }
    // The combine's grid: none without a split, a CTA a row once a request has more than
    // kNarrowSplits segments (132 parts here: the 9000-key request spread over most of them).
    const md::Combine expected = most_splits == 1                   ? md::Combine::none
                                 : most_splits > md::kNarrowSplits ? md::Combine::wide
                                                                    : md::Combine::narrow;
    EXPECT_EQ(md::plan_combine(plan), expected) << parts << " parts";
    if (parts == 132) EXPECT_EQ(md::plan_combine(plan), md::Combine::wide);
    if (parts == 1) EXPECT_EQ(md::plan_combine(plan), md::Combine::none);
  }
}

// Pure host: make_plan keeps the cheaper of its two partitions under plan_cost. Many equal
// requests that fill every part stay whole (128 x 4k over 66 parts: 132 tiles a part against the
// balanced 130 plus its cut requests' slots); fewer requests than parts, or one long request, are
// cut; what a cut costs grows with a CTA's rows (a 64-row slot prices 3.6 tiles, a 16-row one 0.9).
TEST(CudaMlaDecode, PlanKeepsRequestsWholeWhereCutsOnlyEvenTheTail) {
  const auto cuts = [](const md::Plan& plan) {
    int n = 0;
    for (const md::DecodeRequest& r : plan.requests) n += r.num_splits > 1;
    return n;
  };
  const auto covered_once = [](const md::Plan& plan, const std::vector<int32_t>& seqs) {
    std::vector<int64_t> covered(seqs.size(), 0);
    for (const md::Segment& s : plan.segments) covered[s.request] += s.kv_end - s.kv_start;
    for (size_t r = 0; r < seqs.size(); ++r) {
      if (covered[r] != seqs[r]) return false;
    }
    return static_cast<int>(plan.part_begin.size()) == plan.num_parts + 1 && plan.part_begin.back() ==
                                                                                static_cast<int32_t>(plan.segments.size());
  };
  const std::vector<int32_t> b128(128, 4096), b96(96, 4096), b32(32, 4096), b1(1, 4096);
  const md::Plan whole = md::make_plan(b128, {}, 66, md::DecodeKernel::wgmma);
  EXPECT_TRUE(covered_once(whole, b128));
  EXPECT_FALSE(whole.any_split);
  EXPECT_EQ(whole.num_parts, 66);
  EXPECT_EQ(whole.segments.size(), 128u);
  EXPECT_EQ(md::plan_combine(whole), md::Combine::none);
  EXPECT_DOUBLE_EQ(md::plan_cost(whole, md::DecodeKernel::wgmma), 2 * (64 + 2));
  for (const auto* seqs : {&b96, &b32, &b1}) {
    const md::Plan cut = md::make_plan(*seqs, {}, 66, md::DecodeKernel::wgmma);
    EXPECT_TRUE(covered_once(cut, *seqs));
    EXPECT_GT(cuts(cut), 0) << seqs->size() << " requests";
    EXPECT_LT(md::plan_cost(cut, md::DecodeKernel::wgmma), 2 * (64 + 2)) << seqs->size() << " requests";
  }
  // A 16-row slot is cheaper: 126 x 4k over 66 parts stay whole for 64-row CTAs (132 tiles against
  // the balanced 128 plus 120 slots of 3.6 tiles over 66 parts) and are cut for 16-row ones.
  const std::vector<int32_t> b126(126, 4096);
  EXPECT_EQ(cuts(md::make_plan(b126, {}, 66, md::DecodeKernel::wgmma)), 0);
  EXPECT_GT(cuts(md::make_plan(b126, {}, 66, md::DecodeKernel::mma_16_rows)), 0);
  // Mixed lengths: whole requests longest first, each to the least loaded part (8 x 4k two a
  // part, then the 128- and 64-key requests on two of them).
  const std::vector<int32_t> mixed = {4096, 64, 4096, 4096, 128, 4096, 4096, 4096, 4096, 4096};
  const md::Plan m = md::make_plan(mixed, {}, 4, md::DecodeKernel::wgmma);
  EXPECT_TRUE(covered_once(m, mixed));
  EXPECT_FALSE(m.any_split);
  EXPECT_DOUBLE_EQ(md::plan_cost(m, md::DecodeKernel::wgmma), 2 * (64 + 2) + 2 + 2);
}

// Pure host: a speculative decode is one request of the plan (its tokens are the kernel's rows):
// the plan's requests carry each one's tokens and keys, tokens_per_request is the largest q, every
// key of a request lies in exactly one segment, and bad query_start_loc is an Error naming it.
TEST(CudaMlaDecode, PlanTakesSpeculativeDecodesAsRequests) {
  const std::vector<int32_t> seqs = {5000, 70, 4100};
  const std::vector<int32_t> qsl = {0, 1, 4, 6};  // 1, 3 and 2 tokens
  for (const int parts : {1, 4, 132}) {
    for (const bool fixed : {false, true}) {
      const md::Plan plan = fixed ? md::make_fixed_plan(seqs, qsl, md::kBatchInvariantSplitTiles, parts)
                                  : md::make_plan(seqs, qsl, parts, md::DecodeKernel::wgmma);
      ASSERT_LE(plan.num_parts, parts);
      EXPECT_EQ(plan.tokens_per_request, 3);
      ASSERT_EQ(plan.requests.size(), seqs.size());
      std::vector<int64_t> covered(seqs.size(), 0);
      std::vector<int> count(seqs.size(), 0);
      for (const md::Segment& seg : plan.segments) {
        covered[seg.request] += seg.kv_end - seg.kv_start;
        ++count[seg.request];
      }
      for (size_t r = 0; r < seqs.size(); ++r) {
        const md::DecodeRequest& req = plan.requests[r];
        EXPECT_EQ(req.first_token, qsl[r]);
        EXPECT_EQ(req.num_tokens, qsl[r + 1] - qsl[r]);
        EXPECT_EQ(req.seq_len, seqs[r]);
        EXPECT_EQ(covered[r], seqs[r]) << "request " << r << ", " << parts << " parts, fixed " << fixed;
        EXPECT_EQ(req.num_splits, std::max(1, count[r]));
      }
    }
  }
  const auto plan_error = [&](const std::vector<int32_t>& bad) {
    try {
      (void)md::make_plan(seqs, bad, 4, md::DecodeKernel::wgmma);
    } catch (const Error& e) {
      return std::string(e.argument());
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(plan_error({0, 1, 4}), "query_start_loc");     // one entry short
  EXPECT_EQ(plan_error({0, 1, 1, 6}), "query_start_loc");  // a request of 0 tokens
  EXPECT_EQ(plan_error({1, 2, 4, 6}), "query_start_loc");  // not from 0
}

// ---- prefill backend -------------------------------------------------------------------------

TEST(CudaMlaPrefill, MatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  for (const int heads : small_grid() ? std::vector<int>{16} : std::vector<int>{16, 128}) {
    for (const DType dtype : {DType::bf16, DType::f16}) {
      if (heads == 128 && dtype == DType::f16) continue;
      SCOPED_TRACE(detail::concat("H=", heads, " ", dtype_name(dtype)));
      const std::vector<int32_t> q_lens = heads == 128 ? std::vector<int32_t>{40, 2, 70} : std::vector<int32_t>{70, 2, 133};
      const std::vector<int32_t> ctx = heads == 128 ? std::vector<int32_t>{30, 0, 65} : std::vector<int32_t>{50, 0, 200};
      const int np = static_cast<int>(q_lens.size());
      MLAPrefillMetadata pm_h;
      pm_h.num_prefills = np;
      pm_h.query_start_loc = {0};
      std::vector<int32_t> cu = {0};
      for (int i = 0; i < np; ++i) {
        pm_h.query_start_loc.push_back(pm_h.query_start_loc.back() + q_lens[i]);
        cu.push_back(cu.back() + ctx[i]);
        pm_h.seq_lens.push_back(q_lens[i] + ctx[i]);
        pm_h.context_lens.push_back(ctx[i]);
      }
      pm_h.num_prefill_tokens = pm_h.query_start_loc.back();
      pm_h.max_query_len = *std::max_element(q_lens.begin(), q_lens.end());
      MLAChunkedContextMetadata cc;
      cc.num_chunks = 1;
      cc.cu_seq_lens = cu;
      cc.chunk_total_tokens = {cu.back()};
      cc.chunk_seq_lens = ctx;
      cc.chunk_starts.assign(np, 0);
      cc.max_seq_lens = {*std::max_element(ctx.begin(), ctx.end())};
      pm_h.chunked_context = cc;
      const Tensor qsl_h = i32_tensor(pm_h.query_start_loc, Device::cpu), cu_h = i32_tensor(cu, Device::cpu, Shape{1, np + 1});
      pm_h.query_start_loc_device = qsl_h;
      pm_h.chunked_context->cu_seq_lens_device = cu_h;
      MLAPrefillMetadata pm_d = pm_h;
      const Tensor qsl_d = to_dev(qsl_h), cu_d = to_dev(cu_h);
      pm_d.query_start_loc_device = qsl_d;
      pm_d.chunked_context->cu_seq_lens_device = cu_d;

      MLAPrefillParams params;
      params.num_heads = heads;
      params.scale = 0.11f;
      params.kv_lora_rank = kL;
      params.qk_nope_head_dim = kP;
      params.qk_rope_head_dim = kR;
      params.v_head_dim = kV;
      params.dtype = dtype;
      params.device = Device::cpu;
      auto ref = reference_mla_prefill_backend().create(params);
      params.device = Device::cuda;
      auto dev = cuda_mla_prefill_backend().create(params);
      ref->prepare_metadata(pm_h);
      dev->prepare_metadata(pm_d);

      const int64_t tp = pm_h.num_prefill_tokens, tc = cu.back();
      for (const bool context : {false, true}) {
        SCOPED_TRACE(context ? "context chunk" : "new tokens");
        const int64_t tk = context ? tc : tp;
        const Tensor q = random_host(Shape{tp, heads, kP + kR}, dtype, 51 + context);
        const Tensor k = random_host(Shape{tk, heads, kP + kR}, dtype, 53 + context);
        const Tensor kv = random_host(Shape{tk, heads, kP + kV}, dtype, 55 + context);  // v = [:, :, P:]
        const TensorView v = kv.view().narrow(2, kP, kV);
        Tensor out_h(Shape{tp, heads, kV}, dtype, Device::cpu), lse_h(Shape{heads, tp}, DType::f32, Device::cpu);
        const Tensor q_d = to_dev(q), k_d = to_dev(k), kv_d = to_dev(kv);
        const TensorView v_d = kv_d.view().narrow(2, kP, kV);
        Tensor out_d(Shape{tp, heads, kV}, dtype, Device::cuda), lse_d(Shape{heads, tp}, DType::f32, Device::cuda);
        out_d.fill_bytes(0xff);
        lse_d.fill_bytes(0xff);
        if (context) {
          ref->run_prefill_context_chunk(0, q, k, v, out_h, lse_h);
          dev->run_prefill_context_chunk(0, q_d, k_d, v_d, out_d, lse_d);
        } else {
          ref->run_prefill_new_tokens(q, k, v, true, out_h, lse_h);
          dev->run_prefill_new_tokens(q_d, k_d, v_d, true, out_d, lse_d);
        }
        const Tensor got = to_host(out_d), got_lse = to_host(lse_d);
        ASSERT_TRUE(all_finite(got));
        EXPECT_LT(rel_error(got, out_h), dtype == DType::f16 ? 2e-3 : 8e-3);
        double lse_err = 0;
        for (int64_t i = 0; i < got_lse.numel(); ++i) {
          const double a = got_lse.data_as<float>()[i], r = lse_h.data_as<float>()[i];
          lse_err = std::max(lse_err, std::isinf(r) ? (a == r ? 0.0 : INFINITY) : std::abs(a - r));
        }
        EXPECT_LT(lse_err, 1e-3);  // the empty context of prefill 1: -inf on both
      }
    }
  }
}

// ---- the layer vs REFERENCE_MLA --------------------------------------------------------------

struct LayerCase {
  const char* name;
  int heads = 16;
  const char* kv_cache_dtype = "auto";
  int block_size = 64;
  std::vector<std::pair<int, int>> requests;  // (query_len, context_len), decodes first
  int64_t workspace_tokens = 0;               // 0 = vLLM's rule; small = many context chunks
  bool with_lse = false;
};

void run_layer_case(const LayerCase& c, uint64_t seed) {
  SCOPED_TRACE(detail::concat(c.name, " H=", c.heads, " kv=", c.kv_cache_dtype, " bs=", c.block_size));
  const DType dtype = DType::bf16;
  const int nreq = static_cast<int>(c.requests.size());
  int max_seq = 0, total = 0;
  for (const auto& [q, ctx] : c.requests) {
    max_seq = std::max(max_seq, q + ctx);
    total += q;
  }
  const int cols = (max_seq + c.block_size - 1) / c.block_size;
  const int blocks = nreq * cols + 2;
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0};
  args.max_num_blocks_per_req = cols;
  std::vector<int32_t> perm(static_cast<size_t>(blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(static_cast<uint32_t>(seed)));
  std::vector<int64_t> ctx_slots;
  for (int r = 0; r < nreq; ++r) {
    const auto [q, ctx] = c.requests[r];
    args.query_start_loc.push_back(args.query_start_loc.back() + q);
    args.seq_lens.push_back(q + ctx);
    for (int j = 0; j < cols; ++j) args.block_table.push_back(perm[r * cols + j]);
    for (int pos = 0; pos < q + ctx; ++pos) {
      const int64_t slot = static_cast<int64_t>(perm[r * cols + pos / c.block_size]) * c.block_size + pos % c.block_size;
      (pos < ctx ? ctx_slots : args.slot_mapping).push_back(slot);
    }
  }

  MLAAttention ref(gpu_test::deepseek_mla_params(c.heads, c.kv_cache_dtype, c.block_size, "REFERENCE_MLA", Device::cpu));
  MLAAttention dev(gpu_test::deepseek_mla_params(c.heads, c.kv_cache_dtype, c.block_size, "CUDA_MLA", Device::cuda));
  ASSERT_EQ(dev.impl().prefill_backend_name(), "CUDA");
  const bool fp8 = std::string(c.kv_cache_dtype) != "auto";
  for (MLAAttention* layer : {&ref, &dev}) layer->scales().k_scale = fp8 ? 0.05f : 1.f;

  const Tensor w = random_host(Shape{static_cast<int64_t>(c.heads) * (kP + kV), kL}, dtype, seed + 1, -0.08f, 0.08f);
  ref.process_weights_after_loading(w);
  dev.process_weights_after_loading(to_dev(w));
  const Tensor q = random_host(Shape{total, c.heads, kP + kR}, dtype, seed + 2);
  const Tensor kv_c = random_host(Shape{total, kL}, dtype, seed + 3);
  const Tensor k_pe = random_host(Shape{total, kR}, dtype, seed + 4);

  // The context already in the cache: written by the host op, copied to the device cache.
  Tensor cache_h = ref.allocate_kv_cache(blocks);
  cache_h.fill_bytes(0);
  if (!ctx_slots.empty()) {
    const int64_t n = static_cast<int64_t>(ctx_slots.size());
    const Tensor ctx_c = random_host(Shape{n, kL}, dtype, seed + 5), ctx_pe = random_host(Shape{n, kR}, dtype, seed + 6);
    concat_and_cache_mla(ctx_c, ctx_pe, cache_h, i64_tensor(ctx_slots, Device::cpu), c.kv_cache_dtype, ref.scales().k_scale);
  }
  Tensor cache_d = dev.allocate_kv_cache(blocks);
  cache_d.copy_from(cache_h);

  // max_num_seqs = the batch: a small chunked-prefill workspace (>= max_num_seqs * block_size)
  // then splits the context into several chunks.
  const int max_seqs = nreq, max_tokens = total + 8, max_len = max_seq + 64;
  auto ref_builder = ref.backend().make_builder(ref.kv_cache_spec(),
                                                ref.builder_config(max_seqs, max_tokens, max_len, c.workspace_tokens), Device::cpu);
  auto dev_builder = dev.backend().make_builder(dev.kv_cache_spec(),
                                                dev.builder_config(max_seqs, max_tokens, max_len, c.workspace_tokens), Device::cuda);
  const OwnedCommonAttentionMetadata common_h = make_common_attention_metadata(args, Device::cpu, blocks, c.block_size);
  const OwnedCommonAttentionMetadata common_d = make_common_attention_metadata(args, Device::cuda, blocks, c.block_size);
  const auto md_h = ref_builder->build(0, common_h.common);
  const auto md_d = dev_builder->build(0, common_d.common);
  if (c.workspace_tokens > 0) {
    const auto* m = dynamic_cast<const MLAMetadata*>(md_d.get());
    ASSERT_NE(m, nullptr);
    ASSERT_TRUE(m->prefill.has_value() && m->prefill->chunked_context.has_value());
    EXPECT_GE(m->prefill->chunked_context->num_chunks, 2) << "the case should exercise several chunks";
  }

  Tensor out_h(Shape{total, c.heads, kV}, dtype, Device::cpu), lse_h(Shape{c.heads, total}, DType::f32, Device::cpu);
  Tensor out_d(Shape{total, c.heads, kV}, dtype, Device::cuda), lse_d(Shape{c.heads, total}, DType::f32, Device::cuda);
  out_d.fill_bytes(0xff);
  lse_d.fill_bytes(0xff);
  ref.forward(q, kv_c, k_pe, cache_h, *md_h, out_h, c.with_lse ? lse_h.view() : TensorView{});
  dev.forward(to_dev(q), to_dev(kv_c), to_dev(k_pe), cache_d, *md_d, out_d, c.with_lse ? lse_d.view() : TensorView{});
  const Tensor got = to_host(out_d);
  ASSERT_TRUE(all_finite(got)) << "an output element was not written";
  EXPECT_LT(rel_error(got, out_h), fp8 ? 6e-2 : 8e-3);
  if (c.with_lse) {
    const Tensor got_lse = to_host(lse_d);
    double err = 0;
    for (int64_t i = 0; i < got_lse.numel(); ++i)
      err = std::max(err, std::abs(double(got_lse.data_as<float>()[i]) - lse_h.data_as<float>()[i]));
    EXPECT_LT(err, fp8 ? 5e-2 : 2e-2);
  }
  // The cache the step wrote (the new tokens) equals the host op's bytes.
  EXPECT_TRUE(bytes_equal(to_host(cache_d), cache_h));
}

TEST(CudaMlaLayer, MatchesReferenceMla) {
  PAGEDATTN_REQUIRE_GPU();
  std::vector<LayerCase> cases = {
      {"decode only", 16, "auto", 64, {{1, 40}, {1, 300}, {1, 7}}},
      {"new tokens only", 16, "auto", 64, {{37, 0}, {90, 0}}},
      {"new + 1 context chunk", 16, "auto", 64, {{20, 100}, {33, 0}}, 0, true},
      {"new + 2 context chunks", 16, "auto", 16, {{12, 24}, {9, 20}}, 32},
      {"new + many context chunks", 16, "auto", 16, {{8, 150}, {5, 60}}, 32},
      {"mixed", 16, "auto", 32, {{1, 90}, {1, 33}, {17, 70}, {24, 0}}, 0, true},
      {"mixed fp8", 16, "fp8_e4m3", 64, {{1, 120}, {1, 64}, {15, 50}}},
      {"decode 128 heads", 128, "auto", 64, {{1, 30}, {1, 20}}},
      {"mixed 128 heads fp8", 128, "fp8", 16, {{1, 20}, {6, 40}}, 32},
  };
  if (small_grid()) cases = {cases[0], cases[4], cases[6]};
  uint64_t seed = 900;
  for (const LayerCase& c : cases) run_layer_case(c, seed += 10);
}

// The shared MLA conformance harness (tests/conformance/mla_harness.h): its grid's cases that
// CUDA_MLA supports (DeepSeek latent dims, 16-bit activations) plus fp8, 128-head and 128-head
// speculative-decode cases.
TEST(CudaMlaLayer, ConformanceHarness) {
  PAGEDATTN_REQUIRE_GPU();
  namespace cm = conformance::mla;
  std::vector<cm::MLACase> grid;
  for (const cm::MLACase& c : cm::mla_grid()) {
    if (c.dims == MLADimensions{kL, kP, kR, kV} && c.dtype != DType::f32) grid.push_back(c);
  }
  cm::MLACase extra;
  extra.dtype = DType::bf16;
  extra.dims = {kL, kP, kR, kV};
  extra.block_size = 64;
  extra.name = "cuda-mla-fp8";
  extra.kv_cache_dtype = "fp8_e4m3";
  extra.num_heads = 16;
  extra.batch = {{200, 1}, {64, 1}, {30, 12}};
  grid.push_back(extra);
  if (!small_grid()) {
    extra.name = "cuda-mla-h128";
    extra.kv_cache_dtype = "auto";
    extra.num_heads = 128;
    extra.block_size = 16;
    extra.workspace_tokens = 32;
    extra.batch = {{24, 1}, {20, 4}};
    grid.push_back(extra);
  }
  // Speculative decodes at 128 heads (the wgmma decode kernel; the grid's spec-deepseek case runs
  // the 16-head mma.sync kernel): decodes of 4, 2 and 3 tokens, then a prefill.
  extra.name = "cuda-mla-spec-h128";
  extra.kv_cache_dtype = "auto";
  extra.num_heads = 128;
  extra.block_size = 16;
  extra.workspace_tokens = 64;
  extra.num_speculative_tokens = 3;
  extra.batch = {{40, 4}, {9, 2}, {70, 3}, {20, 5}};
  grid.push_back(extra);
  for (const cm::MLAResult& r : cm::run_mla_grid(cuda_mla_backend(), "", Device::cuda, grid, 77)) {
    EXPECT_TRUE(r.passed()) << r.describe();
  }
}

// Padding requests (query_len 0) anywhere in the batch are no-ops: the same output and LSE bytes
// as the batch without them (tests/conformance/mla_padding.h; the block-table rows of each part
// gathered on the device), at 16 heads (the mma.sync decode kernel) and 128 (wgmma).
TEST(CudaMlaLayer, PaddingRequestsAreNoOps) {
  PAGEDATTN_REQUIRE_GPU();
  namespace mp = conformance::mla_padding;
  const auto batches = mp::padded_batches();
  for (int heads : {16, 128}) {
    for (size_t b = 0; b < batches.size(); ++b) {
      const mp::Outputs padded =
          mp::run_step("CUDA_MLA", Device::cuda, DType::bf16, batches[b], false, 300 + b, {kL, kP, kR, kV}, heads);
      const mp::Outputs plain =
          mp::run_step("CUDA_MLA", Device::cuda, DType::bf16, batches[b], true, 300 + b, {kL, kP, kR, kV}, heads);
      EXPECT_EQ(padded.num_decodes, plain.num_decodes) << heads << " heads, batch " << b;
      EXPECT_EQ(padded.num_prefills, plain.num_prefills) << heads << " heads, batch " << b;
      EXPECT_EQ(padded.output, plain.output) << heads << " heads, batch " << b;
      EXPECT_EQ(padded.lse, plain.lse) << heads << " heads, batch " << b;
    }
  }
}

TEST(CudaMlaLayer, SelectorAndErrors) {
  PAGEDATTN_REQUIRE_GPU();
  const AttentionBackend* b = find_backend("CUDA_MLA");
  ASSERT_NE(b, nullptr);
  SelectorConfig sc;
  sc.use_mla = true;
  sc.head_size = 576;
  sc.mla_dimensions = {kL, kP, kR, kV};
  sc.dtype = DType::bf16;
  sc.block_size = 64;
  sc.device = Device::cuda;
  EXPECT_TRUE(b->validate_configuration(sc).empty());
  sc.mla_dimensions = {256, 64, 32, 64};
  sc.head_size = 288;
  EXPECT_FALSE(b->validate_configuration(sc).empty());
  sc.use_mla = false;
  EXPECT_FALSE(b->validate_configuration(sc).empty());
  // A bad argument is an Error naming it, before any launch.
  MLAPrefillParams params;
  params.num_heads = 16;
  params.scale = 0.1f;
  params.kv_lora_rank = kL;
  params.qk_nope_head_dim = kP;
  params.qk_rope_head_dim = kR;
  params.v_head_dim = kV;
  params.device = Device::cuda;
  auto prefill = cuda_mla_prefill_backend().create(params);
  Tensor x(Shape{4, 16, kP + kR}, DType::bf16, Device::cuda), o(Shape{4, 16, kV}, DType::bf16, Device::cuda);
  try {
    prefill->run_prefill_new_tokens(x, x, o, false, o);
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "metadata");
  }
  MLAPrefillMetadata pm;
  pm.num_prefills = 1;
  pm.num_prefill_tokens = 4;
  pm.max_query_len = 4;
  pm.query_start_loc = {0, 4};
  const Tensor qsl = i32_tensor(pm.query_start_loc, Device::cuda);
  pm.query_start_loc_device = qsl;
  prefill->prepare_metadata(pm);
  Tensor q32(Shape{4, 16, kP + kR}, DType::f32, Device::cuda);
  try {
    prefill->run_prefill_new_tokens(q32, x, o, false, o);
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "q");
  }
  MLAAttentionLayerParams lp;
  lp.num_heads = 16;
  lp.kv_lora_rank = kL;
  lp.qk_nope_head_dim = kP;
  lp.qk_rope_head_dim = kR;
  lp.qk_head_dim = kP + kR;
  lp.v_head_dim = kV;
  lp.device = Device::cuda;
  MLAAttention layer(lp);  // selected, not forced
  EXPECT_EQ(layer.backend().name(), "CUDA_MLA");
  EXPECT_EQ(layer.impl().prefill_backend_name(), "CUDA");
}

}  // namespace
}  // namespace pagedattn
