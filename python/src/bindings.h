// Registration functions of the extension's parts (one file each).
#pragma once

#include <nanobind/nanobind.h>

#include <memory>
#include <map>

#include "pagedattn/pagedattn.h"

namespace pagedattn::python {

namespace nb = nanobind;

void bind_core(nb::module_& m);      // dtypes, MultipleOf, KV-cache layout and spec, devices
void bind_backend(nb::module_& m);   // backends, selector, metadata builder, metadata
void bind_metadata(nb::module_& m);  // CommonAttentionMetadata and the batch utilities
void bind_layer(nb::module_& m);     // Attention
void bind_ops(nb::module_& m);       // reshape_and_cache(_flash), merge_attn_states
void bind_mla(nb::module_& m);       // MLAAttention, MLA ops, spec and prefill selector
void bind_dcp(nb::module_& m);       // decode context parallelism: layout, communicators, the step

// Called in a catch of `e`: throws an Error of a layer's DcpConfig with the Python keywords
// (dcp.world_size -> dcp_world_size, dcp.rank -> dcp_rank, dcp.interleave ->
// cp_kv_cache_interleave_size, in the argument and the message); rethrows any other Error as it is
// (bind_dcp.cpp).
[[noreturn]] void rethrow_with_dcp_keyword_names(const Error& e);

// CommonAttentionMetadata built from host arrays, materialized once per device it is used on
// (the CPU copy at construction, validated; a CUDA copy the first time a CUDA builder needs it).
class PyCommonAttentionMetadata {
 public:
  PyCommonAttentionMetadata(CommonAttentionMetadataArgs args, std::vector<int32_t> num_computed_tokens,
                            int max_query_len, int max_seq_len, int num_actual_tokens);
  PyCommonAttentionMetadata(const PyCommonAttentionMetadata&) = delete;
  PyCommonAttentionMetadata& operator=(const PyCommonAttentionMetadata&) = delete;
  // The metadata on `device` (made on first use). Views stay valid while this object lives.
  const CommonAttentionMetadata& on(Device device);
  const OwnedCommonAttentionMetadata& host() const { return *by_device_.at(Device::cpu); }

 private:
  std::unique_ptr<OwnedCommonAttentionMetadata> make(Device device) const;
  std::unique_ptr<OwnedCommonAttentionMetadata> make_checked(Device device) const;

  CommonAttentionMetadataArgs args_;
  // Values the caller gave instead of letting them be derived (-1 / empty = derived).
  std::vector<int32_t> num_computed_tokens_;
  int max_query_len_ = -1;
  int max_seq_len_ = -1;
  int num_actual_tokens_ = -1;
  std::map<Device, std::unique_ptr<OwnedCommonAttentionMetadata>> by_device_;
};

// A backend's plan plus what it points into (kept alive by nanobind keep_alive on the builder
// and the common metadata).
struct PyAttentionMetadata {
  std::shared_ptr<const AttentionMetadata> metadata;
  Device device = Device::cpu;
};

// An MLA backend's plan (MLAAttentionMetadata in Python, a subclass of AttentionMetadata).
struct PyMLAAttentionMetadata : PyAttentionMetadata {
  const MLAMetadata& mla() const { return static_cast<const MLAMetadata&>(*metadata); }
};

// A plan as a Python object: MLAAttentionMetadata for an MLA plan, else AttentionMetadata.
nb::object wrap_metadata(std::shared_ptr<const AttentionMetadata> metadata, Device device);
// The C++ builder of a Python AttentionMetadataBuilder (bind_backend.cpp); Error naming "builder"
// for anything else.
AttentionMetadataBuilder& builder_arg(nb::handle builder);

// A metadata builder of `backend` as a Python AttentionMetadataBuilder (bind_backend.cpp).
nb::object make_builder_object(const AttentionBackend& backend, const KVCacheSpec& spec,
                               const BuilderConfig& config, Device device);

// A backend handle (static lifetime in the registry).
struct PyBackend {
  const AttentionBackend* backend = nullptr;
};

}  // namespace pagedattn::python
