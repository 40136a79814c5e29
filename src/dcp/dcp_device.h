// The row and merge kernels of a DCP step on the GPU (src/dcp/dcp_device.cu), called by
// dcp_forward.cpp when the plan lives on Device::cuda. Only compiled with the CUDA backend; the
// caller has checked every argument. All enqueue on current_cuda_stream() and do not synchronize.
#pragma once

#include "pagedattn/tensor.h"

namespace pagedattn::dcp_detail {

// dst (n, a[, b]) contiguous = rows rows[i] of src (rank 2 or 3, any strides, element of 1, 2 or
// 4 bytes); rows: i32 (n) on the device, each in [0, src.size(0)).
void cuda_gather_rows(const TensorView& src, const TensorView& rows, const TensorView& dst);

// The packed (output, LSE) a rank sends: out (T, H, D) and lse (H, T) f32, both contiguous. Global
// row t takes local row inverse[t] of local_out (n, H, D) / local_lse (H, n), or zeros and -inf when
// inverse[t] < 0 (this rank holds no key of it). inverse: i32 (T).
void cuda_pack_rows(const TensorView& local_out, const TensorView& local_lse, const TensorView& inverse,
                    const TensorView& out, const TensorView& lse);

// out (T, H, D), any strides (and out_lse (H, T) f32 when defined) = the LSE merge of the N states
// outs (N, T, H, D) / lses (N, H, T) (the all-gathered packs; any strides): the math of
// merge_attn_states_n, every weight and sum in f32, the output rounded once.
void cuda_merge_states(const TensorView& outs, const TensorView& lses, const TensorView& out,
                       const TensorView& out_lse);

}  // namespace pagedattn::dcp_detail
