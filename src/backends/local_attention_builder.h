// The builder of chunked local attention (Llama 4 style, vLLM's ChunkedLocalAttention builder):
// AttentionBackend::make_builder returns it for every KVCacheSpec of kind
// chunked_local_attention, around the backend's own builder, so that a layer with
// attention_chunk_size computes chunked-local attention on every standard backend without the
// backend knowing about chunks. See local_attention_builder.cpp for what it does per step.
#pragma once

#include <memory>
#include <string_view>

#include "pagedattn/backend.h"

namespace pagedattn::local_attention {

// Checks a chunked_local_attention spec and its config for make_builder (Errors name
// "spec.attention_chunk_size", "config.attn_type", "config.sliding_window").
void check_local_attention_spec(const KVCacheSpec& spec, const BuilderConfig& config,
                                std::string_view backend);

// What the inner (backend's own) builder is made with: a full_attention spec of the same
// geometry (it plans ordinary causal attention over the virtual requests), and limits sized for
// virtual batches: at most 2 * max_num_seqs + max_num_batched_tokens / chunk (and at most
// max_num_seqs + max_num_batched_tokens) virtual requests of at most chunk keys each.
KVCacheSpec inner_spec(const KVCacheSpec& spec);
BuilderConfig inner_config(const KVCacheSpec& spec, const BuilderConfig& config);

// Wraps `inner` (made from inner_spec / inner_config). `spec` and `config` are the group's.
std::unique_ptr<AttentionMetadataBuilder> make_local_attention_builder(
    const KVCacheSpec& spec, const BuilderConfig& config, Device device,
    std::unique_ptr<AttentionMetadataBuilder> inner);

}  // namespace pagedattn::local_attention
