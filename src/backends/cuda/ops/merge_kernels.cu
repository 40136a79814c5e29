// LSE merges on the GPU:
//   combine_splits_kernel  N-way merge of partial states into the output: the split-KV partials
//                          (flash-decoding) of a row group plus, under cascade, its rows' prefix
//                          states (attention_plan.h CombineItem);
//   merge_attn_states_kernel  the two-way op of ops.h (cuda_merge_attn_states).
//
// Both compute, per (token, head) row with partial states (o_i, lse_i) (natural log):
//   M = max_i lse_i;  w_i = e^{lse_i - M};  o = sum_i w_i o_i / sum_i w_i;  lse = M + log sum_i w_i
// (+inf counts as -inf; all -inf: the first state is copied and lse = -inf; a NaN LSE, from a
// NaN logit, gives NaN output and lse in both, as the host merge_attn_states).
//
// Tiling: one warp per row; lanes walk the head dimension in 4-element vectors (16-byte f32
// loads of the partials; 8-byte 16-bit stores). Memory traffic: each partial read once, the
// output written once; the floor is those bytes over copy bandwidth.
// Precision points: weights and sums in f32 (expf / logf, accurate); the output rounded once to
// its dtype (round to nearest even).
// The two kernels share this file (one translation unit) on purpose: compiled apart, the
// optimizer inlines the math library differently and merge_attn_states_kernel's code changes.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>

#include "backends/cuda/attention/attention_plan.h"
#include "backends/cuda/attention/kernel_launch.h"
#include "backends/cuda/attention/output_store.cuh"
#include "backends/cuda/common/device_primitives.cuh"
#include "backends/cuda/common/device_runtime.h"
#include "ops/cuda_ops.h"
#include "pagedattn/device.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda {
namespace {

constexpr int kMaxSplits = 256;  // the builder never plans more splits per row group
constexpr int kMaxStates = 2 * kMaxSplits;  // request splits + prefix splits

template <typename T>
__device__ __forceinline__ T from_f32(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return Mma<T>::from_float(x);
  }
}

// ---- split combine ---------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(128) combine_splits_kernel(const CombineKernelParams p) {
  __shared__ float weights[4][kMaxStates];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int num_items = p.header->num_combine_items;
  for (int i = blockIdx.x; i < num_items; i += gridDim.x) {
    const CombineItem it = p.items[i];
    const int num_states = it.num_splits + it.prefix_splits;
    for (int r = warp; r < it.num_rows; r += 4) {
      // Partial row of state s of row r: split s at it.partial_row + s * it.num_rows + r, then
      // prefix split s' = s - num_splits at it.prefix_row + s' * it.prefix_stride + r.
      const auto state_row = [&](int s) -> int64_t {
        return s < it.num_splits
                   ? static_cast<int64_t>(it.partial_row) + static_cast<int64_t>(s) * it.num_rows + r
                   : static_cast<int64_t>(it.prefix_row) +
                         static_cast<int64_t>(s - it.num_splits) * it.prefix_stride + r;
      };
      float mx = neg_inf();
      for (int s = lane; s < num_states; s += 32) mx = fmaxf(mx, p.partial_lse[state_row(s)]);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float base = mx == neg_inf() ? 0.f : mx;
      float sum = 0.f;
      for (int s = lane; s < num_states; s += 32) {
        const float w = expf(p.partial_lse[state_row(s)] - base);
        weights[warp][s] = w;
        sum += w;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      __syncwarp();
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const int m = it.row_start + r;
      const int group = it.group_size > 0 ? it.group_size : p.group_size;  // kv-head pairs: 2G
      const int token = it.query_start + m / group;
      const int head = it.kv_head * group + m % group;
      const int64_t out = token * p.o_token_stride + head * p.o_head_stride;
      const bool fp8_out = p.output_scale != nullptr;
      const float q = output_quant_factor(p.output_scale);
      for (int c = lane * 4; c < p.head_size; c += 128) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s = 0; s < num_states; ++s) {
          const float w = weights[warp][s];
          const float4 v = *reinterpret_cast<const float4*>(p.partial_out + state_row(s) * p.head_size + c);
          acc.x += w * v.x;
          acc.y += w * v.y;
          acc.z += w * v.z;
          acc.w += w * v.w;
        }
        store_output4<T>(p.output, out + c, make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv), fp8_out, q);
      }
      if (lane == 0 && p.lse != nullptr) {
        p.lse[head * p.lse_head_stride + static_cast<int64_t>(token) * p.lse_token_stride] =
            lse_natural(base, sum);  // a NaN state's weight makes the sum NaN
      }
      __syncwarp();  // weights[warp] is rewritten by the next row
    }
  }
}

// ---- merge_attn_states -----------------------------------------------------------------------

struct MergeParams {
  // (T, H, D) tensors: strides in elements (token, head, dim).
  void* output;
  const void* prefix;
  const void* suffix;
  int64_t out_strides[3], prefix_strides[3], suffix_strides[3];
  // (H, T) f32 LSEs: strides (head, token).
  const float* prefix_lse;
  const float* suffix_lse;
  float* output_lse;
  int64_t prefix_lse_strides[2], suffix_lse_strides[2], output_lse_strides[2];
  int64_t num_tokens;
  int num_heads, head_size;
  int64_t prefill_tokens_with_context;  // -1: every token merged
};

__device__ __forceinline__ float finite_or_neg_inf(float lse) {
  return lse == __int_as_float(0x7f800000) ? neg_inf() : lse;
}

template <typename T>
__global__ void __launch_bounds__(128) merge_attn_states_kernel(const MergeParams p) {
  const int64_t num_rows = p.num_tokens * p.num_heads;
  const int lane = threadIdx.x & 31;
  for (int64_t row = (static_cast<int64_t>(blockIdx.x) * 128 + threadIdx.x) / 32; row < num_rows;
       row += static_cast<int64_t>(gridDim.x) * 4) {
    const int64_t t = row / p.num_heads;
    const int h = static_cast<int>(row - t * p.num_heads);
    const float lp = finite_or_neg_inf(p.prefix_lse[h * p.prefix_lse_strides[0] + t * p.prefix_lse_strides[1]]);
    const float ls = finite_or_neg_inf(p.suffix_lse[h * p.suffix_lse_strides[0] + t * p.suffix_lse_strides[1]]);
    const T* prefix = static_cast<const T*>(p.prefix) + t * p.prefix_strides[0] + h * p.prefix_strides[1];
    const T* suffix = static_cast<const T*>(p.suffix) + t * p.suffix_strides[0] + h * p.suffix_strides[1];
    T* out = static_cast<T*>(p.output) + t * p.out_strides[0] + h * p.out_strides[1];
    const bool suffix_only = p.prefill_tokens_with_context >= 0 && t >= p.prefill_tokens_with_context;
    const float m = fmaxf(lp, ls);
    // Both empty (not NaN: fmaxf drops a NaN LSE, which must give NaN as the host merge does).
    const bool copy_prefix = !suffix_only && lp == neg_inf() && ls == neg_inf();
    float wp = 0.f, ws = 1.f, lse = ls;
    if (copy_prefix) {
      wp = 1.f;
      ws = 0.f;
      lse = neg_inf();
    } else if (!suffix_only) {
      const float a = expf(lp - m);
      const float b = expf(ls - m);
      wp = a / (a + b);
      ws = b / (a + b);
      lse = m + logf(a + b);
    }
    for (int d = lane; d < p.head_size; d += 32) {
      const T pv = prefix[d * p.prefix_strides[2]];
      const T sv = suffix[d * p.suffix_strides[2]];
      T result;
      if (copy_prefix) {
        result = pv;
      } else if (suffix_only) {
        result = sv;
      } else {
        result = from_f32<T>(wp * to_f32(pv) + ws * to_f32(sv));
      }
      out[d * p.out_strides[2]] = result;
    }
    if (lane == 0 && p.output_lse != nullptr) {
      p.output_lse[h * p.output_lse_strides[0] + t * p.output_lse_strides[1]] = lse;
    }
  }
}

}  // namespace

void launch_combine_splits(const CombineKernelParams& params, DType activation, int grid, void* stream) {
  if (grid <= 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  if (activation == DType::bf16) {
    combine_splits_kernel<__nv_bfloat16><<<grid, 128, 0, s>>>(params);
  } else {
    combine_splits_kernel<__half><<<grid, 128, 0, s>>>(params);
  }
  check_launch("combine_splits_kernel");
}

}  // namespace pagedattn::cuda

namespace pagedattn::detail {

void cuda_merge_attn_states(const TensorView& output, const TensorView& prefix_output,
                            const TensorView& prefix_lse, const TensorView& suffix_output,
                            const TensorView& suffix_lse, const TensorView& output_lse,
                            int64_t prefill_tokens_with_context) {
  cuda::MergeParams p{};
  p.output = output.data();
  p.prefix = prefix_output.data();
  p.suffix = suffix_output.data();
  for (int i = 0; i < 3; ++i) {
    p.out_strides[i] = output.stride(i);
    p.prefix_strides[i] = prefix_output.stride(i);
    p.suffix_strides[i] = suffix_output.stride(i);
  }
  p.prefix_lse = prefix_lse.data_as<const float>();
  p.suffix_lse = suffix_lse.data_as<const float>();
  p.output_lse = output_lse.defined() ? output_lse.data_as<float>() : nullptr;
  for (int i = 0; i < 2; ++i) {
    p.prefix_lse_strides[i] = prefix_lse.stride(i);
    p.suffix_lse_strides[i] = suffix_lse.stride(i);
    p.output_lse_strides[i] = output_lse.defined() ? output_lse.stride(i) : 0;
  }
  p.num_tokens = output.size(0);
  p.num_heads = static_cast<int>(output.size(1));
  p.head_size = static_cast<int>(output.size(2));
  p.prefill_tokens_with_context = prefill_tokens_with_context;
  const int64_t rows = p.num_tokens * p.num_heads;
  if (rows == 0) return;
  const int grid = static_cast<int>(std::min<int64_t>((rows + 3) / 4, 65535));
  const auto stream = static_cast<cudaStream_t>(current_cuda_stream());
  switch (output.dtype()) {
    case DType::f32:
      cuda::merge_attn_states_kernel<float><<<grid, 128, 0, stream>>>(p);
      break;
    case DType::f16:
      cuda::merge_attn_states_kernel<__half><<<grid, 128, 0, stream>>>(p);
      break;
    case DType::bf16:
      cuda::merge_attn_states_kernel<__nv_bfloat16><<<grid, 128, 0, stream>>>(p);
      break;
    default:
      throw Error("output", detail::concat("merge_attn_states: output dtype ", dtype_name(output.dtype()),
                                           " is not supported on CUDA: expected float32, float16 or bfloat16"));
  }
  cuda::check_launch("merge_attn_states_kernel");
}

}  // namespace pagedattn::detail
