// collect_plain: the save-time pass that picks a leaf's parameter-shaped state tensors for the
// buffers layout (the per-state-tensor loop of sparse_ckpt._layouts.bucketed.collect). Twin of
// sparse_ckpt/_core_py/bucket_collect.py.
#include "core.hpp"

namespace sckpt {

namespace {

/// ``bool(o)``, as an ``if`` statement tests it.
bool truthy(PyObject* o) {
    if (o == Py_True) return true;
    if (o == Py_False || o == Py_None) return false;
    const int truth = PyObject_IsTrue(o);
    check(truth);
    return truth != 0;
}

/// ``bool(a <op> b)``: Python's comparison and truth test, as an ``if`` statement does them
/// (no identity shortcut, unlike ``PyObject_RichCompareBool``).
bool compare(PyObject* a, PyObject* b, int op) {
    py::object r = steal(PyObject_RichCompare(a, b, op));
    return truthy(r.ptr());
}

/// ``prefix + part`` (a new exact str when ``part`` is an exact str; else what Python's ``+`` does).
py::object join(PyObject* prefix, PyObject* part) {
    if (PyUnicode_CheckExact(part)) return concat({prefix, part});
    return steal(PyNumber_Add(prefix, part));
}

/// ``key in items`` / ``del items[key]`` of the leaf's items dict.
bool items_contain(py::handle items, PyObject* key) {
    if (!PyDict_Check(items.ptr())) raise_type("a dict", items);
    const int found = PyDict_Contains(items.ptr(), key);
    check(found);
    return found != 0;
}

/// Python's ``plain_address``: the value's data address (an int) where it is a plain contiguous CPU
/// tensor without conj/neg bits, else None; the same reads in the same order.
class PlainAddress {
public:
    explicit PlainAddress(py::handle tensor_type)
        : is_cpu_(tensor_type, "is_cpu"),
          is_contiguous_(steal(PyUnicode_InternFromString("is_contiguous"))),
          is_conj_(steal(PyUnicode_InternFromString("is_conj"))),
          is_neg_(steal(PyUnicode_InternFromString("is_neg"))),
          data_ptr_(steal(PyUnicode_InternFromString("data_ptr"))) {}

    py::object of(PyObject* v) const {
        if (!truthy(is_cpu_.get(v).ptr()) || !called_true(v, is_contiguous_)) return py::none();
        if (called_true(v, is_conj_) || called_true(v, is_neg_)) return py::none();
        return steal(PyObject_CallMethodNoArgs(v, data_ptr_.ptr()));
    }

private:
    /// ``bool(v.<name>())``.
    static bool called_true(PyObject* v, const py::object& name) {
        py::object r = steal(PyObject_CallMethodNoArgs(v, name.ptr()));
        return truthy(r.ptr());
    }
    TypeAttr is_cpu_;
    py::object is_contiguous_, is_conj_, is_neg_, data_ptr_;
};

}  // namespace

py::tuple collect_plain(py::object state_fqn, py::object items, py::object param_of, py::object tensor_type,
                        py::object dtensor_type, py::object strided, py::object parts, py::object part_of,
                        py::object wholes, py::object whole, py::object spec_of, py::object sharded,
                        py::object addresses) {
    if (!addresses.is_none() && !PyList_Check(addresses.ptr())) raise_type("a list or None", addresses);
    const PlainAddress address_of(tensor_type);
    py::object entries = steal(PyList_New(0));
    py::object local = steal(PyList_New(0));
    py::object state_prefix = steal(PyUnicode_FromString(kStatePrefix));
    py::object dot = steal(PyUnicode_FromString("."));
    py::object element_size = steal(PyUnicode_InternFromString("element_size"));
    py::object shape_name = steal(PyUnicode_InternFromString("shape"));
    const TypeAttr shape_of(tensor_type, "shape");
    const TypeAttr layout_of(tensor_type, "layout");
    const TypeAttr is_meta_of(tensor_type, "is_meta");
    const TypeAttr dtype_of(tensor_type, "dtype");
    PyObject* const tensor = tensor_type.ptr();
    // the last taken-or-sized value's dtype, and its spec_of: (name, item size, limit)
    py::object dtype = py::none();
    py::object spec[3] = {steal(PyUnicode_FromString("")), steal(PyLong_FromLong(0)), py::none()};
    iterate_items(state_fqn, [&](py::handle fqn, py::handle state) {
        py::object p = dict_get(param_of, fqn);
        if (p.is_none() || !PyDict_CheckExact(state.ptr())) return;
        const int is_dtensor = PyObject_IsInstance(p.ptr(), dtensor_type.ptr());
        check(is_dtensor);
        if (is_dtensor) {
            steal(PyObject_CallFunctionObjArgs(sharded.ptr(), fqn.ptr(), p.ptr(), state.ptr(), entries.ptr(),
                                               local.ptr(), nullptr));
            return;
        }
        py::object pshape = steal(PyObject_GetAttr(p.ptr(), shape_name.ptr()));
        py::object known = dict_get(wholes, pshape);
        if (!truthy(known.ptr())) known = steal(PyObject_CallOneArg(whole.ptr(), pshape.ptr()));
        py::object pair[2];
        unpack(known, 2, pair);
        py::object chunk[3];  // (shape, offsets, sizes)
        unpack(pair[0], 3, chunk);
        const py::object& largest = pair[1];
        py::object fqn_str = fmt(fqn);
        py::object prefix = concat({state_prefix.ptr(), fqn_str.ptr(), dot.ptr()});
        iterate_items(state, [&](py::handle key, py::handle v) {
            if (reinterpret_cast<PyObject*>(Py_TYPE(v.ptr())) != tensor) return;
            py::object part;
            if (PyUnicode_CheckExact(key.ptr())) {
                if (!PyDict_Check(parts.ptr())) raise_type("a dict", parts);
                PyObject* found = PyDict_GetItemWithError(parts.ptr(), key.ptr());
                if (found != nullptr) {
                    part = borrow(found);
                } else if (PyErr_Occurred()) {
                    throw py::error_already_set();
                }
            }
            if (!part) part = steal(PyObject_CallOneArg(part_of.ptr(), key.ptr()));
            if (part.is_none()) return;
            py::object item = join(prefix.ptr(), part.ptr());
            if (!items_contain(items, item.ptr())) return;  // a 0-d parameter's state went into the scalar table
            if (compare(shape_of.get(v.ptr()).ptr(), pshape.ptr(), Py_NE)) return;
            if (layout_of.get(v.ptr()).ptr() != strided.ptr()) return;
            if (truthy(is_meta_of.get(v.ptr()).ptr())) return;
            py::object vdtype = dtype_of.get(v.ptr());
            if (vdtype.ptr() != dtype.ptr()) {
                dtype = std::move(vdtype);
                py::object size = steal(PyObject_CallMethodNoArgs(v.ptr(), element_size.ptr()));
                py::object got = steal(PyObject_CallFunctionObjArgs(spec_of.ptr(), dtype.ptr(), size.ptr(), nullptr));
                unpack(got, 3, spec);
            }
            if (compare(largest.ptr(), spec[2].ptr(), Py_GE)) return;  // large enough to be an item of its own
            check(PyDict_DelItem(items.ptr(), item.ptr()));
            py::object entry = steal(PyTuple_Pack(7, fqn.ptr(), part.ptr(), spec[0].ptr(), spec[1].ptr(),
                                                  chunk[0].ptr(), chunk[1].ptr(), chunk[2].ptr()));
            check(PyList_Append(entries.ptr(), entry.ptr()));
            check(PyList_Append(local.ptr(), v.ptr()));
            if (!addresses.is_none()) check(PyList_Append(addresses.ptr(), address_of.of(v.ptr()).ptr()));
        });
    });
    return py::make_tuple(entries, local);
}

}  // namespace sckpt
