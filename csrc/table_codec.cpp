// encode_settings / encode_table / decode_table: the group-table codec (versions 1 and 2) (twin of
// sparse_ckpt/_core_py/table_codec.py). The format is specified in docs/formats.md ("Table codec").
// The decoder checks the remaining length before every read and every count against the
// remaining bytes before allocating, so a corrupt or hostile table never over-reads or
// over-allocates.
#include <deque>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core.hpp"

namespace sckpt {

namespace {

enum Tag : uint8_t {
    kTagNone = 0,
    kTagFalse = 1,
    kTagTrue = 2,
    kTagInt = 3,
    kTagFloat = 4,
    kTagStr = 5,
    kTagBytes = 6,
    kTagTuple = 7,
    kTagList = 8,
    kTagTensor = 9,
    kTagDtype = 10,   // named values: tables of version kNamedVersion only
    kTagDevice = 11,
};

/// ``NAMED_VERSION``: a table holding a named value (dtype, device); others are version ``kVersion``.
constexpr unsigned kNamedVersion = 2;

// ------------------------------------------------------------------ encoding

/// The ``where`` of an encode error, built only when an error is raised:
/// ``leaf {leaf!r} group {group}`` plus `` key {key!r}`` when ``key`` is set.
/// With ``fqn`` set (a scalar-table record): ``leaf {leaf!r}: state {key!r} of {fqn!r}``.
struct Where {
    py::handle leaf;
    py::handle group_obj;      // formatted with format() when set
    Py_ssize_t group_num = 0;  // used when group_obj is not set
    py::handle key;            // optional
    py::handle fqn;            // set for a scalar-table record

    py::object str() const {
        Msg m;
        if (fqn) {
            m << "leaf " << py_repr(leaf) << ": state " << py_repr(key) << " of " << py_repr(fqn);
            return m.str();
        }
        m << "leaf " << py_repr(leaf) << " group ";
        if (group_obj) {
            m << fmt(group_obj);
        } else {
            m << static_cast<long long>(group_num);
        }
        if (key) m << " key " << py_repr(key);
        return m.str();
    }
};

/// ``out += data`` for the ``bytes`` a ``to_parts`` callback returns.
void append_bytes(std::string& out, py::handle data) {
    if (!PyBytes_Check(data.ptr())) raise_type("tensor data as bytes", data);
    out.append(PyBytes_AS_STRING(data.ptr()), static_cast<size_t>(PyBytes_GET_SIZE(data.ptr())));
}

/// ``_I64.pack(dim)`` of a tensor dimension (an int of 64 bits).
int64_t pack_i64(py::handle dim) {
    if (!PyLong_Check(dim.ptr())) raise_type("an int tensor dimension", dim);
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(dim.ptr(), &overflow);
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (overflow) raise_builtin(PyExc_ValueError, Msg() << "expected a tensor dimension of 64 bits, got " << fmt(dim));
    return static_cast<int64_t>(v);
}

class Encoder {
public:
    Encoder(py::handle tensor_type, py::handle to_parts, py::handle to_name)
        : tensor_type_(tensor_type), to_parts_(to_parts), to_name_(to_name) {}

    /// Whether a named value (dtype, device) was written (``named[0]`` of the twin).
    bool named() const { return named_; }

    /// ``_encode_str``
    void str(std::string& out, py::handle text, const Where& where) const {
        PyObject* t = text.ptr();
        if (!PyUnicode_Check(t)) raise_type("a str", text);
        Py_ssize_t n = 0;
        const char* s = PyUnicode_AsUTF8AndSize(t, &n);
        if (s == nullptr) raise_unicode_error([&] { return where.str(); });
        put_len_u32(out, n);
        out.append(s, static_cast<size_t>(n));
    }

    /// ``_encode_value``
    void value(std::string& out, py::handle v, const Where& where, int depth) const {
        if (depth > kMaxDepth) {
            raise_format_error(Msg() << where.str() << ": value nested deeper than " << kMaxDepth << " levels");
        }
        PyObject* o = v.ptr();
        if (o == Py_None) {
            put_u8(out, kTagNone);
        } else if (const char* base = subclass_base(o)) {
            refuse_subclass(v, base, where);
        } else if (PyBool_Check(o)) {
            put_u8(out, o == Py_True ? kTagTrue : kTagFalse);
        } else if (PyLong_Check(o)) {
            int overflow = 0;
            const long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
            if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
            if (overflow) {
                raise_format_error(Msg() << where.str() << ": int " << fmt(v) << " does not fit in 64 bits");
            }
            put_u8(out, kTagInt);
            put_i64(out, static_cast<int64_t>(x));
        } else if (PyFloat_Check(o)) {
            put_u8(out, kTagFloat);
            put_f64(out, PyFloat_AS_DOUBLE(o));
        } else if (PyUnicode_Check(o)) {
            put_u8(out, kTagStr);
            str(out, v, where);
        } else if (PyBytes_Check(o)) {
            put_u8(out, kTagBytes);
            put_len_u32(out, PyBytes_GET_SIZE(o));
            out.append(PyBytes_AS_STRING(o), static_cast<size_t>(PyBytes_GET_SIZE(o)));
        } else if (PyTuple_Check(o) || PyList_Check(o)) {
            put_u8(out, PyTuple_Check(o) ? kTagTuple : kTagList);
            put_len_u32(out, length(v));
            iterate(v, [&](py::handle item) { value(out, item, where, depth + 1); });
        } else {
            const int is_tensor = PyObject_IsInstance(o, tensor_type_.ptr());
            check(is_tensor);
            if (is_tensor) {
                tensor(out, v, where);
            } else {
                named_value(out, v, where);
            }
        }
    }

    /// ``_encode_tensor_parts``: a tensor value from its ``(dtype, shape, device_type, data)``.
    void tensor_parts(std::string& out, py::handle parts, const Where& where) const {
        py::object p[4];  // dtype, shape, device_type, data
        unpack(parts, 4, p);
        put_u8(out, kTagTensor);
        str(out, p[0], where);
        put_len_u32(out, length(p[1]));
        iterate(p[1], [&](py::handle dim) { put_i64(out, pack_i64(dim)); });
        str(out, p[2], where);
        if (!PyBytes_Check(p[3].ptr())) raise_type("tensor data as bytes", p[3]);
        put_u64(out, static_cast<uint64_t>(PyBytes_GET_SIZE(p[3].ptr())));
        append_bytes(out, p[3]);
    }

private:
    /// ``_refuse_subclass``'s test: the base name when ``o`` is of a strict subclass of a kind the
    /// codec writes itself (it would decode as the base type), else ``nullptr``.
    static const char* subclass_base(PyObject* o) {
        if (PyLong_CheckExact(o) || PyFloat_CheckExact(o) || PyUnicode_CheckExact(o) || PyBytes_CheckExact(o) ||
            PyTuple_CheckExact(o) || PyList_CheckExact(o) || PyBool_Check(o)) {
            return nullptr;
        }
        if (PyLong_Check(o)) return "int";
        if (PyFloat_Check(o)) return "float";
        if (PyUnicode_Check(o)) return "str";
        if (PyBytes_Check(o)) return "bytes";
        if (PyTuple_Check(o)) return "tuple";
        if (PyList_Check(o)) return "list";
        return nullptr;
    }

    /// ``_refuse_subclass``
    [[noreturn]] static void refuse_subclass(py::handle v, const char* base, const Where& where) {
        PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(v.ptr()));
        py::object module = steal(PyObject_GetAttrString(type, "__module__"));
        py::object qualname = steal(PyObject_GetAttrString(type, "__qualname__"));
        raise_format_error(Msg() << where.str() << ": a value of type " << fmt(module) << "." << fmt(qualname)
                                 << " (a subclass of " << base << ") would load back as a plain " << base
                                 << "; set it to a plain " << base << " (e.g. " << base << "(value)) before saving");
    }

    void tensor(std::string& out, py::handle v, const Where& where) const {
        py::object parts = steal(PyObject_CallOneArg(to_parts_.ptr(), v.ptr()));
        tensor_parts(out, parts, where);
    }

    /// A value of no built-in kind: ``to_name(v)`` is ``None`` (refused) or ``(kind, text)``.
    void named_value(std::string& out, py::handle v, const Where& where) const {
        py::object name = to_name_.is_none() ? py::none() : steal(PyObject_CallOneArg(to_name_.ptr(), v.ptr()));
        if (name.is_none()) {
            raise_format_error(Msg() << where.str() << ": unsupported value type " << type_name(v));
        }
        PyObject* n = name.ptr();
        uint8_t tag = 0;
        if (PyTuple_CheckExact(n) && PyTuple_GET_SIZE(n) == 2 && PyUnicode_CheckExact(PyTuple_GET_ITEM(n, 0)) &&
            PyUnicode_CheckExact(PyTuple_GET_ITEM(n, 1))) {
            PyObject* kind = PyTuple_GET_ITEM(n, 0);
            if (PyUnicode_CompareWithASCIIString(kind, "dtype") == 0) {
                tag = kTagDtype;
            } else if (PyUnicode_CompareWithASCIIString(kind, "device") == 0) {
                tag = kTagDevice;
            }
        }
        if (tag == 0) {
            raise_builtin(PyExc_TypeError,
                          Msg() << "to_name must return None or a ('dtype' or 'device', str) tuple, got " << py_repr(name));
        }
        put_u8(out, tag);
        py::object text = borrow(PyTuple_GET_ITEM(n, 1));
        str(out, text, where);
        named_ = true;
    }

    py::handle tensor_type_;
    py::handle to_parts_;
    py::handle to_name_;
    mutable bool named_ = false;
};

/// ``encode_settings`` into ``out``; ``where`` carries leaf and group.
void encode_settings_into(std::string& out, const Encoder& enc, py::handle settings, Where where) {
    put_len_u32(out, length(settings));
    iterate_items(settings, [&](py::handle key, py::handle value) {
        if (!PyUnicode_Check(key.ptr())) {
            Where group_only = where;
            group_only.key = py::handle();
            raise_format_error(Msg() << group_only.str() << ": setting key " << py_repr(key) << " is not a string");
        }
        where.key = key;
        enc.str(out, key, where);
        enc.value(out, value, where, 0);
    });
}

// ------------------------------------------------------------------ decoding

/// ``_decode_value``; ``from_name`` is null in a version-1 table (which holds no named value).
py::object decode_value(Reader& r, py::handle from_parts, py::handle from_name, int depth) {
    if (depth > kMaxDepth) r.fail(Msg() << "value nested deeper than " << kMaxDepth << " levels");
    const uint8_t tag = r.u8("value tag");
    switch (tag) {
        case kTagNone:
            return py::none();
        case kTagFalse:
            return borrow(Py_False);
        case kTagTrue:
            return borrow(Py_True);
        case kTagInt:
            return steal(PyLong_FromLongLong(static_cast<long long>(static_cast<int64_t>(get_le(r.take(8, "int"), 8)))));
        case kTagFloat: {
            const uint64_t bits = get_le(r.take(8, "float"), 8);
            double d;
            std::memcpy(&d, &bits, sizeof d);
            return steal(PyFloat_FromDouble(d));
        }
        case kTagStr:
            return r.string("str value");
        case kTagBytes: {
            const uint32_t n = r.u32("bytes length");
            const char* p = r.take(n, "bytes value");
            return steal(PyBytes_FromStringAndSize(p, static_cast<Py_ssize_t>(n)));
        }
        case kTagTuple:
        case kTagList: {
            const Py_ssize_t n = static_cast<Py_ssize_t>(r.count("sequence", 1));
            // n <= bytes left: the allocation is bounded by the table's size.
            const bool is_tuple = tag == kTagTuple;
            py::object seq = steal(is_tuple ? PyTuple_New(n) : PyList_New(n));
            for (Py_ssize_t i = 0; i < n; ++i) {
                PyObject* item = decode_value(r, from_parts, from_name, depth + 1).release().ptr();
                if (is_tuple) {
                    PyTuple_SET_ITEM(seq.ptr(), i, item);
                } else {
                    PyList_SET_ITEM(seq.ptr(), i, item);
                }
            }
            return seq;
        }
        case kTagTensor: {
            py::object dtype = r.string("tensor dtype");
            const Py_ssize_t ndim = static_cast<Py_ssize_t>(r.count("tensor shape", 8));
            py::object shape = steal(PyTuple_New(ndim));
            for (Py_ssize_t i = 0; i < ndim; ++i) {
                const int64_t dim = static_cast<int64_t>(get_le(r.take(8, "tensor dim"), 8));
                PyTuple_SET_ITEM(shape.ptr(), i, steal(PyLong_FromLongLong(dim)).release().ptr());
            }
            py::object device_type = r.string("tensor device");
            const uint64_t nbytes = get_le(r.take(8, "tensor byte count"), 8);
            const char* p = r.take(nbytes, "tensor data");
            py::object data = steal(PyBytes_FromStringAndSize(p, static_cast<Py_ssize_t>(nbytes)));
            try {
                return steal(PyObject_CallFunctionObjArgs(from_parts.ptr(), dtype.ptr(), shape.ptr(),
                                                          device_type.ptr(), data.ptr(), nullptr));
            } catch (py::error_already_set& err) {
                if (matches_sc(err, "CheckpointFormatError") || !err.matches(PyExc_Exception)) throw;
                py::object text = steal(PyObject_Str(err.value().ptr()));
                r.fail(Msg() << "bad tensor (" << text << ")");
            }
        }
        case kTagDtype:
        case kTagDevice: {
            if (!from_name) break;
            const char* kind = tag == kTagDtype ? "dtype" : "device";
            py::object text = r.string(tag == kTagDtype ? "dtype name" : "device name");
            py::object kind_obj = steal(PyUnicode_FromString(kind));
            try {
                return steal(PyObject_CallFunctionObjArgs(from_name.ptr(), kind_obj.ptr(), text.ptr(), nullptr));
            } catch (py::error_already_set& err) {
                if (matches_sc(err, "CheckpointFormatError") || !err.matches(PyExc_Exception)) throw;
                py::object why = steal(PyObject_Str(err.value().ptr()));
                r.fail(Msg() << "bad " << kind << " " << py_repr(text) << " (" << why << ")");
            }
        }
        default:
            break;
    }
    r.fail(Msg() << "unknown value tag " << static_cast<unsigned>(tag));
}

}  // namespace

namespace {

/// ``_core_py.table_codec.check_cpu_dtypes``
void check_cpu_dtypes(py::handle cpu_dtypes) {
    PyObject* d = cpu_dtypes.ptr();
    if (!PyDict_CheckExact(d)) {
        raise_builtin(PyExc_TypeError, Msg() << "flatten_packed_state: cpu_dtypes must be a dict, got "
                                             << type_name(cpu_dtypes));
    }
    Py_ssize_t pos = 0;
    PyObject* k = nullptr;
    PyObject* v = nullptr;
    while (PyDict_Next(d, &pos, &k, &v)) {
        bool ok = PyTuple_CheckExact(v) && PyTuple_GET_SIZE(v) == 2 && PyUnicode_CheckExact(PyTuple_GET_ITEM(v, 0)) &&
                  PyLong_CheckExact(PyTuple_GET_ITEM(v, 1));
        if (ok) {
            int overflow = 0;
            const long long size = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(v, 1), &overflow);
            if (size == -1 && PyErr_Occurred()) throw py::error_already_set();
            ok = overflow == 0 && size >= 1 && size <= kMaxItemsize;
        }
        if (!ok) {
            py::object spec = borrow(v);
            raise_builtin(PyExc_TypeError,
                          Msg() << "flatten_packed_state: cpu_dtypes values must be (str, int) tuples with an item "
                                   "size from 1 to "
                                << kMaxItemsize << ", got " << py_repr(spec));
        }
    }
}

py::object intern(const char* name) { return steal(PyUnicode_InternFromString(name)); }

/// ``_core_py.table_codec._cpu_scalar_data``: true with the dtype name and the element's bytes when the
/// 0-d tensor ``o`` is a plain CPU scalar of a ``cpu_dtypes`` dtype.
bool cpu_scalar_data(PyObject* o, const ScalarSpec& spec, py::object& name, std::string& data) {
    py::object dtype = spec.dtype.get(o);
    PyObject* entry = PyDict_GetItemWithError(spec.cpu_dtypes.ptr(), dtype.ptr());
    if (entry == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        return false;
    }
    py::object held = borrow(entry);  // the dict may change while the tensor's attributes are read
    if (spec.requires_grad.get(o).ptr() != Py_False) return false;
    if (spec.is_cpu.get(o).ptr() != Py_True) return false;
    if (spec.layout.get(o).ptr() != spec.strided.ptr()) return false;
    if (steal(PyObject_CallMethodNoArgs(o, spec.is_neg.ptr())).ptr() != Py_False) return false;
    py::object ptr = steal(PyObject_CallMethodNoArgs(o, spec.data_ptr.ptr()));
    if (!PyLong_CheckExact(ptr.ptr())) return false;
    int overflow = 0;
    const long long address = PyLong_AsLongLongAndOverflow(ptr.ptr(), &overflow);
    if (address == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (overflow != 0 || address <= 0) return false;
    name = borrow(PyTuple_GET_ITEM(held.ptr(), 0));
    const long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(held.ptr(), 1));  // 1..16, checked up front
    data.assign(reinterpret_cast<const char*>(static_cast<uintptr_t>(address)), static_cast<size_t>(size));
    return true;
}

}  // namespace

TypeAttr::TypeAttr(py::handle type, const char* name) : name_(intern(name)) {
    if (!PyType_Check(type.ptr())) return;
    auto* t = reinterpret_cast<PyTypeObject*>(type.ptr());
    if (t->tp_getattro != PyObject_GenericGetAttr) return;
    PyObject* d = _PyType_Lookup(t, name_.ptr());  // borrowed; no exception set
    if (d == nullptr || Py_TYPE(d)->tp_descr_get == nullptr || Py_TYPE(d)->tp_descr_set == nullptr) return;
    type_ = borrow(type.ptr());
    descr_ = borrow(d);
    get_ = Py_TYPE(d)->tp_descr_get;
}

ScalarSpec::ScalarSpec(py::handle tensor_type_, py::handle cpu_dtypes_, py::handle strided_, py::handle scalar_parts_)
    : tensor_type(tensor_type_),
      cpu_dtypes(cpu_dtypes_),
      strided(strided_),
      scalar_parts(scalar_parts_),
      ndim(tensor_type_, "ndim"),
      dtype(tensor_type_, "dtype"),
      requires_grad(tensor_type_, "requires_grad"),
      is_cpu(tensor_type_, "is_cpu"),
      layout(tensor_type_, "layout"),
      is_neg(intern("is_neg")),
      data_ptr(intern("data_ptr")) {
    check_cpu_dtypes(cpu_dtypes);
}

bool encode_scalar_record(std::string& out, py::handle leaf, py::handle fqn, py::handle key, py::handle value,
                          const ScalarSpec& spec) {
    Py_ssize_t n = 0;
    const char* raw = PyUnicode_AsUTF8AndSize(key.ptr(), &n);
    if (raw == nullptr) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) throw py::error_already_set();
        PyErr_Clear();
        return false;
    }
    const size_t start = out.size();
    put_len_u32(out, n);
    out.append(raw, static_cast<size_t>(n));
    PyObject* o = value.ptr();
    PyTypeObject* kind = Py_TYPE(o);
    if (kind == &PyBool_Type) {
        put_u8(out, o == Py_True ? kTagTrue : kTagFalse);
    } else if (kind == &PyLong_Type) {
        int overflow = 0;
        const long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
        if (overflow) {
            out.resize(start);
            return false;
        }
        put_u8(out, kTagInt);
        put_i64(out, static_cast<int64_t>(x));
    } else if (kind == &PyFloat_Type) {
        put_u8(out, kTagFloat);
        put_f64(out, PyFloat_AS_DOUBLE(o));
    } else if (reinterpret_cast<PyObject*>(kind) == spec.tensor_type.ptr()) {
        py::object ndim = spec.ndim.get(o);
        bool zero = false;
        if (PyLong_CheckExact(ndim.ptr())) {
            int overflow = 0;
            const long long d = PyLong_AsLongLongAndOverflow(ndim.ptr(), &overflow);
            if (d == -1 && PyErr_Occurred()) throw py::error_already_set();
            zero = overflow == 0 && d == 0;
        }
        if (!zero) {
            out.resize(start);
            return false;
        }
        Where where;
        where.leaf = leaf;
        where.key = key;
        where.fqn = fqn;
        const Encoder enc(spec.tensor_type, py::none(), py::none());
        py::object name;
        std::string data;
        if (cpu_scalar_data(o, spec, name, data)) {
            put_u8(out, kTagTensor);
            enc.str(out, name, where);
            put_u32(out, 0);  // shape ()
            put_u32(out, 3);
            out.append("cpu", 3);
            put_u64(out, static_cast<uint64_t>(data.size()));
            out += data;
        } else {
            py::object parts = steal(PyObject_CallOneArg(spec.scalar_parts.ptr(), o));
            if (parts.is_none()) {
                out.resize(start);
                return false;
            }
            enc.tensor_parts(out, parts, where);
        }
    } else {
        out.resize(start);
        return false;
    }
    return true;
}

py::bytes encode_settings(py::object leaf, py::object group_index, py::object settings, py::object tensor_type,
                          py::object to_parts, py::object to_name) {
    Encoder enc(tensor_type, to_parts, to_name);
    std::string out;
    Where where;
    where.leaf = leaf;
    where.group_obj = group_index;
    encode_settings_into(out, enc, settings, where);
    return steal(PyBytes_FromStringAndSize(out.data(), static_cast<Py_ssize_t>(out.size())));
}

py::bytes encode_table(py::object leaf, py::object groups_fqn, py::object tensor_type, py::object to_parts,
                       py::object to_name) {
    if (!PyUnicode_Check(leaf.ptr())) {
        raise_format_error(Msg() << "leaf name " << py_repr(leaf) << " is not a string");
    }
    Encoder enc(tensor_type, to_parts, to_name);
    std::deque<std::string> blobs;  // stable addresses for the string_view keys below
    std::unordered_map<std::string_view, uint32_t> index_of;
    std::vector<uint32_t> refs;
    size_t blob_bytes = 0;
    if (PyList_CheckExact(groups_fqn.ptr())) {
        const auto n = static_cast<size_t>(PyList_GET_SIZE(groups_fqn.ptr()));
        refs.reserve(n);
        index_of.reserve(n);
    }
    std::string blob;
    IdMap index_of_id;  // settings object -> its index (``_core_py``'s index_of_id)
    Py_ssize_t gi = 0;
    iterate(groups_fqn, [&](py::handle entry) {
        py::object parts[2];
        unpack(entry, 2, parts);
        if (const Py_ssize_t* known = index_of_id.find(parts[0].ptr())) {  // this settings object again
            refs.push_back(static_cast<uint32_t>(*known));
            ++gi;
            return;
        }
        Where where;
        where.leaf = leaf;
        where.group_num = gi;
        blob.clear();
        encode_settings_into(blob, enc, parts[0], where);
        auto found = index_of.find(std::string_view(blob));
        uint32_t idx;
        if (found == index_of.end()) {
            idx = static_cast<uint32_t>(blobs.size());
            blobs.push_back(blob);
            blob_bytes += blob.size();
            index_of.emplace(std::string_view(blobs.back()), idx);
        } else {
            idx = found->second;
        }
        index_of_id.emplace(parts[0].ptr(), idx);  // alive in groups_fqn for the whole call
        refs.push_back(idx);
        ++gi;
    });

    std::string out;
    out.reserve(16 + blob_bytes + refs.size() * 64);
    out.append(kMagic, 4);
    put_u16(out, static_cast<uint16_t>(enc.named() ? kNamedVersion : static_cast<unsigned>(kVersion)));
    put_len_u32(out, static_cast<Py_ssize_t>(blobs.size()));
    for (const std::string& b : blobs) out += b;
    put_len_u32(out, length(groups_fqn));
    size_t i = 0;
    // zip(groups_fqn, refs): iterates groups_fqn again and stops at the shorter of the two.
    iterate(groups_fqn, [&](py::handle entry) -> bool {
        if (i >= refs.size()) return false;
        py::object parts[2];
        unpack(entry, 2, parts);
        put_u32(out, refs[i]);
        put_len_u32(out, length(parts[1]));
        Where where;
        where.leaf = leaf;
        where.group_num = static_cast<Py_ssize_t>(i);
        iterate(parts[1], [&](py::handle fqn) {
            if (!PyUnicode_Check(fqn.ptr())) {
                raise_format_error(Msg() << where.str() << ": FQN " << py_repr(fqn) << " is not a string");
            }
            enc.str(out, fqn, where);
        });
        ++i;
        return true;
    });
    return steal(PyBytes_FromStringAndSize(out.data(), static_cast<Py_ssize_t>(out.size())));
}

py::tuple decode_table(py::object leaf, py::object data, py::object from_parts, py::object from_name) {
    if (!PyBytes_Check(data.ptr())) {
        raise_format_error(Msg() << "leaf " << py_repr(leaf) << ": group table is a " << type_name(data)
                                 << ", expected bytes");
    }
    const char* base = PyBytes_AS_STRING(data.ptr());
    const auto size = static_cast<size_t>(PyBytes_GET_SIZE(data.ptr()));
    Reader r(std::string_view(base, size), Msg() << "leaf " << py_repr(leaf) << " group table");
    const unsigned version = r.header(std::string_view(kMagic, 4), kNamedVersion, "a sparse_ckpt table", kVersion);
    const py::handle named = version >= kNamedVersion && !from_name.is_none() ? py::handle(from_name) : py::handle();
    const uint32_t n_settings = r.count("settings list", 4);
    py::object settings = steal(PyList_New(static_cast<Py_ssize_t>(n_settings)));
    py::object blobs = steal(PyList_New(static_cast<Py_ssize_t>(n_settings)));
    for (uint32_t i = 0; i < n_settings; ++i) {
        const size_t start = r.pos();
        const uint32_t n_keys = r.count("settings keys", 5);
        py::object entry = steal(PyDict_New());
        for (uint32_t k = 0; k < n_keys; ++k) {
            py::object key = r.string("setting key");
            const int dup = PyDict_Contains(entry.ptr(), key.ptr());
            check(dup);
            if (dup) r.fail(Msg() << "duplicate setting key " << py_repr(key));
            py::object value = decode_value(r, from_parts, named, 0);
            check(PyDict_SetItem(entry.ptr(), key.ptr(), value.ptr()));
        }
        PyList_SET_ITEM(settings.ptr(), static_cast<Py_ssize_t>(i), entry.release().ptr());
        PyObject* blob = PyBytes_FromStringAndSize(base + start, static_cast<Py_ssize_t>(r.pos() - start));
        PyList_SET_ITEM(blobs.ptr(), static_cast<Py_ssize_t>(i), steal(blob).release().ptr());
    }
    const uint32_t n_groups = r.count("group list", 8);
    py::object groups = steal(PyList_New(static_cast<Py_ssize_t>(n_groups)));
    for (uint32_t g = 0; g < n_groups; ++g) {
        const uint32_t idx = r.u32("group settings index");
        if (idx >= n_settings) {
            r.fail(Msg() << "group refers to settings " << static_cast<unsigned long long>(idx) << " of "
                         << static_cast<unsigned long long>(n_settings));
        }
        const uint32_t n_params = r.count("group params", 4);
        py::object fqns = steal(PyList_New(static_cast<Py_ssize_t>(n_params)));
        for (uint32_t p = 0; p < n_params; ++p) {
            PyList_SET_ITEM(fqns.ptr(), static_cast<Py_ssize_t>(p), r.string("FQN").release().ptr());
        }
        py::object idx_obj = steal(PyLong_FromUnsignedLong(idx));
        PyList_SET_ITEM(groups.ptr(), static_cast<Py_ssize_t>(g), py::make_tuple(idx_obj, fqns).release().ptr());
    }
    if (r.pos() != size) {
        r.fail(Msg() << static_cast<unsigned long long>(size - r.pos()) << " trailing bytes after the table");
    }
    return py::make_tuple(settings, blobs, groups);
}

}  // namespace sckpt
