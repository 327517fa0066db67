// match_groups / assign_state_ids: FQN-based matching of saved groups and state on load.
#include "core.hpp"

namespace sckpt {

namespace {

/// ``bool(va == vb)``; an Exception while comparing falls back to ``va is vb``.
bool values_equal(py::handle va, py::handle vb) {
    PyObject* r = PyObject_RichCompare(va.ptr(), vb.ptr(), Py_EQ);
    int truth = -1;
    if (r != nullptr) {
        truth = PyObject_IsTrue(r);
        Py_DECREF(r);
    }
    if (truth < 0) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) throw py::error_already_set();
        PyErr_Clear();
        return va.ptr() == vb.ptr();
    }
    return truth != 0;
}

/// The first key of dict ``a`` that dict ``b`` lacks, with ``compare``: or whose value differs
/// (a null object when there is none).
py::object first_key_not_in(PyObject* a, PyObject* b, bool compare) {
    Py_ssize_t pos = 0;
    PyObject* k = nullptr;
    PyObject* va = nullptr;
    while (PyDict_Next(a, &pos, &k, &va)) {
        py::object key = borrow(k);
        PyObject* vb = PyDict_GetItemWithError(b, k);
        if (vb == nullptr) {
            if (PyErr_Occurred()) throw py::error_already_set();
            return key;
        }
        if (!compare) continue;
        py::object held_a = borrow(va);
        py::object held_b = borrow(vb);
        if (Py_TYPE(va) != Py_TYPE(vb) || !values_equal(held_a, held_b)) return key;
    }
    return py::object();
}

/// ``_first_differing_key``: of two settings dicts.
py::object first_differing_key(py::handle a, py::handle b) {
    if (!PyDict_Check(a.ptr())) raise_type("a dict", a);
    if (!PyDict_Check(b.ptr())) raise_type("a dict", b);
    py::object key = first_key_not_in(a.ptr(), b.ptr(), true);
    if (!key) key = first_key_not_in(b.ptr(), a.ptr(), false);
    if (key) return key;
    return steal(PyUnicode_FromString("?"));
}

}  // namespace

py::tuple match_groups(py::object leaf, py::object target_fqns, py::object settings_of) {
    py::object chosen = steal(PyList_New(0));
    py::object missing = steal(PyList_New(0));
    Py_ssize_t gi = 0;
    iterate(target_fqns, [&](py::handle fqns) {
        py::object pick;
        py::object pick_fqn;
        iterate(fqns, [&](py::handle fqn) {
            py::object s = dict_get(settings_of, fqn);
            if (s.is_none()) {
                check(PyList_Append(missing.ptr(), fqn.ptr()));
            } else if (!pick) {
                pick = std::move(s);
                pick_fqn = borrow(fqn.ptr());
            } else if (s.ptr() != pick.ptr()) {
                py::object key = first_differing_key(pick, s);
                raise_mismatch_error(Msg() << "leaf " << py_repr(leaf) << " group " << static_cast<long long>(gi)
                                           << ": saved settings differ between " << py_repr(pick_fqn) << " and "
                                           << py_repr(fqn) << " (key " << py_repr(key)
                                           << "); one target group cannot take both");
            }
        });
        check(PyList_Append(chosen.ptr(), pick ? pick.ptr() : Py_None));
        ++gi;
    });
    return py::make_tuple(chosen, missing);
}

py::tuple assign_state_ids(py::object target_fqns, py::object state_by_fqn) {
    py::object pid_of = steal(PyDict_New());
    Py_ssize_t pid = 0;
    iterate(target_fqns, [&](py::handle fqns) {
        iterate(fqns, [&](py::handle fqn) {
            const int known = PyDict_Contains(pid_of.ptr(), fqn.ptr());
            check(known);
            if (!known) check(PyDict_SetItem(pid_of.ptr(), fqn.ptr(), steal(PyLong_FromSsize_t(pid)).ptr()));
            ++pid;
        });
    });
    py::object packed_state = steal(PyDict_New());
    py::object used = steal(PyList_New(0));
    iterate_items(state_by_fqn, [&](py::handle fqn, py::handle s) {
        if (s.is_none()) return;
        PyObject* id = PyDict_GetItemWithError(pid_of.ptr(), fqn.ptr());
        if (id == nullptr) {
            if (PyErr_Occurred()) throw py::error_already_set();
            return;
        }
        check(PyDict_SetItem(packed_state.ptr(), id, s.ptr()));
        check(PyList_Append(used.ptr(), fqn.ptr()));
    });
    return py::make_tuple(packed_state, used);
}

}  // namespace sckpt
