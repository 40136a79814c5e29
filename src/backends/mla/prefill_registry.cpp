// MLA prefill backends (vLLM v1/attention/backends/mla/prefill): the registry (ordered list,
// REFERENCE last), the base validate_configuration with vLLM's reasons, and the selector with
// reasons (as get_attn_backend for the attention backends).
#include <cctype>
#include <cstdlib>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/error.h"
#include "pagedattn/mla.h"

// One include per prefill backend (CUDA ones under #if PAGEDATTN_HAS_CUDA).
#if PAGEDATTN_HAS_CUDA
#include "backends/cuda/mla_cuda_backend.h"
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

bool equal_ignoring_case(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

std::vector<const MLAPrefillBackendClass*> build_registry() {
  std::vector<const MLAPrefillBackendClass*> out;
  for (const PrefillAccessor accessor : kPrefillTable) {
    const MLAPrefillBackendClass* b = &accessor();
    for (const MLAPrefillBackendClass* other : out) {
      PAGEDATTN_CHECK(!equal_ignoring_case(other->get_name(), b->get_name()), "prefill_backend",
                      "MLA prefill registry: two prefill backends are named \"", b->get_name(),
                      "\" (names are case-insensitive and must be unique)");
    }
    out.push_back(b);
  }
  return out;
}

std::string describe(const MLAPrefillSelectorConfig& c) {
  std::ostringstream os;
  os << "(dtype=" << dtype_name(c.dtype) << ", mla_dimensions=" << c.mla_dimensions.to_string()
     << ", device=" << device_name(c.device) << ")";
  return os.str();
}

std::string join(const std::vector<std::string>& reasons) {
  std::string out;
  for (const std::string& r : reasons) {
    if (!out.empty()) out += ' ';
    out += r;
  }
  return out;
}

std::string registered_names() {
  std::string out;
  for (const MLAPrefillBackendClass* b : registered_mla_prefill_backends()) {
    if (!out.empty()) out += ", ";
    out += b->get_name();
  }
  return out;
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
  static const std::vector<const MLAPrefillBackendClass*> backends = build_registry();
  return backends;
}

const MLAPrefillBackendClass* find_mla_prefill_backend(std::string_view name) {
  for (const MLAPrefillBackendClass* b : registered_mla_prefill_backends()) {
    if (equal_ignoring_case(b->get_name(), name)) return b;
  }
  return nullptr;
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
  std::string name(forced);
  std::string_view source = "prefill_backend";
  if (name.empty()) {
    const char* env = std::getenv("PAGEDATTN_MLA_PREFILL_BACKEND");
    if (env != nullptr && *env != '\0') {
      name = env;
      source = "PAGEDATTN_MLA_PREFILL_BACKEND";
    }
  }
  if (!name.empty()) {
    const MLAPrefillBackendClass* b = find_mla_prefill_backend(name);
    PAGEDATTN_CHECK(b != nullptr, std::string(source), "get_mla_prefill_backend: ", source,
                    " = \"", name, "\" is not a registered MLA prefill backend (registered: ",
                    registered_names(), ")");
    const std::vector<std::string> reasons = reasons_of(*b, capability, config);
    PAGEDATTN_CHECK(reasons.empty(), std::string(source), "get_mla_prefill_backend: ", source,
                    " = \"", name, "\" forces prefill backend ", b->get_name(),
                    ", which does not support this configuration ", describe(config), ": ",
                    join(reasons));
    return *b;
  }
  std::string details;
  for (const MLAPrefillBackendClass* b : registered_mla_prefill_backends()) {
    const std::vector<std::string> reasons = reasons_of(*b, capability, config);
    if (reasons.empty()) return *b;
    details += "\n  ";
    details += b->get_name();
    details += ": ";
    details += join(reasons);
  }
  throw Error(detail::concat("no MLA prefill backend supports this configuration ",
                             describe(config), " (compute capability ", capability.to_string(),
                             "):", details));
}

}  // namespace pagedattn
