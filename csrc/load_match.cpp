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

/// ``_first_differing_key``
py::object first_differing_key(py::handle a, py::handle b) {
    py::object result;
    iterate(a, [&](py::handle key) -> bool {
        const int in_b = PySequence_Contains(b.ptr(), key.ptr());
        check(in_b);
        if (!in_b) {
            result = borrow(key.ptr());
            return false;
        }
        py::object va = steal(PyObject_GetItem(a.ptr(), key.ptr()));
        py::object vb = steal(PyObject_GetItem(b.ptr(), key.ptr()));
        if (Py_TYPE(va.ptr()) != Py_TYPE(vb.ptr()) || !values_equal(va, vb)) {
            result = borrow(key.ptr());
            return false;
        }
        return true;
    });
    if (result) return result;
    iterate(b, [&](py::handle key) -> bool {
        const int in_a = PySequence_Contains(a.ptr(), key.ptr());
        check(in_a);
        if (!in_a) {
            result = borrow(key.ptr());
            return false;
        }
        return true;
    });
    if (result) return result;
    return steal(PyUnicode_FromString("?"));
}

}  // namespace

py::tuple match_groups(py::object leaf, py::object target_fqns, py::object settings_of) {
    const bool fast = plain_dict(settings_of, "get");
    py::object chosen = steal(PyList_New(0));
    py::object missing = steal(PyList_New(0));
    Py_ssize_t gi = 0;
    iterate(target_fqns, [&](py::handle fqns) {
        py::object pick;
        py::object pick_fqn;
        iterate(fqns, [&](py::handle fqn) {
            py::object s = mapping_get(settings_of, fqn, fast);
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
