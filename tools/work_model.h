// The work an attention step asks for, counted the way DESIGN.md §7 writes the floor:
//   bytes: every KV byte a request can see is read once per layer — (keys visible to any of its
//          queries) x Hkv x (D + Dv) x KV element size — plus q read and o written once
//          (T x Hq x D and T x Hq x Dv activation elements);
//   FLOPs: 2 (D + Dv) per (query, visible key) pair per query head (= 4·q·k·d for D = Dv),
//          counting only the keys a query actually sees (causal, window, chunk).
// MLA: one latent row (L + R) per visible key, q (P + R) and o (V) per head; FLOPs 2 (2L + R)
// per pair and head for a decode (absorbed: latent keys, L-dim values), 2 (P + R + V) for a
// prefill (the up-projection GEMMs are not counted).
// Visible keys of a query at absolute position p: full p + 1; sliding window W min(p + 1, W);
// chunked local C p mod C + 1.
#pragma once

#include <cstdint>
#include <span>

#include "pagedattn/dtype.h"
#include "presets.h"

namespace pagedattn::cli {

struct AttentionWork {
  double bytes = 0;
  double flops = 0;
};

// query_lens / seq_lens per request (seq_len = context + query_len).
AttentionWork attention_work(const LayerShape& shape, DType dtype, DType kv_storage_dtype,
                             std::span<const int32_t> query_lens, std::span<const int32_t> seq_lens);

}  // namespace pagedattn::cli
