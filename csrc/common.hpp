// Shared helpers of the sparse_ckpt C++ core: reading the contract's lists, tuples and dicts,
// str building, and little-endian byte output.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "errors.hpp"

namespace py = pybind11;

namespace sckpt {

inline constexpr const char kMagic[] = "SCKT";
inline constexpr int kVersion = 1;
inline constexpr int kMaxDepth = 32;
/// The largest dtype item size (bytes) a table or layout records (complex128).
inline constexpr long long kMaxItemsize = 16;
// The key grammar of sparse_ckpt/_format/keys.py (tests/core/test_structure.py checks that they are equal).
#define SCKPT_STATE "state."
#define SCKPT_GROUPS "param_groups."
#define SCKPT_PACKED_MARKER "__packed__"
inline constexpr const char kPackedMarker[] = SCKPT_PACKED_MARKER;
inline constexpr const char kStatePrefix[] = SCKPT_STATE;
inline constexpr const char kGroupsPrefix[] = SCKPT_GROUPS;
inline constexpr const char kPackedPrefix[] = SCKPT_GROUPS SCKPT_PACKED_MARKER ".";
inline constexpr const char kScalarsPrefix[] = SCKPT_STATE SCKPT_PACKED_MARKER ".";
inline constexpr const char kEscape[] = "~";
inline constexpr const char kEscapeStr[] = "~s";
inline constexpr const char kEscapeInt[] = "~i";
inline constexpr const char kStepKey[] = "step";
inline constexpr const char kKeysEntry[] = "~keys";
inline constexpr const char kWrapperChild[] = "module";

/// Length of a string constant (without its NUL).
template <size_t N>
constexpr Py_ssize_t lit_len(const char (&)[N]) {
    return static_cast<Py_ssize_t>(N - 1);
}

// ------------------------------------------------------------------ references

/// Own a new reference; a NULL result means a Python error is set, which is rethrown.
inline py::object steal(PyObject* p) {
    if (p == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(p);
}

/// Take a new reference to a borrowed pointer.
inline py::object borrow(PyObject* p) { return py::reinterpret_borrow<py::object>(p); }

inline void check(int rc) {
    if (rc < 0) throw py::error_already_set();
}

inline void ensure_ready(PyObject* s) {
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(s) < 0) throw py::error_already_set();
#else
    (void)s;
#endif
}

// ------------------------------------------------------------------ messages

/// ``repr(obj)``
inline py::object py_repr(py::handle h) { return steal(PyObject_Repr(h.ptr())); }

/// ``f"{obj}"``: ``format(obj, "")`` (the object itself for an exact str).
inline py::object fmt(py::handle h) {
    if (PyUnicode_CheckExact(h.ptr())) return borrow(h.ptr());
    return steal(PyObject_Format(h.ptr(), nullptr));
}

/// ``type(obj).__name__`` as an f-string piece.
inline py::object type_name(py::handle h) {
    py::object name = steal(PyObject_GetAttrString(reinterpret_cast<PyObject*>(Py_TYPE(h.ptr())), "__name__"));
    return fmt(name);
}

/// Builds an exception message from UTF-8 literals, integers and Python str objects.
class Msg {
public:
    Msg() : parts_(steal(PyList_New(0))) {}
    Msg& operator<<(const char* s) { return add(steal(PyUnicode_FromString(s))); }
    Msg& operator<<(const std::string& s) {
        return add(steal(PyUnicode_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size()))));
    }
    Msg& operator<<(const py::object& str_obj) { return add(str_obj); }
    template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
    Msg& operator<<(T v) { return *this << std::to_string(v); }
    py::object str() const {
        py::object empty = steal(PyUnicode_FromStringAndSize("", 0));
        return steal(PyUnicode_Join(empty.ptr(), parts_.ptr()));
    }
    operator py::object() const { return str(); }  // NOLINT(google-explicit-constructor)

private:
    Msg& add(const py::object& piece) {
        check(PyList_Append(parts_.ptr(), piece.ptr()));
        return *this;
    }
    py::object parts_;
};

// ------------------------------------------------------------------ iteration
//
// The core's input contract (see sparse_ckpt/_core_py/common.py): sequences are lists or tuples,
// mappings are dicts (a subclass is read as a dict), pairs are tuples. The helpers below read
// exactly those and raise TypeError/ValueError for anything else; they never fall back to
// Python's generic protocols.

/// ``TypeError(f"expected {what}, got {type(obj).__name__}")``
[[noreturn]] void raise_type(const char* what, py::handle obj);

/// ``utf8``'s refusal: the pending UnicodeEncodeError of ``PyUnicode_AsUTF8AndSize`` as a
/// CheckpointFormatError ``f"{where()}: string is not valid unicode ({reason})"`` (another pending
/// error is re-raised as it is). ``where`` is called once the error is fetched (a message cannot
/// be built while an exception is set).
template <class Where>
[[noreturn]] void raise_unicode_error(Where&& where) {
    py::error_already_set err;
    if (!err.matches(PyExc_UnicodeEncodeError)) throw err;
    py::object reason = steal(PyObject_GetAttrString(err.value().ptr(), "reason"));
    raise_format_error(Msg() << where() << ": string is not valid unicode (" << fmt(reason) << ")");
}

/// ``for item in obj: f(item)`` for a list (read live, index by index) or a tuple. ``f`` may
/// return ``bool``; ``false`` stops the loop (like ``break``).
template <class F>
void iterate(py::handle obj, F&& f) {
    PyObject* o = obj.ptr();
    auto call = [&](py::handle item) -> bool {
        if constexpr (std::is_same_v<decltype(f(item)), bool>) {
            return f(item);
        } else {
            f(item);
            return true;
        }
    };
    if (PyList_Check(o)) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o); ++i) {
            py::object item = borrow(PyList_GET_ITEM(o, i));
            if (!call(item)) return;
        }
    } else if (PyTuple_Check(o)) {
        const Py_ssize_t n = PyTuple_GET_SIZE(o);
        for (Py_ssize_t i = 0; i < n; ++i) {
            py::object item = borrow(PyTuple_GET_ITEM(o, i));
            if (!call(item)) return;
        }
    } else {
        raise_type("a list or tuple", obj);
    }
}

/// ``a, b, ... = v`` for a tuple of exactly ``n`` items into ``out[0..n)``.
void unpack(py::handle v, int n, py::object* out);

/// ``for key, value in m.items(): f(key, value)`` for a dict (a subclass is read as a dict);
/// raises Python's RuntimeError when ``f`` resizes it.
template <class F>
void iterate_items(py::handle m, F&& f) {
    PyObject* d = m.ptr();
    if (!PyDict_Check(d)) raise_type("a dict", m);
    const Py_ssize_t size = PyDict_GET_SIZE(d);
    Py_ssize_t pos = 0;
    PyObject* k = nullptr;
    PyObject* v = nullptr;
    while (PyDict_Next(d, &pos, &k, &v)) {
        py::object key = borrow(k);
        py::object value = borrow(v);
        f(key, value);
        if (PyDict_GET_SIZE(d) != size) {
            raise_builtin(PyExc_RuntimeError, steal(PyUnicode_FromString("dictionary changed size during iteration")));
        }
    }
}

/// ``m.get(key)`` of a dict (a new reference; ``None`` when absent).
inline py::object dict_get(py::handle m, py::handle key) {
    if (!PyDict_Check(m.ptr())) raise_type("a dict", m);
    PyObject* v = PyDict_GetItemWithError(m.ptr(), key.ptr());
    if (v == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        return py::none();
    }
    return borrow(v);
}

/// ``len(obj)`` of a list, tuple or dict (the contract's containers).
inline Py_ssize_t length(py::handle obj) {
    PyObject* o = obj.ptr();
    if (PyList_Check(o)) return PyList_GET_SIZE(o);
    if (PyTuple_Check(o)) return PyTuple_GET_SIZE(o);
    if (PyDict_Check(o)) return PyDict_GET_SIZE(o);
    raise_type("a list, tuple or dict", obj);
}

/// ``k != "params"`` for a key of any type (``params`` is the interned ``"params"``).
bool not_params(PyObject* k, PyObject* params);

/// ``{k: v for k, v in group.items() if k != "params"}``
py::object copy_without_params(py::handle group, py::handle params_key);

// ------------------------------------------------------------------ identity map

/// ``id(obj) -> index`` keyed by object identity (``PyObject*``), like a dict keyed by ``id()``.
/// Open addressing with linear probing in one flat array: no allocation per entry. The caller
/// keeps every key object alive while the map is in use.
class IdMap {
public:
    explicit IdMap(size_t expected = 0) { rehash(capacity_for(expected)); }

    /// Insert ``key -> value`` unless present. Returns the key's value and whether it was inserted.
    std::pair<Py_ssize_t, bool> emplace(PyObject* key, Py_ssize_t value) {
        if ((size_ + 1) * 2 > slots_.size()) rehash(slots_.size() * 2);
        Slot& slot = slots_[probe(key)];
        if (slot.key != nullptr) return {slot.value, false};
        slot.key = key;
        slot.value = value;
        ++size_;
        return {value, true};
    }

    /// The value of ``key``, or nullptr when absent.
    const Py_ssize_t* find(PyObject* key) const {
        const Slot& slot = slots_[probe(key)];
        return slot.key != nullptr ? &slot.value : nullptr;
    }

private:
    struct Slot {
        PyObject* key = nullptr;
        Py_ssize_t value = 0;
    };

    static size_t capacity_for(size_t expected) {
        size_t cap = 16;
        while (cap < expected * 2) cap *= 2;
        return cap;
    }

    static size_t hash(PyObject* key) {
        uint64_t x = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(key));
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdULL;
        x ^= x >> 33;
        return static_cast<size_t>(x);
    }

    /// Index of ``key``'s slot, or of the empty slot where it would go.
    size_t probe(PyObject* key) const {
        const size_t mask = slots_.size() - 1;
        size_t i = hash(key) & mask;
        while (slots_[i].key != nullptr && slots_[i].key != key) i = (i + 1) & mask;
        return i;
    }

    void rehash(size_t capacity) {
        std::vector<Slot> old(capacity);
        old.swap(slots_);
        for (const Slot& s : old) {
            if (s.key != nullptr) slots_[probe(s.key)] = s;
        }
    }

    std::vector<Slot> slots_;
    size_t size_ = 0;
};

// ------------------------------------------------------------------ strings

/// Concatenate str objects (any str subclass) into one new exact str.
py::object concat(std::initializer_list<PyObject*> parts);

/// ``s.startswith(lit)`` for an ASCII literal, without creating objects.
inline bool starts_with(PyObject* s, const char* lit, Py_ssize_t n) {
    ensure_ready(s);
    if (PyUnicode_GET_LENGTH(s) < n) return false;
    const int kind = PyUnicode_KIND(s);
    const void* data = PyUnicode_DATA(s);
    if (kind == PyUnicode_1BYTE_KIND) return std::memcmp(data, lit, static_cast<size_t>(n)) == 0;  // lit is ASCII
    for (Py_ssize_t i = 0; i < n; ++i) {
        if (PyUnicode_READ(kind, data, i) != static_cast<Py_UCS4>(static_cast<unsigned char>(lit[i]))) return false;
    }
    return true;
}

// ------------------------------------------------------------------ bytes out

inline void put_u8(std::string& out, uint8_t v) { out.push_back(static_cast<char>(v)); }
inline void put_le(std::string& out, uint64_t v, int nbytes) {
    char buf[8];
    for (int i = 0; i < nbytes; ++i) buf[i] = static_cast<char>((v >> (8 * i)) & 0xFFu);
    out.append(buf, static_cast<size_t>(nbytes));
}
inline void put_u16(std::string& out, uint16_t v) { put_le(out, v, 2); }
inline void put_u32(std::string& out, uint32_t v) { put_le(out, v, 4); }
inline void put_u64(std::string& out, uint64_t v) { put_le(out, v, 8); }
inline void put_i64(std::string& out, int64_t v) { put_le(out, static_cast<uint64_t>(v), 8); }
inline void put_f64(std::string& out, double v) {
    uint64_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    put_le(out, bits, 8);
}
/// ``_core_py.common.len32(n)``: a length as u32; a length the table format cannot hold is a
/// CheckpointFormatError.
void put_len_u32(std::string& out, Py_ssize_t n);

inline uint64_t get_le(const char* p, int nbytes) {
    uint64_t v = 0;
    for (int i = 0; i < nbytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
    return v;
}

// ------------------------------------------------------------------ bytes in

/// ``_core_py.common.Reader``: reads ``data`` from the start for the decoders (group tables,
/// layout tables). Every read checks the remaining length first and every count is checked
/// against the remaining bytes before anything is allocated; a defect is a CheckpointFormatError
/// ``{where}: {what} at byte {pos}`` (``noun`` names what is read in truncation messages).
class Reader {
public:
    Reader(std::string_view data, py::object where, const char* noun = "table")
        : data_(data), where_(std::move(where)), noun_(noun) {}

    size_t pos() const { return pos_; }
    size_t size() const { return data_.size(); }
    size_t left() const { return data_.size() - pos_; }

    [[noreturn]] void fail(const py::object& what) const;
    const char* take(uint64_t n, const char* what);
    /// The magic bytes and the u16 version that open a table (``what``: what the magic says it is).
    /// The magic and the u16 version; versions ``oldest`` (0: ``version``) to ``version`` are read.
    unsigned header(std::string_view magic, unsigned version, const char* what, unsigned oldest = 0);
    uint8_t u8(const char* what) { return static_cast<uint8_t>(*take(1, what)); }
    uint32_t u32(const char* what) { return static_cast<uint32_t>(get_le(take(4, what), 4)); }
    uint64_t u64(const char* what) { return get_le(take(8, what), 8); }
    uint32_t count(const char* what, uint64_t min_item_size);
    py::object string(const char* what);
    /// ``string``'s UTF-8 bytes, checked as ``string`` checks them, without making the str (a view
    /// into the data, valid while the data lives).
    std::string_view utf8(const char* what);
    /// ``n`` little-endian int64 values.
    std::vector<int64_t> dims(uint32_t n, const char* what);

private:
    /// ``n`` bytes at ``p`` (just read) decoded as strict UTF-8; invalid text fails as ``what``.
    py::object decode(const char* p, uint32_t n, const char* what) const;

    std::string_view data_;
    py::object where_;
    const char* noun_;
    size_t pos_ = 0;
};

}  // namespace sckpt
