// The rows of a CUDA_MLA decode request (mla_decode.h), shared by the decode kernels and the
// combine: row t * H + h is head h of the request's token t; rows of tokens past the request's
// num_tokens are idle (read as zeros, never written). Token t sees keys [0, causal_end(t)).
#pragma once

#include <cstdint>

#include "backends/cuda/mla/mla_decode.h"

namespace pagedattn::cuda::mla_decode {

struct RowPlace {
  int t;       // token of the request
  int head;    // in [0, num_heads) even for an idle row (addresses stay in range)
  int token;   // decode token: row of q, the output, the LSE
  bool valid;  // t < num_tokens
};

__device__ __forceinline__ RowPlace row_place(const DecodeParams& p, const DecodeRequest& req, int row) {
  if (p.tokens_per_request == 1) {  // single-token plans: no division
    const bool in = row < p.num_heads;
    return RowPlace{in ? 0 : 1, in ? row : 0, req.first_token, in && req.num_tokens >= 1};
  }
  const int t = row / p.num_heads;
  return RowPlace{t, row - t * p.num_heads, req.first_token + t, t < req.num_tokens};
}

__device__ __forceinline__ int causal_end(const DecodeRequest& req, int t) {
  return req.seq_len - req.num_tokens + 1 + t;
}

// The end of the keys row `row` attends within a segment ending at kv_end (idle rows: kv_end).
__device__ __forceinline__ int row_key_end(const DecodeParams& p, const DecodeRequest& req, int kv_end, int row) {
  const RowPlace at = row_place(p, req, row);
  return at.valid ? min(kv_end, causal_end(req, at.t)) : kv_end;
}

// The 16-bit Q row of request row `row` (an idle row: a valid address, `valid` false: the loads
// zero-fill it).
__device__ __forceinline__ const char* q_row(const DecodeParams& p, const DecodeRequest& req, int row, bool& valid) {
  const RowPlace at = row_place(p, req, row);
  valid = at.valid;
  return static_cast<const char*>(p.q) +
         (static_cast<int64_t>(at.valid ? at.token : 0) * p.q_token_stride + static_cast<int64_t>(at.head) * p.q_head_stride) *
             2;
}

// Row of the partial buffers (o: x 512 floats; LSE) of request row `row` in slot `slot`.
__device__ __forceinline__ int64_t partial_row(const DecodeParams& p, int slot, int row) {
  return static_cast<int64_t>(slot) * p.tokens_per_request * p.num_heads + row;
}

}  // namespace pagedattn::cuda::mla_decode
