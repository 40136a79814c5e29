// MLA device primitives on the GPU (src/ops/cuda_ops.h, src/backends/mla/mla_common.h):
//
//   detail::cuda_concat_and_cache_mla        kv_c (N, L) ++ k_pe (N, R) -> latent cache rows
//   detail::cuda_gather_and_maybe_dequant_cache  cache rows of a request's positions -> dst rows
//   mla::cuda_batched_gemm                   C[b] = A[b] . B[b] through cuBLAS (f32 compute)
//   mla::cuda_copy_3d                        strided / broadcast / dtype-converting 3-D copy
//   mla::cuda_quantize_e4m3_3d               the fp8 output pass: e4m3 = saturate(x / scale[0])
//
// All enqueue on current_cuda_stream() and never synchronize or read device data on the host.
//
// Tiling and traffic (each is memory-bound; every input byte read once, every output byte
// written once):
//   concat_and_cache_mla: one CTA of 128 threads per slot; threads over the L + R elements.
//   gather: a warp per destination row; CTA (request, y) walks its request's rows with stride
//     gridDim.y * 8 warps (the row count lives on the device: nothing is read on the host).
//   copy_3d, quantize_e4m3_3d: a warp per (d0, d1) row, lanes over d2.
// Precision: every stored element is one rounding of the f32 value (RNE); fp8 stores
// saturate(x / scale) (IEEE division); fp8 reads are exact and multiplied by the scale in f32.
// quantize_e4m3_3d reads its scale on the device (graph-safe: the value of the moment); one that
// is not a positive finite number makes every element NaN (e4m3 0x7F), as the attention kernels'
// output store (attention/output_store.cuh), never a silently wrong finite value.
// cuBLAS: CUBLAS_COMPUTE_32F (no TF32), each C element rounded once to C's dtype.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "backends/cuda/common/device_primitives.cuh"
#include "backends/cuda/common/device_runtime.h"
#include "backends/mla/mla_common.h"
#include "ops/cuda_ops.h"
#include "pagedattn/device.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda {
namespace {

// f32 -> T, one rounding; fp8: saturate(x / scale).
template <typename T>
__device__ __forceinline__ T from_f32(float x, float scale) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else if constexpr (std::is_same_v<T, __nv_fp8_e4m3>) {
    T r;
    r.__x = __nv_cvt_float_to_fp8(__fdiv_rn(x, scale), __NV_SATFINITE, __NV_E4M3);
    return r;
  } else {
    T r;
    r.__x = __nv_cvt_float_to_fp8(__fdiv_rn(x, scale), __NV_SATFINITE, __NV_E5M2);
    return r;
  }
}

// Calls f(T{}) for a float dtype (f32/f16/bf16, plus fp8 when allowed).
template <bool kAllowFp8, typename F>
void dispatch_dtype(DType dtype, const char* argument, const char* op, F&& f) {
  switch (dtype) {
    case DType::f32: return f(float{});
    case DType::f16: return f(__half{});
    case DType::bf16: return f(__nv_bfloat16{});
    case DType::fp8_e4m3:
      if constexpr (kAllowFp8) return f(__nv_fp8_e4m3{});
      break;
    case DType::fp8_e5m2:
      if constexpr (kAllowFp8) return f(__nv_fp8_e5m2{});
      break;
    default: break;
  }
  throw Error(argument, detail::concat(op, ": ", argument, " dtype ", dtype_name(dtype),
                                       " is not supported on CUDA: expected float32, float16, bfloat16",
                                       kAllowFp8 ? ", fp8_e4m3 or fp8_e5m2" : ""));
}

cudaStream_t stream() { return static_cast<cudaStream_t>(current_cuda_stream()); }

// ---- concat_and_cache_mla ---------------------------------------------------------------------

struct ConcatParams {
  const void* kv_c;       // (N, L):(kv_c_stride, 1)
  const void* k_pe;       // (N, R):(k_pe_stride, 1)
  void* cache;            // (num_blocks, block_size, L + R):(block_stride, token_stride, 1)
  const int64_t* slots;   // (N',):(slot_stride)
  int64_t kv_c_stride, k_pe_stride, block_stride, token_stride, slot_stride;
  int64_t num_slots;
  int block_size, kv_lora_rank, rope_dim;
  float scale;
};

template <typename In, typename Out>
__global__ void __launch_bounds__(128) concat_and_cache_mla_kernel(const ConcatParams p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slots[token * p.slot_stride];
  if (slot < 0 || slot >= p.num_slots) return;
  const int64_t block = slot / p.block_size;
  const int64_t offset = slot - block * p.block_size;
  Out* dst = static_cast<Out*>(p.cache) + block * p.block_stride + offset * p.token_stride;
  const In* kv_c = static_cast<const In*>(p.kv_c) + token * p.kv_c_stride;
  const In* k_pe = static_cast<const In*>(p.k_pe) + token * p.k_pe_stride;
  const int width = p.kv_lora_rank + p.rope_dim;
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    const float x = i < p.kv_lora_rank ? to_f32(kv_c[i]) : to_f32(k_pe[i - p.kv_lora_rank]);
    dst[i] = from_f32<Out>(x, p.scale);
  }
}

// ---- gather_and_maybe_dequant_cache -----------------------------------------------------------

struct GatherParams {
  const void* cache;      // (num_blocks, block_size, W):(block_stride, token_stride, 1)
  void* dst;              // (rows, W):(dst_stride, 1)
  const int32_t* block_table;  // (batch, cols):(bt_stride, 1)
  const int32_t* cu_seq_lens;  // (batch + 1,)
  const int32_t* seq_starts;   // (batch,):(ss_stride) or nullptr
  int64_t cu_stride, ss_stride;
  int64_t block_stride, token_stride, dst_stride, bt_stride, bt_cols, num_blocks, dst_rows;
  int block_size, width;
  float scale;
};

template <typename In, typename Out>
__global__ void __launch_bounds__(256) gather_cache_kernel(const GatherParams p) {
  const int r = blockIdx.x;
  const int begin = p.cu_seq_lens[r * p.cu_stride];
  const int end = p.cu_seq_lens[(r + 1) * p.cu_stride];
  const int start = p.seq_starts != nullptr ? p.seq_starts[r * p.ss_stride] : 0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int64_t row = begin + static_cast<int64_t>(blockIdx.y) * 8 + warp; row < end;
       row += static_cast<int64_t>(gridDim.y) * 8) {
    if (row < 0 || row >= p.dst_rows) continue;  // outside dst: never written
    const int64_t pos = start + (row - begin);
    if (pos < 0) continue;
    if (pos / p.block_size >= p.bt_cols) continue;  // past the block table row: skipped
    const int32_t block = p.block_table[r * p.bt_stride + pos / p.block_size];
    if (block < 0 || block >= p.num_blocks) continue;  // skipped, row left as it was
    const In* src = static_cast<const In*>(p.cache) + block * p.block_stride + (pos % p.block_size) * p.token_stride;
    Out* dst = static_cast<Out*>(p.dst) + row * p.dst_stride;
    for (int i = lane; i < p.width; i += 32) {
      float x = to_f32(src[i]);
      if constexpr (std::is_same_v<In, __nv_fp8_e4m3> || std::is_same_v<In, __nv_fp8_e5m2>) x *= p.scale;
      dst[i] = from_f32<Out>(x, 1.f);
    }
  }
}

// ---- copy_3d ----------------------------------------------------------------------------------

struct Copy3dParams {
  const void* src;
  void* dst;
  int64_t d0, d1, d2;
  int64_t src_s0, src_s1, dst_s0, dst_s1;  // last dims contiguous
};

template <typename In, typename Out>
__global__ void __launch_bounds__(256) copy_3d_kernel(const Copy3dParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (row >= p.d0 * p.d1) return;
  const int64_t i0 = row / p.d1, i1 = row - i0 * p.d1;
  const In* src = static_cast<const In*>(p.src) + i0 * p.src_s0 + i1 * p.src_s1;
  Out* dst = static_cast<Out*>(p.dst) + i0 * p.dst_s0 + i1 * p.dst_s1;
  for (int64_t i = threadIdx.x & 31; i < p.d2; i += 32) {
    if constexpr (std::is_same_v<In, Out>) {
      dst[i] = src[i];
    } else {
      dst[i] = from_f32<Out>(to_f32(src[i]), 1.f);
    }
  }
}

// ---- quantize_e4m3_3d -------------------------------------------------------------------------

struct QuantizeParams {
  const void* src;
  void* dst;              // e4m3
  const float* scale;     // (1,) device
  int64_t d0, d1, d2;
  int64_t src_s0, src_s1, dst_s0, dst_s1;  // last dims contiguous
};

template <typename In>
__global__ void __launch_bounds__(256) quantize_e4m3_3d_kernel(const QuantizeParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (row >= p.d0 * p.d1) return;
  const float scale = __ldg(p.scale);
  const bool valid = scale > 0.f && scale <= 3.402823466e38f;  // NaN fails both
  const int64_t i0 = row / p.d1, i1 = row - i0 * p.d1;
  const In* src = static_cast<const In*>(p.src) + i0 * p.src_s0 + i1 * p.src_s1;
  __nv_fp8_e4m3* dst = static_cast<__nv_fp8_e4m3*>(p.dst) + i0 * p.dst_s0 + i1 * p.dst_s1;
  for (int64_t i = threadIdx.x & 31; i < p.d2; i += 32) {
    // NaN in, NaN out: the saturating conversion keeps NaN (0x7F) for an invalid scale.
    const float x = valid ? to_f32(src[i]) : __int_as_float(0x7fc00000);
    dst[i] = from_f32<__nv_fp8_e4m3>(x, scale);
  }
}

// ---- cuBLAS -----------------------------------------------------------------------------------

cudaDataType_t cublas_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return CUDA_R_32F;
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default:
      throw Error("dtype", detail::concat("batched_gemm: dtype ", dtype_name(dtype),
                                          " is not supported: expected float32, float16 or bfloat16"));
  }
}

// One handle per device per thread (cuBLAS handles are not thread-safe).
cublasHandle_t cublas_handle() {
  struct Handles {
    cublasHandle_t h[64] = {};
    ~Handles() {
      for (cublasHandle_t x : h)
        if (x != nullptr) cublasDestroy(x);
    }
  };
  thread_local Handles handles;
  int device = 0;
  cudaGetDevice(&device);
  cublasHandle_t& h = handles.h[device & 63];
  if (h == nullptr) {
    const cublasStatus_t st = cublasCreate(&h);
    PAGEDATTN_CHECK(st == CUBLAS_STATUS_SUCCESS, "device", "batched_gemm: cublasCreate failed with status ",
                    static_cast<int>(st));
  }
  return h;
}

}  // namespace
}  // namespace pagedattn::cuda

namespace pagedattn::detail {

void cuda_concat_and_cache_mla(const TensorView& kv_c, const TensorView& k_pe, const TensorView& kv_cache,
                               const TensorView& slot_mapping, DType cache_dtype, float scale) {
  const int64_t n = slot_mapping.size(0);
  if (n == 0 || kv_cache.size(0) == 0) return;
  cuda::ConcatParams p{};
  p.kv_c = kv_c.data();
  p.k_pe = k_pe.data();
  p.cache = kv_cache.data();
  p.slots = slot_mapping.data_as<const int64_t>();
  p.kv_c_stride = kv_c.stride(0);
  p.k_pe_stride = k_pe.stride(0);
  p.block_stride = kv_cache.stride(0);
  p.token_stride = kv_cache.stride(1);
  p.slot_stride = slot_mapping.stride(0);
  p.block_size = static_cast<int>(kv_cache.size(1));
  p.num_slots = kv_cache.size(0) * kv_cache.size(1);
  p.kv_lora_rank = static_cast<int>(kv_c.size(-1));
  p.rope_dim = static_cast<int>(k_pe.size(-1));
  p.scale = is_fp8(cache_dtype) ? scale : 1.f;
  PAGEDATTN_CHECK(k_pe.dtype() == kv_c.dtype(), "k_pe", "concat_and_cache_mla: k_pe is ", dtype_name(k_pe.dtype()),
                  ", expected kv_c's dtype ", dtype_name(kv_c.dtype()));
  cuda::dispatch_dtype<false>(kv_c.dtype(), "kv_c", "concat_and_cache_mla", [&](auto in) {
    using In = decltype(in);
    cuda::dispatch_dtype<true>(cache_dtype, "kv_cache", "concat_and_cache_mla", [&](auto out) {
      using Out = decltype(out);
      cuda::concat_and_cache_mla_kernel<In, Out><<<static_cast<unsigned>(n), 128, 0, cuda::stream()>>>(p);
      cuda::check_launch("concat_and_cache_mla_kernel");
    });
  });
}

void cuda_gather_and_maybe_dequant_cache(const TensorView& src_cache, const TensorView& dst,
                                         const TensorView& block_table, const TensorView& cu_seq_lens,
                                         int batch_size, DType cache_dtype, float scale,
                                         const TensorView& seq_starts) {
  if (batch_size <= 0 || dst.size(0) == 0) return;
  cuda::GatherParams p{};
  p.cache = src_cache.data();
  p.dst = dst.data();
  p.block_table = block_table.data_as<const int32_t>();
  p.cu_seq_lens = cu_seq_lens.data_as<const int32_t>();
  p.seq_starts = seq_starts.defined() ? seq_starts.data_as<const int32_t>() : nullptr;
  p.block_stride = src_cache.stride(0);
  p.token_stride = src_cache.stride(1);
  p.dst_stride = dst.stride(0);
  p.bt_stride = block_table.stride(0);
  p.bt_cols = block_table.size(1);
  p.num_blocks = src_cache.size(0);
  p.dst_rows = dst.size(0);
  p.block_size = static_cast<int>(src_cache.size(1));
  p.width = static_cast<int>(src_cache.size(2));
  p.scale = scale;
  p.cu_stride = cu_seq_lens.stride(0);
  p.ss_stride = seq_starts.defined() ? seq_starts.stride(0) : 0;
  // Rows per request are device values: 32 CTAs per request stride over them (8 warps each).
  const int64_t avg_rows = (dst.size(0) + batch_size - 1) / batch_size;
  const unsigned grid_y = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(64, (avg_rows + 7) / 8)));
  const dim3 grid(static_cast<unsigned>(batch_size), grid_y);
  cuda::dispatch_dtype<true>(cache_dtype, "src_cache", "gather_and_maybe_dequant_cache", [&](auto in) {
    using In = decltype(in);
    cuda::dispatch_dtype<false>(dst.dtype(), "dst", "gather_and_maybe_dequant_cache", [&](auto out) {
      using Out = decltype(out);
      cuda::gather_cache_kernel<In, Out><<<grid, 256, 0, cuda::stream()>>>(p);
      cuda::check_launch("gather_cache_kernel");
    });
  });
}

}  // namespace pagedattn::detail

namespace pagedattn::mla {

void cuda_copy_3d(const TensorView& src, const TensorView& dst) {
  PAGEDATTN_CHECK(src.ndim() == 3 && dst.ndim() == 3, "src", "copy_3d: expected 3-D src and dst, got ",
                  src.shape().str(), " and ", dst.shape().str());
  for (int i = 0; i < 3; ++i) {
    PAGEDATTN_CHECK(src.size(i) == dst.size(i), "src", "copy_3d: src shape ", src.shape().str(),
                    " differs from dst shape ", dst.shape().str());
  }
  PAGEDATTN_CHECK(src.stride(2) == 1 || src.size(2) <= 1, "src", "copy_3d: src innermost stride is ",
                  src.stride(2), ", expected 1");
  PAGEDATTN_CHECK(dst.stride(2) == 1 || dst.size(2) <= 1, "dst", "copy_3d: dst innermost stride is ",
                  dst.stride(2), ", expected 1");
  cuda::Copy3dParams p{src.data(), dst.data(), dst.size(0), dst.size(1), dst.size(2),
                       src.stride(0), src.stride(1), dst.stride(0), dst.stride(1)};
  const int64_t rows = p.d0 * p.d1;
  if (rows == 0 || p.d2 == 0) return;
  const unsigned grid = static_cast<unsigned>((rows + 7) / 8);
  cuda::dispatch_dtype<false>(src.dtype(), "src", "copy_3d", [&](auto in) {
    using In = decltype(in);
    cuda::dispatch_dtype<false>(dst.dtype(), "dst", "copy_3d", [&](auto out) {
      using Out = decltype(out);
      cuda::copy_3d_kernel<In, Out><<<grid, 256, 0, cuda::stream()>>>(p);
      cuda::check_launch("copy_3d_kernel");
    });
  });
}

// Checked by mla::quantize_e4m3_3d (mla_primitives.cpp), its only caller.
void cuda_quantize_e4m3_3d(const TensorView& src, const TensorView& dst, const TensorView& scale) {
  cuda::QuantizeParams p{src.data(), dst.data(), scale.data_as<const float>(), dst.size(0), dst.size(1), dst.size(2),
                         src.stride(0), src.stride(1), dst.stride(0), dst.stride(1)};
  const int64_t rows = p.d0 * p.d1;
  const unsigned grid = static_cast<unsigned>((rows + 7) / 8);
  cuda::dispatch_dtype<false>(src.dtype(), "src", "quantize_e4m3_3d", [&](auto in) {
    using In = decltype(in);
    cuda::quantize_e4m3_3d_kernel<In><<<grid, 256, 0, cuda::stream()>>>(p);
    cuda::check_launch("quantize_e4m3_3d_kernel");
  });
}

// Row-major C (m, n) = A (m, k) . B (k, n) is column-major C^T (n, m) = B^T (n, k) . A^T (k, m):
// cuBLAS's first operand is B, its second A. A row-major operand with unit column stride is a
// column-major transpose with ld = row stride (op N); one with unit row stride is column-major
// with ld = column stride (op T).
void cuda_batched_gemm(int batch, int m, int n, int k, const MatrixRef& a, const MatrixRef& b,
                       const MutableMatrixRef& c) {
  if (batch <= 0 || m <= 0 || n <= 0) return;
  PAGEDATTN_CHECK(a.dtype == b.dtype, "b", "batched_gemm: A is ", dtype_name(a.dtype), " and B is ",
                  dtype_name(b.dtype), ": the CUDA path needs one operand dtype");
  struct Op {
    cublasOperation_t op;
    int64_t ld;
  };
  // Operand X (rows, cols) row-major strides (rs, cs) as cuBLAS's operand of op(X^T).
  auto as_op = [](const MatrixRef& x, int64_t rows, int64_t cols, const char* name) -> Op {
    if (x.col_stride == 1 || cols == 1) {
      return {CUBLAS_OP_N, std::max<int64_t>({x.row_stride, cols, 1})};
    }
    PAGEDATTN_CHECK(x.row_stride == 1 || rows == 1, name, "batched_gemm: ", name, " has strides (",
                    x.row_stride, ", ", x.col_stride, "): one of them must be 1 on CUDA");
    return {CUBLAS_OP_T, std::max<int64_t>({x.col_stride, rows, 1})};
  };
  // Stored column-major: op N means storage (cols x rows) with ld >= cols; op T means storage
  // (rows x cols) with ld >= rows.
  const Op ob = as_op(b, k, n, "b");
  const Op oa = as_op(a, m, k, "a");
  PAGEDATTN_CHECK(c.row_stride >= n || m == 1, "c", "batched_gemm: C row stride ", c.row_stride,
                  " is smaller than n = ", n);
  if (k == 0) {
    // cuBLAS with k = 0 writes beta * C: C = 0 needs a defined C, so zero it explicitly.
    for (int bi = 0; bi < batch; ++bi) {
      const size_t es = dtype_size(c.dtype);
      char* base = static_cast<char*>(c.data) + static_cast<int64_t>(bi) * c.batch_stride * es;
      cudaMemset2DAsync(base, c.row_stride * es, 0, n * es, m, cuda::stream());
    }
    cuda::check_launch("batched_gemm (k = 0)");
    return;
  }
  cublasHandle_t h = cuda::cublas_handle();
  cublasSetStream(h, cuda::stream());
  const float alpha = 1.f, beta = 0.f;
  const cublasStatus_t st = cublasGemmStridedBatchedEx(
      h, ob.op, oa.op, n, m, k, &alpha, b.data, cuda::cublas_type(b.dtype), static_cast<int>(ob.ld), b.batch_stride,
      a.data, cuda::cublas_type(a.dtype), static_cast<int>(oa.ld), a.batch_stride, &beta, c.data,
      cuda::cublas_type(c.dtype), static_cast<int>(std::max<int64_t>(c.row_stride, n)), c.batch_stride, batch,
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  PAGEDATTN_CHECK(st == CUBLAS_STATUS_SUCCESS, "a", "batched_gemm: cublasGemmStridedBatchedEx failed with status ",
                  static_cast<int>(st), " (batch ", batch, ", m ", m, ", n ", n, ", k ", k, ")");
}

}  // namespace pagedattn::mla
