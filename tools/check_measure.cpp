// --check's measure of `pagedattn run` (simulation.h): the relative error of an output against the
// REFERENCE's and the DESIGN.md tolerance it is held to.
#include <algorithm>
#include <cmath>
#include <string>

#include "pagedattn/dtype.h"
#include "pagedattn/error.h"
#include "simulation.h"

namespace pagedattn::cli {

double check_tolerance(DType dtype, const std::string& kv_cache_dtype) {
  DType kv = kv_cache_storage_dtype(kv_cache_dtype, dtype);
  if (is_fp8(kv)) return 6e-2;
  double t = 1e-5;
  for (DType d : {dtype, kv}) {
    if (d == DType::f16) t = std::max(t, 2e-3);
    if (d == DType::bf16) t = std::max(t, 8e-3);
  }
  return t;
}

double output_relative_error(const TensorView& out, const TensorView& ref) {
  PAGEDATTN_CHECK(out.numel() == ref.numel() && out.is_contiguous() && ref.is_contiguous() &&
                      out.device() == Device::cpu && ref.device() == Device::cpu,
                  "out", "output_relative_error: out ", out.describe(), " and ref ", ref.describe(),
                  " must be contiguous host tensors of the same size");
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    double o = load_f64(out.data(), out.dtype(), i);
    double r = load_f64(ref.data(), ref.dtype(), i);
    if (!std::isfinite(o)) return INFINITY;
    diff += (o - r) * (o - r);
    norm += r * r;
  }
  if (norm == 0) return std::sqrt(diff);
  return std::sqrt(diff / norm);
}

}  // namespace pagedattn::cli
