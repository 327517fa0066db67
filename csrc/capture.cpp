// pack_optimizer / remap_to_fqns: torch's id packing and the id -> FQN remapping.
#include "core.hpp"

namespace sckpt {

namespace {

/// ``tuple(param.shape)`` as an f-string piece.
py::object shape_of(py::handle param) {
    py::object shape = steal(PyObject_GetAttrString(param.ptr(), "shape"));
    py::object as_tuple = steal(PySequence_Tuple(shape.ptr()));
    return fmt(as_tuple);
}

/// Number of parameters when every group is a dict with an exact-list "params" (a capacity hint).
Py_ssize_t count_params_hint(py::handle param_groups, py::handle params_key) {
    if (!PyList_CheckExact(param_groups.ptr())) return 0;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(param_groups.ptr()); ++i) {
        PyObject* g = PyList_GET_ITEM(param_groups.ptr(), i);
        if (!PyDict_CheckExact(g)) continue;
        PyObject* p = PyDict_GetItemWithError(g, params_key.ptr());
        if (p == nullptr) {
            PyErr_Clear();
            continue;
        }
        if (PyList_CheckExact(p) || PyTuple_CheckExact(p)) total += Py_SIZE(p);
    }
    return total;
}

}  // namespace

py::tuple pack_optimizer(py::object leaf, py::object param_groups, py::object state, py::object tensor_type) {
    py::object params_key = steal(PyUnicode_InternFromString("params"));
    // id(p) -> packed id; every key p stays alive in id_to_param
    IdMap mapping(static_cast<size_t>(count_params_hint(param_groups, params_key)));
    py::object id_to_param = steal(PyList_New(0));
    py::object packed_groups = steal(PyList_New(0));
    std::vector<Py_ssize_t> ids_seen;

    iterate(param_groups, [&](py::handle group) {
        py::object packed = copy_without_params(group, params_key);
        py::object params = steal(PyObject_GetItem(group.ptr(), params_key.ptr()));
        const Py_ssize_t start = PyList_GET_SIZE(id_to_param.ptr());
        Py_ssize_t offset = 0;
        ids_seen.clear();  // the id of each position, for the second pass over a list/tuple
        iterate(params, [&](py::handle p) {
            const auto entry = mapping.emplace(p.ptr(), start + offset);
            check(PyList_Append(id_to_param.ptr(), entry.second ? p.ptr() : Py_None));
            ids_seen.push_back(entry.first);
            ++offset;
        });
        // ``iterate`` read a list or tuple and ran no Python code: one id per position.
        const auto n = static_cast<Py_ssize_t>(ids_seen.size());
        py::object ids = steal(PyList_New(n));
        for (Py_ssize_t i = 0; i < n; ++i) {
            py::object id = steal(PyLong_FromSsize_t(ids_seen[static_cast<size_t>(i)]));
            PyList_SET_ITEM(ids.ptr(), i, id.release().ptr());
        }
        check(PyObject_SetItem(packed.ptr(), params_key.ptr(), ids.ptr()));
        check(PyList_Append(packed_groups.ptr(), packed.ptr()));
    });

    py::object packed_state = steal(PyDict_New());
    iterate_items(state, [&](py::handle key, py::handle value) {
        const int is_tensor = PyObject_IsInstance(key.ptr(), tensor_type.ptr());
        check(is_tensor);
        if (is_tensor) {
            const Py_ssize_t* found = mapping.find(key.ptr());
            if (found == nullptr) {
                raise_unsupported_error(Msg() << "leaf " << py_repr(leaf) << ": optimizer.state holds a tensor of shape "
                                              << shape_of(key) << " that is in no param group");
            }
            py::object pid = steal(PyLong_FromSsize_t(*found));
            check(PyDict_SetItem(packed_state.ptr(), pid.ptr(), value.ptr()));
        } else {
            check(PyDict_SetItem(packed_state.ptr(), key.ptr(), value.ptr()));
        }
    });
    return py::make_tuple(packed_groups, packed_state, id_to_param);
}

py::tuple remap_to_fqns(py::object leaf, py::object packed_groups, py::object packed_state, py::object id_to_param,
                        py::object fqn_of) {
    if (!PyList_Check(id_to_param.ptr())) raise_type("a list", id_to_param);
    if (!PyDict_Check(fqn_of.ptr())) raise_type("a dict", fqn_of);
    py::object params_key = steal(PyUnicode_InternFromString("params"));

    // fqn_for(pid, where): ``where`` is "group {gi}" (gi >= 0) or "state" (gi < 0), built lazily.
    auto where_of = [](Py_ssize_t gi) -> std::string {
        return gi >= 0 ? "group " + std::to_string(gi) : std::string("state");
    };
    auto fqn_for = [&](py::handle pid, Py_ssize_t gi) -> py::object {
        PyObject* p = pid.ptr();
        bool valid = PyLong_CheckExact(p);
        long long v = -1;
        if (valid) {
            int overflow = 0;
            v = PyLong_AsLongLongAndOverflow(p, &overflow);
            if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
            valid = overflow == 0 && v >= 0 && v < PyList_GET_SIZE(id_to_param.ptr());
        }
        py::object param;
        if (valid) {
            param = borrow(PyList_GET_ITEM(id_to_param.ptr(), static_cast<Py_ssize_t>(v)));
            valid = !param.is_none();
        }
        if (!valid) {
            raise_format_error(Msg() << "leaf " << py_repr(leaf) << ": " << where_of(gi) << " refers to parameter id "
                                     << py_repr(pid) << ", which the optimizer never assigned");
        }
        py::object key = steal(PyLong_FromVoidPtr(param.ptr()));
        py::object fqn = dict_get(fqn_of, key);
        if (fqn.is_none()) {
            raise_mismatch_error(Msg() << "leaf " << py_repr(leaf) << ": " << where_of(gi)
                                       << ": optimizer parameter of shape " << shape_of(param)
                                       << " is not owned by the model");
        }
        return fqn;
    };

    py::object groups_fqn = steal(PyList_New(0));
    Py_ssize_t gi = 0;
    iterate(packed_groups, [&](py::handle group) {
        if (!PyDict_Check(group.ptr())) raise_type("a dict", group);
        const int has = PyDict_Contains(group.ptr(), params_key.ptr());
        check(has);
        if (!has) {
            raise_format_error(Msg() << "leaf " << py_repr(leaf) << ": group " << static_cast<long long>(gi)
                                     << " has no 'params' entry");
        }
        py::object settings = copy_without_params(group, params_key);
        py::object params = steal(PyObject_GetItem(group.ptr(), params_key.ptr()));
        py::object fqns = steal(PyList_New(0));
        iterate(params, [&](py::handle pid) { check(PyList_Append(fqns.ptr(), fqn_for(pid, gi).ptr())); });
        check(PyList_Append(groups_fqn.ptr(), py::make_tuple(settings, fqns).ptr()));
        ++gi;
    });

    py::object state_fqn = steal(PyDict_New());
    iterate_items(packed_state, [&](py::handle pid, py::handle value) {
        if (!PyLong_CheckExact(pid.ptr())) {
            raise_unsupported_error(Msg() << "leaf " << py_repr(leaf) << ": optimizer.state has a non-parameter key "
                                          << py_repr(pid) << ", which has no FQN");
        }
        py::object fqn = fqn_for(pid, -1);
        check(PyDict_SetItem(state_fqn.ptr(), fqn.ptr(), value.ptr()));
    });
    return py::make_tuple(groups_fqn, state_fqn);
}

}  // namespace sckpt
