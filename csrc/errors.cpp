#include "errors.hpp"

namespace sckpt {

namespace {

py::object error_class(const char* cls_name) {
    return py::module_::import("sparse_ckpt.errors").attr(cls_name);
}

}  // namespace

void raise_sc(const char* cls_name, const py::object& msg) {
    py::object cls = error_class(cls_name);
    PyErr_SetObject(cls.ptr(), msg.ptr());
    throw py::error_already_set();
}

void raise_format_error(const py::object& msg) { raise_sc("CheckpointFormatError", msg); }
void raise_mismatch_error(const py::object& msg) { raise_sc("CheckpointMismatchError", msg); }
void raise_unsupported_error(const py::object& msg) { raise_sc("UnsupportedStateDictError", msg); }

void raise_builtin(PyObject* exc_type, const py::object& msg) {
    PyErr_SetObject(exc_type, msg.ptr());
    throw py::error_already_set();
}

bool matches_sc(const py::error_already_set& err, const char* cls_name) {
    return err.matches(error_class(cls_name));
}

}  // namespace sckpt
