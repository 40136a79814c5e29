// Conversions between Python objects and pagedattn types for the nanobind module.
//
// Tensors come in through DLPack (any object with __dlpack__: NumPy, PyTorch CPU/CUDA, CuPy,
// JAX, ...) or the buffer protocol, never copied: the TensorView handed to the library points at
// the caller's memory. NumPy arrays of ml_dtypes' bfloat16 / float8_e4m3fn / float8_e5m2 (which
// NumPy cannot export through DLPack) and PyTorch float8 tensors are re-viewed as unsigned
// integers of the same width (still no copy) and tagged with the real dtype.
// Every failure throws pagedattn::Error naming the argument (Python sees ValueError).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "pagedattn/pagedattn.h"

namespace pagedattn::python {

namespace nb = nanobind;

// Holds the imported DLPack tensors (and so the producers' buffers) for the duration of a call.
class TensorArgs {
 public:
  // `obj` as a tensor. writable: the library writes it (read-only arrays are rejected).
  // The last dimension must be contiguous (stride 1); other strides are passed on.
  // optional: None gives an empty (undefined) view.
  TensorView get(nb::handle obj, const char* argument, bool writable = false,
                 bool optional = false);

 private:
  std::vector<nb::ndarray<nb::ro>> read_only_;
  std::vector<nb::ndarray<>> writable_;
  std::vector<nb::object> views_;  // re-viewed ml_dtypes / float8 objects
};

// dtype from a string ("bfloat16", "bf16", ...), a NumPy / ml_dtypes dtype or scalar type, or a
// torch.dtype. Throws Error naming `argument`.
DType dtype_arg(nb::handle obj, const char* argument);
// Device from "cpu", "cuda", "cuda:N" or a torch.device.
Device device_arg(nb::handle obj, const char* argument);
// The library's name of a dtype in the spelling NumPy / ml_dtypes / PyTorch use
// ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int32", "int64", "uint8").
const char* framework_dtype_name(DType dtype);

// Hands an owning Tensor to Python without a copy: a NumPy array (host) or a torch.Tensor
// (CUDA), with the tensor's strides. bf16 / fp8 come out as uint16 / uint8 of the same layout;
// the Python package re-views them (pagedattn._tensors.as_dtype).
nb::object export_tensor(Tensor&& tensor);
// The same for a view of memory `owner` keeps alive; without an owner the array only refers to
// the memory (valid while the library's is: e.g. during a call into Python).
nb::object export_view(const TensorView& view, nb::handle owner);
// A NumPy array owning `values` (moved), of `shape`.
template <typename T>
nb::object numpy_from_vector(std::vector<T>&& values, std::initializer_list<size_t> shape) {
  auto* owner = new std::vector<T>(std::move(values));
  nb::capsule capsule(owner, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(owner->data(), shape, capsule).cast();
}
// The Python type name of obj ("numpy.ndarray", "torch.Tensor", ...).
std::string python_type_name(nb::handle obj);
// A host view as a NumPy array sharing memory with `owner` (kept alive by the array).
nb::object host_array(const TensorView& view, nb::handle owner, bool read_only);

}  // namespace pagedattn::python
