// The nanobind extension `pagedattn._C`. The public API is the package `pagedattn`
// (python/pagedattn/__init__.py), which re-exports these bindings and adds the thin Python
// layer that allocates outputs in the caller's framework and normalizes array-likes.
//
// pagedattn::Error becomes pagedattn.Error, a subclass of ValueError carrying the message and
// the offending argument's name (`.argument`).
#include <nanobind/nanobind.h>

#include "bindings.h"
#include "pagedattn/error.h"

namespace nb = nanobind;

namespace {
PyObject* error_type = nullptr;  // pagedattn.Error (module lifetime)
}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "pagedattn native extension (use the `pagedattn` package)";

  error_type = PyErr_NewExceptionWithDoc(
      "pagedattn.Error",
      "Invalid argument to a pagedattn function. A ValueError whose message names the argument, "
      "the value it had and what was expected; `.argument` is the argument's name (\"\" when the "
      "error is not about one argument).",
      PyExc_ValueError, nullptr);
  m.attr("Error") = nb::handle(error_type);

  nb::register_exception_translator(
      [](const std::exception_ptr& p, void*) {
        try {
          std::rethrow_exception(p);
        } catch (const pagedattn::Error& e) {
          nb::object exc = nb::steal(PyObject_CallOneArg(error_type, nb::str(e.what()).ptr()));
          if (!exc.is_valid()) return;  // the call set a Python error already
          nb::setattr(exc, "argument", nb::str(e.argument().c_str()));
          PyErr_SetObject(error_type, exc.ptr());
        }
      });

  pagedattn::python::bind_core(m);
  pagedattn::python::bind_backend(m);
  pagedattn::python::bind_metadata(m);
  pagedattn::python::bind_layer(m);
  pagedattn::python::bind_ops(m);
  pagedattn::python::bind_mla(m);
  pagedattn::python::bind_dcp(m);  // after bind_backend: reads its AttentionMetadataBuilder type
}
