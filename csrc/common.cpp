#include "common.hpp"

#include <algorithm>

namespace sckpt {

void raise_type(const char* what, py::handle obj) {
    raise_builtin(PyExc_TypeError, Msg() << "expected " << what << ", got " << type_name(obj));
}

void unpack(py::handle v, int n, py::object* out) {
    PyObject* o = v.ptr();
    if (!PyTuple_Check(o)) raise_type("a tuple", v);
    const Py_ssize_t size = PyTuple_GET_SIZE(o);
    if (size != n) {
        raise_builtin(PyExc_ValueError, Msg() << "expected a tuple of " << n << " items, got "
                                              << static_cast<long long>(size));
    }
    for (int i = 0; i < n; ++i) out[i] = borrow(PyTuple_GET_ITEM(o, i));
}

void Reader::fail(const py::object& what) const {
    raise_format_error(Msg() << where_ << ": " << what << " at byte " << static_cast<unsigned long long>(pos_));
}

const char* Reader::take(uint64_t n, const char* what) {
    if (n > left()) {
        fail(Msg() << "truncated " << noun_ << " reading " << what << " (" << static_cast<unsigned long long>(n)
                   << " bytes wanted, " << static_cast<unsigned long long>(left()) << " left)");
    }
    const char* p = data_.data() + pos_;
    pos_ += static_cast<size_t>(n);
    return p;
}

unsigned Reader::header(std::string_view magic, unsigned version, const char* what, unsigned oldest) {
    if (std::string_view(take(magic.size(), "magic"), magic.size()) != magic) {
        raise_format_error(Msg() << where_ << ": bad magic, not " << what);
    }
    const auto found = static_cast<unsigned>(get_le(take(2, "version"), 2));
    const unsigned first = oldest == 0 ? version : oldest;
    if (found < first || found > version) {
        Msg m;
        m << where_ << ": unsupported version " << found << " (this library reads ";
        if (first == version) {
            m << "version " << version << ")";
        } else {
            m << "versions " << first << " to " << version << ")";
        }
        raise_format_error(m);
    }
    return found;
}

uint32_t Reader::count(const char* what, uint64_t min_item_size) {
    const uint32_t n = u32(what);
    if (static_cast<uint64_t>(n) * min_item_size > left()) {
        fail(Msg() << what << " claims " << static_cast<unsigned long long>(n) << " entries but only "
                   << static_cast<unsigned long long>(left()) << " bytes are left");
    }
    return n;
}

py::object Reader::decode(const char* p, uint32_t n, const char* what) const {
    PyObject* s = PyUnicode_DecodeUTF8(p, static_cast<Py_ssize_t>(n), "strict");
    if (s == nullptr) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) throw py::error_already_set();
        PyErr_Clear();
        fail(Msg() << what << " is not valid utf-8");
    }
    return steal(s);
}

py::object Reader::string(const char* what) {
    const uint32_t n = u32(what);
    const char* p = take(n, what);
    return decode(p, n, what);
}

std::string_view Reader::utf8(const char* what) {
    const uint32_t n = u32(what);
    const char* p = take(n, what);
    for (uint32_t i = 0; i < n; ++i) {
        if ((static_cast<unsigned char>(p[i]) & 0x80u) != 0) {  // not ASCII: Python's decoder decides
            decode(p, n, what);
            break;
        }
    }
    return std::string_view(p, n);
}

std::vector<int64_t> Reader::dims(uint32_t n, const char* what) {
    std::vector<int64_t> v;
    v.reserve(n);
    for (uint32_t i = 0; i < n; ++i) v.push_back(static_cast<int64_t>(get_le(take(8, what), 8)));
    return v;
}

void put_len_u32(std::string& out, Py_ssize_t n) {
    if (n < 0 || static_cast<uint64_t>(n) > 0xFFFFFFFFull) {
        raise_format_error(Msg() << "length " << static_cast<long long>(n)
                                 << " does not fit the table format (at most 4294967295)");
    }
    put_u32(out, static_cast<uint32_t>(n));
}

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
