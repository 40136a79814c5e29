// MLA prefill backends (vLLM v1/attention/backends/mla/prefill): the registry (ordered list,
// REFERENCE last), the base validate_configuration with vLLM's reasons, and the selector with
// reasons (as get_attn_backend for the attention backends).
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/error.h"
#include "pagedattn/mla.h"
#include "backends/ordered_registry.h"

// One include per prefill backend (CUDA ones under #if PAGEDATTN_HAS_CUDA).
#if PAGEDATTN_HAS_CUDA
#include "backends/cuda/mla/mla_cuda_backend.h"
#endif
#include "backends/cpu/cpu_mla_prefill.h"
#include "backends/reference/reference_mla.h"

namespace pagedattn {

#if PAGEDATTN_HAS_CUDA
namespace mla {
DeviceCapability cuda_device_capability();  // mla_device_capability.cu
}  // namespace mla
#endif

namespace {

using PrefillAccessor = const MLAPrefillBackendClass& (*)();

// Highest priority first. ONE LINE PER PREFILL BACKEND: CUDA ones first (under the #if), then
// the CPU one, then REFERENCE, which stays last.
constexpr PrefillAccessor kPrefillTable[] = {
#if PAGEDATTN_HAS_CUDA
    &cuda_mla_prefill_backend,  // mma.sync flash kernel, qk 192 / v 128 (cuda/mla_prefill.cu)
#endif
    &cpu_mla_prefill_backend_class,  // CPU tile kernels (cpu_mla_prefill.cpp)
    &reference_mla_prefill_backend,  // fp64 oracle on the cpu, any dims: always last
};

std::string_view prefill_name(const MLAPrefillBackendClass& b) { return b.get_name(); }

const detail::RegistryWords<MLAPrefillBackendClass> kPrefillWords = {
    &prefill_name, "MLA prefill registry", "prefill backend", "MLA prefill backend",
    "prefill_backend", "PAGEDATTN_MLA_PREFILL_BACKEND", "get_mla_prefill_backend"};

std::string describe(const MLAPrefillSelectorConfig& c) {
  std::ostringstream os;
  os << "(dtype=" << dtype_name(c.dtype) << ", mla_dimensions=" << c.mla_dimensions.to_string()
     << ", device=" << device_name(c.device) << ")";
  return os.str();
}

std::vector<std::string> reasons_of(const MLAPrefillBackendClass& b, const DeviceCapability& cap,
                                    const MLAPrefillSelectorConfig& c) {
  try {
    return b.validate_configuration(cap, c);
  } catch (const Error& e) {
    return {std::string("validate_configuration failed: ") + e.what()};
  }
}

}  // namespace

std::string DeviceCapability::to_string() const {
  return std::to_string(major) + "." + std::to_string(minor);
}

DeviceCapability device_capability(Device device) {
  if (device == Device::cpu) return {};
#if PAGEDATTN_HAS_CUDA
  return mla::cuda_device_capability();
#else
  throw Error("device", "device_capability: device = cuda but pagedattn was built without CUDA");
#endif
}

bool MLAPrefillBackendClass::supports_dtype(DType dtype) const {
  for (const DType d : supported_dtypes()) {
    if (d == dtype) return true;
  }
  return false;
}

std::vector<std::string> MLAPrefillBackendClass::validate_configuration(
    const DeviceCapability& capability, const MLAPrefillSelectorConfig& config) const {
  // vLLM MLAPrefillBackend.validate_configuration, reason for reason, plus the device.
  std::vector<std::string> reasons;
  if (config.device != device()) {
    reasons.push_back(detail::concat("device ", device_name(config.device),
                                     " not supported (the ", get_name(),
                                     " prefill backend runs on ", device_name(device()), ")."));
  }
  if (!supports_compute_capability(capability)) {
    reasons.push_back(
        detail::concat("compute capability ", capability.to_string(), " not supported."));
  }
  if (!supports_dtype(config.dtype)) {
    std::string supported;
    for (const DType d : supported_dtypes()) {
      if (!supported.empty()) supported += ", ";
      supported += dtype_name(d);
    }
    reasons.push_back(detail::concat("dtype ", dtype_name(config.dtype),
                                     " not supported (supported: ", supported, ")."));
  }
  if (!is_available()) reasons.push_back("required dependencies not available.");
  const std::vector<MLADimensions> dims = supported_mla_dimensions();
  bool dims_ok = dims.empty();
  for (const MLADimensions& d : dims) dims_ok = dims_ok || d == config.mla_dimensions;
  if (!dims_ok) {
    std::string supported;
    for (const MLADimensions& d : dims) {
      if (!supported.empty()) supported += ", ";
      supported += d.to_string();
    }
    reasons.push_back(detail::concat("Model does not have supported MLA dimensions (got ",
                                     config.mla_dimensions.to_string(), "; supported: ", supported,
                                     ")."));
  }
  return reasons;
}

const std::vector<const MLAPrefillBackendClass*>& registered_mla_prefill_backends() {
  static const std::vector<const MLAPrefillBackendClass*> backends =
      detail::build_ordered_registry(kPrefillTable, kPrefillWords);
  return backends;
}

const MLAPrefillBackendClass* find_mla_prefill_backend(std::string_view name) {
  return detail::find_in_registry(registered_mla_prefill_backends(), name, kPrefillWords);
}

std::vector<MLAPrefillBackendReport> explain_mla_prefill_backends(
    const DeviceCapability& capability, const MLAPrefillSelectorConfig& config) {
  std::vector<MLAPrefillBackendReport> out;
  for (const MLAPrefillBackendClass* b : registered_mla_prefill_backends()) {
    out.push_back({b, reasons_of(*b, capability, config)});
  }
  return out;
}

const MLAPrefillBackendClass& get_mla_prefill_backend(const DeviceCapability& capability,
                                                      const MLAPrefillSelectorConfig& config,
                                                      std::string_view forced) {
  return detail::select_from_registry(
      registered_mla_prefill_backends(), forced,
      describe(config) + " (compute capability " + capability.to_string() + ")",
      [&](const MLAPrefillBackendClass& b) { return reasons_of(b, capability, config); },
      kPrefillWords);
}

}  // namespace pagedattn
