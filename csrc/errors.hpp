// Raising the library's exception classes from C++.
//
// The classes live in the Python module ``sparse_ckpt.errors``; it is imported at raise time
// (no cached global object, no global mutable state), so the C++ core raises exactly the
// classes the Python core raises.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace sckpt {

/// Raise ``sparse_ckpt.errors.<cls_name>(msg)``.
[[noreturn]] void raise_sc(const char* cls_name, const py::object& msg);
[[noreturn]] void raise_format_error(const py::object& msg);       // CheckpointFormatError
[[noreturn]] void raise_mismatch_error(const py::object& msg);     // CheckpointMismatchError
[[noreturn]] void raise_unsupported_error(const py::object& msg);  // UnsupportedStateDictError
/// Raise a builtin exception type (ValueError, TypeError, RuntimeError, ...).
[[noreturn]] void raise_builtin(PyObject* exc_type, const py::object& msg);
/// True when the caught error is a ``sparse_ckpt.errors.<cls_name>`` (or a subclass).
bool matches_sc(const py::error_already_set& err, const char* cls_name);

}  // namespace sckpt
