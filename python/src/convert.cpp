// Python <-> pagedattn conversions (see convert.h). No copies: every TensorView points at the
// memory of the Python object it came from.
#include "convert.h"

#include <nanobind/stl/string.h>

#include <array>
#include <optional>
#include <string>
#include <string_view>

namespace pagedattn::python {
namespace {

using Code = nb::dlpack::dtype_code;

std::optional<DType> dtype_from_dlpack(nb::dlpack::dtype dt) {
  if (dt.lanes != 1) return std::nullopt;
  switch (static_cast<Code>(dt.code)) {
    case Code::Float:
      if (dt.bits == 32) return DType::f32;
      if (dt.bits == 16) return DType::f16;
      break;
    case Code::Bfloat:
      if (dt.bits == 16) return DType::bf16;
      break;
    case Code::Float8_E4M3FN:
      if (dt.bits == 8) return DType::fp8_e4m3;
      break;
    case Code::Float8_E5M2:
      if (dt.bits == 8) return DType::fp8_e5m2;
      break;
    case Code::Int:
      if (dt.bits == 32) return DType::i32;
      if (dt.bits == 64) return DType::i64;
      break;
    case Code::UInt:
      if (dt.bits == 8) return DType::u8;
      break;
    default:
      break;
  }
  return std::nullopt;
}

nb::dlpack::dtype dlpack_from_dtype(DType dtype) {
  // bf16 / fp8 leave as unsigned integers of their width (NumPy has no such DLPack types); the
  // Python package views them back (pagedattn._tensors.as_dtype).
  switch (dtype) {
    case DType::f32: return nb::dtype<float>();
    case DType::f16: return {static_cast<uint8_t>(Code::Float), 16, 1};
    case DType::bf16: return nb::dtype<uint16_t>();
    case DType::fp8_e4m3:
    case DType::fp8_e5m2:
    case DType::u8: return nb::dtype<uint8_t>();
    case DType::i32: return nb::dtype<int32_t>();
    case DType::i64: return nb::dtype<int64_t>();
  }
  throw Error("dtype", "unknown dtype");
}

std::string describe_dlpack_dtype(nb::dlpack::dtype dt) {
  std::string name;
  switch (static_cast<Code>(dt.code)) {
    case Code::Int: name = "int"; break;
    case Code::UInt: name = "uint"; break;
    case Code::Float: name = "float"; break;
    case Code::Bfloat: name = "bfloat"; break;
    case Code::Complex: name = "complex"; break;
    case Code::Bool: name = "bool"; break;
    default: name = "dlpack_code" + std::to_string(dt.code) + "_"; break;
  }
  name += std::to_string(dt.bits);
  if (dt.lanes != 1) name += "x" + std::to_string(dt.lanes);
  return name;
}


// "torch.bfloat16" -> "bfloat16"; numpy dtype 'bfloat16' -> "bfloat16".
std::string dtype_string(nb::handle dtype_obj) {
  std::string s = nb::cast<std::string>(nb::str(dtype_obj));
  constexpr std::string_view torch_prefix = "torch.";
  if (s.rfind(torch_prefix, 0) == 0) s = s.substr(torch_prefix.size());
  return s;
}

// ml_dtypes / torch dtypes that DLPack import may not carry, with the unsigned type of the
// same width to re-view them as.
struct Reinterpretation {
  DType dtype;
  const char* numpy_uint;   // NumPy dtype string
  const char* torch_uint;   // attribute of the torch module
};
std::optional<Reinterpretation> reinterpretation_for(std::string_view dtype_name) {
  if (dtype_name == "bfloat16") return Reinterpretation{DType::bf16, "uint16", "int16"};
  if (dtype_name == "float8_e4m3fn") return Reinterpretation{DType::fp8_e4m3, "uint8", "uint8"};
  if (dtype_name == "float8_e5m2") return Reinterpretation{DType::fp8_e5m2, "uint8", "uint8"};
  return std::nullopt;
}

bool is_torch_object(nb::handle obj) {
  nb::object module = nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()))).attr("__module__");
  std::string name = nb::cast<std::string>(nb::str(module));
  return name.rfind("torch", 0) == 0;
}

}  // namespace

std::string python_type_name(nb::handle obj) {
  return nb::cast<std::string>(nb::str(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr())))));
}

const char* framework_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::fp8_e4m3: return "float8_e4m3fn";
    case DType::fp8_e5m2: return "float8_e5m2";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::u8: return "uint8";
  }
  return "unknown";
}

TensorView TensorArgs::get(nb::handle obj, const char* argument, bool writable, bool optional) {
  if (!obj.is_valid() || obj.is_none()) {
    PAGEDATTN_CHECK(optional, argument, argument, " is None: expected a tensor");
    return {};
  }
  nb::handle source = obj;
  std::optional<DType> forced_dtype;

  const int64_t* shape = nullptr;
  const int64_t* strides = nullptr;
  int ndim = 0;
  void* data = nullptr;
  nb::dlpack::dtype dl_dtype;
  int device_type = 0, device_id = 0;

  auto import = [&](nb::handle h) -> bool {
    if (writable) {
      nb::ndarray<> array;
      if (!nb::try_cast(h, array, false)) return false;
      writable_.push_back(array);
      const auto& a = writable_.back();
      shape = a.shape_ptr(); strides = a.stride_ptr(); ndim = static_cast<int>(a.ndim());
      data = a.data(); dl_dtype = a.dtype(); device_type = a.device_type(); device_id = a.device_id();
    } else {
      nb::ndarray<nb::ro> array;
      if (!nb::try_cast(h, array, false)) return false;
      read_only_.push_back(array);
      const auto& a = read_only_.back();
      shape = a.shape_ptr(); strides = a.stride_ptr(); ndim = static_cast<int>(a.ndim());
      data = const_cast<void*>(a.data()); dl_dtype = a.dtype();
      device_type = a.device_type(); device_id = a.device_id();
    }
    return true;
  };

  bool ok = import(source);
  if (!ok && nb::hasattr(obj, "dtype") && nb::hasattr(obj, "view")) {
    // ml_dtypes NumPy arrays and float8 torch tensors: view as same-width unsigned ints.
    std::string name = dtype_string(obj.attr("dtype"));
    if (auto re = reinterpretation_for(name)) {
      nb::object viewed;
      if (is_torch_object(obj)) {
        nb::object torch = nb::module_::import_("torch");
        viewed = obj.attr("view")(torch.attr(re->torch_uint));
      } else {
        viewed = obj.attr("view")(re->numpy_uint);
      }
      views_.push_back(viewed);
      ok = import(viewed);
      if (ok) forced_dtype = re->dtype;
    }
  }
  if (!ok) {
    if (writable) {
      nb::ndarray<nb::ro> probe;
      bool readable = nb::try_cast(obj, probe, false);
      if (!readable && !views_.empty()) readable = nb::try_cast(views_.back(), probe, false);
      PAGEDATTN_CHECK(!readable, argument, argument,
                      " is read-only: expected a writable tensor (the result is written into it)");
    }
    std::string what = python_type_name(obj);
    if (nb::hasattr(obj, "dtype")) what += " of dtype " + dtype_string(obj.attr("dtype"));
    throw Error(argument, detail::concat(argument, " is a ", what,
                                         ": expected a tensor (a NumPy array or an object with "
                                         "__dlpack__) of dtype float32, float16, bfloat16, "
                                         "float8_e4m3fn, float8_e5m2, int32, int64 or uint8"));
  }

  DType dtype;
  if (forced_dtype) {
    dtype = *forced_dtype;
  } else {
    std::optional<DType> d = dtype_from_dlpack(dl_dtype);
    PAGEDATTN_CHECK(d.has_value(), argument, argument, " has dtype ", describe_dlpack_dtype(dl_dtype),
                    ": expected float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int32, "
                    "int64 or uint8");
    dtype = *d;
  }
  Device device;
  switch (device_type) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value: device = Device::cpu; break;
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value: device = Device::cuda; break;
    default:
      throw Error(argument, detail::concat(argument, " is on DLPack device type ", device_type,
                                           ": expected a CPU or CUDA tensor"));
  }
  PAGEDATTN_CHECK(ndim <= kMaxDims, argument, argument, " has ", ndim,
                  " dimensions: expected at most ", kMaxDims);
  Shape shape_v, strides_v;
  for (int i = 0; i < ndim; ++i) shape_v.push_back(shape[i]);
  // An empty tensor's strides are meaningless (NumPy 2 exports zeros for them): it is taken as
  // contiguous, so that e.g. the (0, H, D) query of a step whose requests all have empty queries
  // is accepted.
  if (strides != nullptr && shape_v.numel() != 0) {
    for (int i = 0; i < ndim; ++i) strides_v.push_back(strides[i]);
  } else {
    strides_v = contiguous_strides(shape_v);
  }
  // Every kernel reads a row's elements consecutively (as vLLM's kernels require): the last
  // dimension must be contiguous. Other dimensions may have any strides (e.g. query/key/value
  // sliced out of a fused QKV projection, an HND cache) as long as the backend accepts them.
  if (ndim > 0 && shape_v[ndim - 1] > 1) {
    PAGEDATTN_CHECK(strides_v[ndim - 1] == 1, argument, argument, " has shape ", shape_v.str(),
                    " and strides ", strides_v.str(),
                    " (in elements): expected the last dimension to be contiguous (stride 1)");
  }
  return TensorView(data, dtype, shape_v, strides_v, device, device_id);
}

DType dtype_arg(nb::handle obj, const char* argument) {
  PAGEDATTN_CHECK(obj.is_valid() && !obj.is_none(), argument, argument,
                  " is None: expected a dtype such as \"bfloat16\"");
  std::string name;
  if (nb::isinstance<nb::str>(obj)) {
    name = nb::cast<std::string>(obj);
  } else if (PyType_Check(obj.ptr())) {
    // A scalar type: numpy.float16, ml_dtypes.bfloat16, ...
    nb::object numpy = nb::module_::import_("numpy");
    try {
      name = dtype_string(numpy.attr("dtype")(obj));
    } catch (const nb::python_error&) {
      throw Error(argument, detail::concat(argument, " = ", python_type_name(obj),
                                           " is not a dtype: expected e.g. \"bfloat16\""));
    }
  } else {
    name = dtype_string(obj);
  }
  if (name == "float8_e4m3fn") name = "fp8_e4m3";
  if (name == "float8_e5m2") name = "fp8_e5m2";
  return parse_dtype(name, argument);
}

Device device_arg(nb::handle obj, const char* argument) {
  PAGEDATTN_CHECK(obj.is_valid() && !obj.is_none(), argument, argument,
                  " is None: expected \"cpu\" or \"cuda\"");
  std::string name = nb::cast<std::string>(nb::str(obj));  // torch.device prints as "cuda:0"
  if (auto colon = name.find(':'); colon != std::string::npos) name = name.substr(0, colon);
  return parse_device(name, argument);
}

nb::object export_view(const TensorView& v, nb::handle owner) {
  std::array<size_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};
  for (int i = 0; i < v.ndim(); ++i) {
    shape[static_cast<size_t>(i)] = static_cast<size_t>(v.size(i));
    strides[static_cast<size_t>(i)] = v.stride(i);
  }
  // No owner: the array only refers to the memory (rv_policy::reference), valid while the library's is.
  nb::rv_policy policy = nb::rv_policy::reference;
  if (owner.is_valid()) policy = nb::rv_policy::automatic;
  if (v.device() == Device::cuda) {
    nb::ndarray<nb::pytorch> array(v.data(), static_cast<size_t>(v.ndim()), shape.data(), owner,
                                   strides.data(), dlpack_from_dtype(v.dtype()),
                                   nb::device::cuda::value, v.device_index());
    return array.cast(policy);
  }
  nb::ndarray<nb::numpy> array(v.data(), static_cast<size_t>(v.ndim()), shape.data(), owner,
                               strides.data(), dlpack_from_dtype(v.dtype()),
                               nb::device::cpu::value, 0);
  return array.cast(policy);
}

nb::object export_tensor(Tensor&& tensor) {
  auto* owner = new Tensor(std::move(tensor));
  nb::capsule capsule(owner, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  return export_view(owner->view(), capsule);
}

nb::object host_array(const TensorView& v, nb::handle owner, bool read_only) {
  PAGEDATTN_CHECK(v.device() == Device::cpu, "tensor", "host_array: expected a host tensor");
  std::array<size_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};
  for (int i = 0; i < v.ndim(); ++i) {
    shape[static_cast<size_t>(i)] = static_cast<size_t>(v.size(i));
    strides[static_cast<size_t>(i)] = v.stride(i);
  }
  if (read_only) {
    nb::ndarray<nb::numpy, nb::ro> array(v.data(), static_cast<size_t>(v.ndim()), shape.data(),
                                         owner, strides.data(), dlpack_from_dtype(v.dtype()),
                                         nb::device::cpu::value, 0);
    return array.cast();
  }
  nb::ndarray<nb::numpy> array(v.data(), static_cast<size_t>(v.ndim()), shape.data(), owner,
                               strides.data(), dlpack_from_dtype(v.dtype()),
                               nb::device::cpu::value, 0);
  return array.cast();
}

}  // namespace pagedattn::python
