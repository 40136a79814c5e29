#include "work_model.h"

#include <algorithm>

namespace pagedattn::cli {

AttentionWork attention_work(const LayerShape& shape, DType dtype, DType kv_storage_dtype,
                             std::span<const int32_t> query_lens, std::span<const int32_t> seq_lens) {
  const double hq = shape.num_heads, hkv = shape.num_kv_heads;
  const double d = shape.head_size, dv = shape.value_head_size();
  const double act = static_cast<double>(dtype_size(dtype));
  const double kv = static_cast<double>(dtype_size(kv_storage_dtype));
  AttentionWork w;
  for (size_t r = 0; r < query_lens.size(); ++r) {
    const int64_t q = query_lens[r], s = seq_lens[r];
    const int64_t first = s - q;  // position of the first query
    int64_t lowest_key = 0;       // lowest key position any query of the request sees
    double pairs = 0;
    switch (shape.kind) {
      case LayerKind::sliding_window: {
        const int64_t window = shape.sliding_window;
        lowest_key = std::max<int64_t>(0, first - (window - 1));
        for (int64_t p = first; p < s; ++p) pairs += static_cast<double>(std::min(p + 1, window));
        break;
      }
      case LayerKind::chunked_local: {
        const int64_t chunk = shape.attention_chunk_size;
        lowest_key = first / chunk * chunk;
        for (int64_t p = first; p < s; ++p) pairs += static_cast<double>(p % chunk + 1);
        break;
      }
      default:  // full and MLA
        // sum of (p + 1) for p in [first, s)
        pairs = (static_cast<double>(s) * (s + 1) - static_cast<double>(first) * (first + 1)) / 2;
        break;
    }
    const double keys = static_cast<double>(s - lowest_key);
    if (shape.kind == LayerKind::mla) {
      // One latent row (L + R) per key; q (P + R) in, o (V) out per head. A decode (1 query)
      // attends in the latent space (L + R keys, L values); a prefill in the up-projected one.
      const double latent = shape.kv_lora_rank + shape.qk_rope_head_dim;
      const double qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim;
      w.bytes += keys * latent * kv + static_cast<double>(q) * hq * (qk + shape.v_head_dim) * act;
      const double per_pair = q == 1 ? latent + shape.kv_lora_rank : qk + shape.v_head_dim;
      w.flops += 2.0 * per_pair * hq * pairs;
      continue;
    }
    w.bytes += keys * hkv * (d + dv) * kv + static_cast<double>(q) * hq * (d + dv) * act;
    w.flops += 2.0 * (d + dv) * hq * pairs;
  }
  return w;
}

}  // namespace pagedattn::cli
