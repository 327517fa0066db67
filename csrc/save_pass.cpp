// capture_fqns / claim_owners: the save-time pass from a live optimizer leaf to (groups_fqn,
// state_fqn) and the ownership check. Twins of sparse_ckpt/_core_py/save_pass.py.
#include <unordered_map>

#include "core.hpp"

namespace sckpt {

namespace {

/// The identities of a group's keys and values, in order, without ``"params"`` (the key of
/// ``_core_py.save_pass``'s ``shared``): a hash and the pointers, kept in one reused buffer until a
/// new settings dict needs its own copy.
struct Ident {
    std::vector<PyObject*> ptrs;
    size_t hash = 0;
    bool operator==(const Ident& o) const { return hash == o.hash && ptrs == o.ptrs; }
};

struct IdentHash {
    size_t operator()(const Ident& id) const { return id.hash; }
};

void ident_of(py::handle group, PyObject* params_key, Ident& id) {
    id.ptrs.clear();
    uint64_t h = 1469598103934665603ULL;
    if (!PyDict_Check(group.ptr())) raise_type("a dict", group);
    Py_ssize_t pos = 0;
    PyObject* k = nullptr;
    PyObject* v = nullptr;
    while (PyDict_Next(group.ptr(), &pos, &k, &v)) {
        if (!not_params(k, params_key)) continue;
        for (PyObject* p : {k, v}) {
            id.ptrs.push_back(p);
            h = (h ^ static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p))) * 1099511628211ULL;
            h ^= h >> 29;
        }
    }
    id.hash = static_cast<size_t>(h);
}

}  // namespace

py::tuple capture_fqns(py::object leaf, py::object param_groups, py::object state, py::object fqn_of,
                       py::object tensor_type) {
    py::object params_key = steal(PyUnicode_InternFromString("params"));
    py::object groups_fqn = steal(PyList_New(0));
    IdMap in_groups;
    py::object unowned;  // the first group parameter the model does not own
    Py_ssize_t unowned_group = 0;
    Py_ssize_t gi = 0;
    // groups whose keys and values are the same objects share one settings dict (every key and
    // value stays alive in the optimizer's groups for the whole call)
    std::unordered_map<Ident, py::object, IdentHash> shared;
    Ident ident;
    iterate(param_groups, [&](py::handle group) {
        ident_of(group, params_key.ptr(), ident);
        auto found = shared.find(ident);
        py::object settings;
        if (found != shared.end()) {
            settings = found->second;
        } else {
            settings = copy_without_params(group, params_key);
            shared.emplace(ident, settings);
        }
        py::object params = steal(PyObject_GetItem(group.ptr(), params_key.ptr()));
        py::object fqns = steal(PyList_New(0));
        iterate(params, [&](py::handle p) {
            in_groups.emplace(p.ptr(), 0);
            py::object pid = steal(PyLong_FromVoidPtr(p.ptr()));
            PyObject* fqn = PyDict_GetItemWithError(fqn_of.ptr(), pid.ptr());
            if (fqn == nullptr) {
                if (PyErr_Occurred()) throw py::error_already_set();
                if (!unowned) {
                    unowned = borrow(p.ptr());
                    unowned_group = gi;
                }
                return;
            }
            check(PyList_Append(fqns.ptr(), fqn));
        });
        check(PyList_Append(groups_fqn.ptr(), steal(PyTuple_Pack(2, settings.ptr(), fqns.ptr())).ptr()));
        ++gi;
    });
    // ``params`` above keeps every group's list alive only while its group is walked; the
    // parameters themselves stay alive in the groups (the caller holds the optimizer).
    py::object odd_key;
    iterate_items(state, [&](py::handle key, py::handle) {
        const int is_tensor = PyObject_IsInstance(key.ptr(), tensor_type.ptr());
        check(is_tensor);
        if (is_tensor) {
            if (in_groups.find(key.ptr()) == nullptr) {
                py::object shape = steal(PySequence_Tuple(steal(PyObject_GetAttrString(key.ptr(), "shape")).ptr()));
                raise_unsupported_error(Msg() << "leaf " << py_repr(leaf) << ": optimizer.state holds a tensor of shape "
                                              << py_repr(shape) << " that is in no param group");
            }
        } else if (!odd_key) {
            odd_key = borrow(key.ptr());
        }
    });
    if (unowned) {
        py::object shape = steal(PySequence_Tuple(steal(PyObject_GetAttrString(unowned.ptr(), "shape")).ptr()));
        raise_mismatch_error(Msg() << "leaf " << py_repr(leaf) << ": group " << static_cast<long long>(unowned_group)
                                   << ": optimizer parameter of shape " << py_repr(shape) << " is not owned by the model");
    }
    if (odd_key) {
        raise_unsupported_error(Msg() << "leaf " << py_repr(leaf) << ": optimizer.state has a non-parameter key "
                                      << py_repr(odd_key) << ", which has no FQN");
    }
    py::object state_fqn = steal(PyDict_New());
    iterate_items(state, [&](py::handle key, py::handle value) {
        py::object pid = steal(PyLong_FromVoidPtr(key.ptr()));
        py::object fqn = steal(PyObject_GetItem(fqn_of.ptr(), pid.ptr()));
        check(PyDict_SetItem(state_fqn.ptr(), fqn.ptr(), value.ptr()));
    });
    return py::make_tuple(groups_fqn, state_fqn);
}

py::object claim_owners(py::object leaf, py::object groups_fqn, py::object owner) {
    py::object repeats = steal(PyList_New(0));
    Py_ssize_t gi = 0;
    iterate(groups_fqn, [&](py::handle pair) {
        py::object parts[2];
        unpack(pair, 2, parts);
        iterate(parts[1], [&](py::handle fqn) {
            const Py_ssize_t size = PyDict_GET_SIZE(owner.ptr());
            PyObject* prev = PyDict_SetDefault(owner.ptr(), fqn.ptr(), leaf.ptr());
            if (prev == nullptr) throw py::error_already_set();
            if (PyDict_GET_SIZE(owner.ptr()) != size) return;
            py::object held = borrow(prev);
            if (prev != leaf.ptr()) {
                const int same = PyObject_RichCompareBool(prev, leaf.ptr(), Py_EQ);
                check(same);
                if (!same) {
                    raise_mismatch_error(Msg() << "parameter " << py_repr(fqn) << " is in both leaf " << py_repr(held)
                                               << " and leaf " << py_repr(leaf));
                }
            }
            py::object index = steal(PyLong_FromSsize_t(gi));
            py::object item = steal(PyTuple_Pack(2, fqn.ptr(), index.ptr()));
            check(PyList_Append(repeats.ptr(), item.ptr()));
        });
        ++gi;
    });
    return repeats;
}

}  // namespace sckpt
