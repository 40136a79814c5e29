// AttentionType, MultipleOf and the kernel-block-size vocabulary (vLLM abstract.py).
#pragma once

#include <string_view>
#include <variant>
#include <vector>

namespace pagedattn {

// decoder         causal self-attention over the paged cache
// encoder         non-causal self-attention over the current tokens, no cache (enc-dec encoder)
// encoder_only    non-causal self-attention over the current tokens, no cache (BERT-like)
// encoder_decoder non-causal cross-attention: decoder queries over cached encoder K/V
enum class AttentionType { decoder, encoder, encoder_only, encoder_decoder };

std::string_view attention_type_name(AttentionType t);  // "decoder", "encoder", ...
AttentionType parse_attention_type(std::string_view name);  // throws Error naming "attn_type"
inline bool uses_kv_cache(AttentionType t) {
  return t == AttentionType::decoder || t == AttentionType::encoder_decoder;
}
inline bool is_causal(AttentionType t) { return t == AttentionType::decoder; }

struct MultipleOf {
  int base = 1;
  bool operator==(const MultipleOf&) const = default;
};
using KernelBlockSize = std::variant<int, MultipleOf>;

// True when `block_size` equals one of the ints or is a positive multiple of one MultipleOf.
bool block_size_supported(const std::vector<KernelBlockSize>& supported, int block_size);
std::string describe_block_sizes(const std::vector<KernelBlockSize>& supported);  // "16, 32, multiples of 16"

// Quantization of an output (fused output quant). Only per-tensor fp8 is defined here.
struct QuantKey {
  enum class Kind { fp8_e4m3_per_tensor_static } kind = Kind::fp8_e4m3_per_tensor_static;
};

enum class CudaGraphSupport { never, uniform_single_token_decode, uniform_batch, always };
std::string_view cudagraph_support_name(CudaGraphSupport s);

}  // namespace pagedattn
