// The CUDA MLA prefill kernel's host entry (no CUDA types). Kernel: mla_prefill.cu.
#pragma once

#include <cstdint>

#include "pagedattn/dtype.h"

namespace pagedattn::cuda::mla_prefill {

inline constexpr int kQkDim = 192;   // qk_nope_head_dim + qk_rope_head_dim
inline constexpr int kVDim = 128;    // v_head_dim

// Ragged attention of num_seqs sequences: sequence i has queries [q_cu[i], q_cu[i+1]) and keys /
// values [kv_cu[i], kv_cu[i+1]); causal: query t (0-based in its sequence) sees keys
// <= t + (kv_len - q_len). Rows with no visible key: out 0, lse -inf.
struct PrefillParams {
  const void* q;        // (Tq, H, 192):(q_ts, q_hs, 1)
  const void* k;        // (Tk, H, 192):(k_ts, k_hs, 1)
  const void* v;        // (Tk, H, 128):(v_ts, v_hs, 1)
  void* out;            // (Tq, H, 128):(o_ts, o_hs, 1)
  float* lse;           // (H, Tq):(lse_hs, lse_ts) or nullptr
  int64_t q_ts, q_hs, k_ts, k_hs, v_ts, v_hs, o_ts, o_hs, lse_hs, lse_ts;
  const int32_t* q_cu;  // (num_seqs + 1,) device
  const int32_t* kv_cu; // (num_seqs + 1,) device
  int32_t num_seqs;
  int32_t num_heads;
  int32_t causal;
  float scale_log2;     // softmax scale * log2(e)
};

// max_q_len: an upper bound of the sequences' query lengths (host value from the plan).
void launch_prefill(const PrefillParams& params, DType dtype, int max_q_len, void* stream);

}  // namespace pagedattn::cuda::mla_prefill
