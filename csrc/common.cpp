#include "common.hpp"

#include <algorithm>

namespace sckpt {

void unpack(py::handle v, int n, py::object* out) {
    PyObject* o = v.ptr();
    if (PyTuple_CheckExact(o) || PyList_CheckExact(o)) {
        const Py_ssize_t size = Py_SIZE(o);
        if (size == n) {
            PyObject** items = PySequence_Fast_ITEMS(o);
            for (int i = 0; i < n; ++i) out[i] = borrow(items[i]);
            return;
        }
        if (size < n) {
            raise_builtin(PyExc_ValueError, Msg() << "not enough values to unpack (expected " << n << ", got "
                                                  << static_cast<long long>(size) << ")");
        }
#if PY_VERSION_HEX >= 0x030E0000
        raise_builtin(PyExc_ValueError, Msg() << "too many values to unpack (expected " << n << ", got "
                                              << static_cast<long long>(size) << ")");
#else
        raise_builtin(PyExc_ValueError, Msg() << "too many values to unpack (expected " << n << ")");
#endif
    }
    PyObject* raw_it = PyObject_GetIter(o);
    if (raw_it == nullptr) {
        if (PyErr_ExceptionMatches(PyExc_TypeError) && Py_TYPE(o)->tp_iter == nullptr && !PySequence_Check(o)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "cannot unpack non-iterable %.200s object", Py_TYPE(o)->tp_name);
        }
        throw py::error_already_set();
    }
    py::object it = py::reinterpret_steal<py::object>(raw_it);
    for (int i = 0; i < n; ++i) {
        PyObject* item = PyIter_Next(it.ptr());
        if (item == nullptr) {
            if (PyErr_Occurred()) throw py::error_already_set();
            raise_builtin(PyExc_ValueError, Msg() << "not enough values to unpack (expected " << n << ", got " << i << ")");
        }
        out[i] = py::reinterpret_steal<py::object>(item);
    }
    PyObject* extra = PyIter_Next(it.ptr());
    if (extra == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        return;
    }
    Py_DECREF(extra);
#if PY_VERSION_HEX >= 0x030E0000
    if (PyDict_CheckExact(o) && PyDict_GET_SIZE(o) > n) {
        raise_builtin(PyExc_ValueError, Msg() << "too many values to unpack (expected " << n << ", got "
                                              << static_cast<long long>(PyDict_GET_SIZE(o)) << ")");
    }
#endif
    raise_builtin(PyExc_ValueError, Msg() << "too many values to unpack (expected " << n << ")");
}

bool plain_dict(py::handle m, const char* method) {
    PyObject* d = m.ptr();
    if (PyDict_CheckExact(d)) return true;
    if (!PyDict_Check(d)) return false;
    PyTypeObject* type = Py_TYPE(d);
    if (type->tp_dictoffset != 0) return false;  // instance attributes could shadow the method
#ifdef Py_TPFLAGS_MANAGED_DICT
    if (PyType_HasFeature(type, Py_TPFLAGS_MANAGED_DICT)) return false;
#endif
    PyObject* mine = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), method);
    if (mine == nullptr) {
        PyErr_Clear();
        return false;
    }
    PyObject* base = PyObject_GetAttrString(reinterpret_cast<PyObject*>(&PyDict_Type), method);
    const bool same = mine == base;
    Py_DECREF(mine);
    Py_XDECREF(base);
    if (base == nullptr) PyErr_Clear();
    return same;
}

namespace {

/// ``k != "params"`` for a key of any type.
bool not_params(PyObject* k, PyObject* params) {
    if (k == params) return false;
    if (PyUnicode_CheckExact(k)) {
        return PyUnicode_GET_LENGTH(k) != 6 || PyUnicode_Compare(k, params) != 0;
    }
    py::object r = steal(PyObject_RichCompare(k, params, Py_NE));
    const int truth = PyObject_IsTrue(r.ptr());
    check(truth);
    return truth != 0;
}

}  // namespace

py::object copy_without_params(py::handle group, py::handle params_key) {
    PyObject* params = params_key.ptr();
    if (PyDict_CheckExact(group.ptr())) {
        // Fast path: when every key is an exact str, the comprehension equals a copy with
        // "params" deleted (same order, same values).
        bool all_str = true;
        bool has_params = false;
        Py_ssize_t pos = 0;
        PyObject* k = nullptr;
        PyObject* v = nullptr;
        while (PyDict_Next(group.ptr(), &pos, &k, &v)) {
            if (!PyUnicode_CheckExact(k)) {
                all_str = false;
                break;
            }
            if (!has_params && !not_params(k, params)) has_params = true;
        }
        if (all_str) {
            py::object out = steal(PyDict_Copy(group.ptr()));
            if (has_params) check(PyDict_DelItem(out.ptr(), params));
            return out;
        }
    }
    py::object out = steal(PyDict_New());
    iterate_items(group, [&](py::handle key, py::handle value) {
        if (not_params(key.ptr(), params)) check(PyDict_SetItem(out.ptr(), key.ptr(), value.ptr()));
    });
    return out;
}

py::object concat(std::initializer_list<PyObject*> parts) {
    Py_ssize_t total = 0;
    Py_UCS4 maxchar = 127;
    for (PyObject* p : parts) {
        ensure_ready(p);
        total += PyUnicode_GET_LENGTH(p);
        maxchar = std::max(maxchar, static_cast<Py_UCS4>(PyUnicode_MAX_CHAR_VALUE(p)));
    }
    py::object out = steal(PyUnicode_New(total, maxchar));
    Py_ssize_t at = 0;
    for (PyObject* p : parts) {
        const Py_ssize_t n = PyUnicode_GET_LENGTH(p);
        if (n > 0 && PyUnicode_CopyCharacters(out.ptr(), at, p, 0, n) < 0) throw py::error_already_set();
        at += n;
    }
    return out;
}

}  // namespace sckpt
