// AttentionType names, kernel block-size vocabulary (vLLM's int | MultipleOf) and CUDA-graph
// support names.
#include "pagedattn/attention_type.h"

#include <sstream>
#include <string>

#include "pagedattn/error.h"

namespace pagedattn {

std::string_view attention_type_name(AttentionType t) {
  switch (t) {
    case AttentionType::decoder: return "decoder";
    case AttentionType::encoder: return "encoder";
    case AttentionType::encoder_only: return "encoder_only";
    case AttentionType::encoder_decoder: return "encoder_decoder";
  }
  return "unknown";
}

AttentionType parse_attention_type(std::string_view name) {
  for (AttentionType t : {AttentionType::decoder, AttentionType::encoder,
                          AttentionType::encoder_only, AttentionType::encoder_decoder}) {
    if (name == attention_type_name(t)) return t;
  }
  throw Error("attn_type", detail::concat("attn_type = '", name,
                                          "' is not an attention type: expected one of decoder, "
                                          "encoder, encoder_only, encoder_decoder"));
}

bool block_size_supported(const std::vector<KernelBlockSize>& supported, int block_size) {
  if (block_size <= 0) return false;
  for (const KernelBlockSize& s : supported) {
    if (const int* exact = std::get_if<int>(&s)) {
      if (*exact == block_size) return true;
    } else {
      const int base = std::get<MultipleOf>(s).base;
      if (base > 0 && block_size % base == 0) return true;
    }
  }
  return false;
}

std::string describe_block_sizes(const std::vector<KernelBlockSize>& supported) {
  if (supported.empty()) return "none";
  std::ostringstream os;
  for (size_t i = 0; i < supported.size(); ++i) {
    if (i > 0) os << ", ";
    if (const int* exact = std::get_if<int>(&supported[i])) {
      os << *exact;
    } else {
      const int base = std::get<MultipleOf>(supported[i]).base;
      if (base == 1) {
        os << "any positive size";
      } else {
        os << "multiples of " << base;
      }
    }
  }
  return os.str();
}

std::string_view cudagraph_support_name(CudaGraphSupport s) {
  switch (s) {
    case CudaGraphSupport::never: return "never";
    case CudaGraphSupport::uniform_single_token_decode: return "uniform_single_token_decode";
    case CudaGraphSupport::uniform_batch: return "uniform_batch";
    case CudaGraphSupport::always: return "always";
  }
  return "unknown";
}

}  // namespace pagedattn
