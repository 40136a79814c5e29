// How Attention and MLAAttention register in a StaticForwardContext (vLLM validates the
// kv-sharing target against the static forward context of the layers created so far): the entry
// is checked when the constructor starts and added once the layer is fully built, so a rejected
// layer leaves the context unchanged.
#pragma once

#include <optional>
#include <string>

#include "pagedattn/error.h"
#include "pagedattn/layer.h"

namespace pagedattn {

// Throws Error naming kv_sharing_target_layer_name when a layer that shares a cache has no
// context, or the Error of StaticForwardContext::check. Returns the checked entry (make_entry()
// is called only with a context) for StaticForwardContext::add after construction; nullopt
// without a context.
template <class MakeEntry>
std::optional<StaticForwardContext::Layer> check_layer_registration(StaticForwardContext* ctx, const char* cls,
                                                                    const std::string& prefix,
                                                                    const std::optional<std::string>& target,
                                                                    MakeEntry&& make_entry) {
  PAGEDATTN_CHECK(ctx != nullptr || !target, "kv_sharing_target_layer_name", cls, " '", prefix,
                  "': kv_sharing_target_layer_name = '", target.value_or(""),
                  "' needs the StaticForwardContext that holds that layer (pass it to the "
                  "constructor): the target is checked against the layers created before this one");
  if (ctx == nullptr) return std::nullopt;
  StaticForwardContext::Layer entry = make_entry();
  ctx->check(entry);
  return entry;
}

}  // namespace pagedattn
