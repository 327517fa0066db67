// flatten_state / flatten_groups / unflatten: DSD's flat key layout, both directions.
#include <unordered_set>
#include <vector>

#include "core.hpp"

namespace sckpt {

namespace {

/// Python's ``_flatten_into``; the recursion guard turns a self-referencing dict into the
/// RecursionError Python raises instead of a C stack overflow.
void flatten_into(PyObject* out, PyObject* prefix, py::handle value, PyObject* dot) {
    if (Py_EnterRecursiveCall(" while calling a Python object") != 0) throw py::error_already_set();
    struct Leave {
        ~Leave() { Py_LeaveRecursiveCall(); }
    } leave;
    iterate_items(value, [&](py::handle key, py::handle item) {
        py::object key_str = fmt(key);
        py::object full = concat({prefix, dot, key_str.ptr()});
        if (PyDict_Check(item.ptr())) {
            flatten_into(out, full.ptr(), item, dot);
        } else {
            check(PyDict_SetItem(out, full.ptr(), item.ptr()));
        }
    });
}

/// ``node.setdefault(key, {})`` (a new reference). With ``created``, it records whether the
/// result is the new ``{}`` (rather than a value already in ``node``).
py::object setdefault_dict(py::handle node, py::handle key, bool* created = nullptr) {
    py::object fresh;
    py::object out;
    if (PyDict_CheckExact(node.ptr())) {
        PyObject* found = PyDict_GetItemWithError(node.ptr(), key.ptr());
        if (found != nullptr) {
            out = borrow(found);
        } else {
            if (PyErr_Occurred()) throw py::error_already_set();
            fresh = out = steal(PyDict_New());
            check(PyDict_SetItem(node.ptr(), key.ptr(), fresh.ptr()));
        }
    } else {
        fresh = steal(PyDict_New());
        out = steal(PyObject_CallMethod(node.ptr(), "setdefault", "OO", key.ptr(), fresh.ptr()));
    }
    if (created != nullptr) *created = out.ptr() == fresh.ptr();
    return out;
}

}  // namespace

py::object flatten_state(py::object state_fqn) {
    py::object out = steal(PyDict_New());
    py::object dot = steal(PyUnicode_FromString("."));
    py::object state_prefix = steal(PyUnicode_FromString("state."));
    iterate_items(state_fqn, [&](py::handle fqn, py::handle state) {
        if (!PyDict_Check(state.ptr())) {
            raise_format_error(Msg() << "state of " << py_repr(fqn) << " is a " << type_name(state)
                                     << ", expected a dict");
        }
        py::object fqn_str = fmt(fqn);
        py::object prefix = concat({state_prefix.ptr(), fqn_str.ptr()});
        flatten_into(out.ptr(), prefix.ptr(), state, dot.ptr());
    });
    return out;
}

py::object flatten_groups(py::object groups_fqn) {
    py::object out = steal(PyDict_New());
    py::object dot = steal(PyUnicode_FromString("."));
    py::object head = steal(PyUnicode_FromString("param_groups."));
    iterate(groups_fqn, [&](py::handle entry) {
        py::object parts[2];
        unpack(entry, 2, parts);
        py::handle settings = parts[0];
        iterate(parts[1], [&](py::handle fqn) {
            py::object prefix;  // "param_groups.{fqn}." built on the first key
            iterate_items(settings, [&](py::handle key, py::handle value) {
                if (!prefix) {
                    py::object fqn_str = fmt(fqn);
                    prefix = concat({head.ptr(), fqn_str.ptr(), dot.ptr()});
                }
                py::object key_str = fmt(key);
                py::object full = concat({prefix.ptr(), key_str.ptr()});
                check(PyDict_SetItem(out.ptr(), full.ptr(), value.ptr()));
            });
        });
    });
    return out;
}

py::tuple unflatten(py::object flat, py::object known_fqns) {
    static constexpr const char kState[] = "state.";
    static constexpr Py_ssize_t kStateLen = sizeof(kState) - 1;
    static constexpr const char kGroups[] = "param_groups.";
    static constexpr Py_ssize_t kGroupsLen = sizeof(kGroups) - 1;
    static constexpr const char kPacked[] = "param_groups.__packed__.";
    static constexpr Py_ssize_t kPackedLen = sizeof(kPacked) - 1;

    py::object settings_by_fqn = steal(PyDict_New());
    py::object packed = steal(PyDict_New());
    py::object unmatched = steal(PyList_New(0));
    // (key, value seen while iterating); the value is reused only when ``flat[key]`` is a plain
    // dict lookup, otherwise ``flat[key]`` is evaluated again as in Python.
    std::vector<std::pair<py::object, py::object>> state_keys;
    const bool flat_is_dict = PyDict_CheckExact(flat.ptr());
    if (flat_is_dict) state_keys.reserve(static_cast<size_t>(PyDict_GET_SIZE(flat.ptr())));

    iterate_items(flat, [&](py::handle key, py::handle value) {
        PyObject* k = key.ptr();
        if (!PyUnicode_Check(k)) {
            raise_format_error(Msg() << "optimizer state dict key " << py_repr(key) << " is not a string");
        }
        const Py_ssize_t len = PyUnicode_GET_LENGTH(k);
        if (starts_with(k, kState, kStateLen)) {
            state_keys.emplace_back(borrow(k), flat_is_dict ? borrow(value.ptr()) : py::object());
        } else if (starts_with(k, kPacked, kPackedLen)) {
            if (!PyBytes_Check(value.ptr())) {
                raise_format_error(Msg() << "packed group table " << py_repr(key) << " is a " << type_name(value)
                                         << ", expected bytes");
            }
            py::object rest = steal(PyUnicode_Substring(k, kPackedLen, len));
            check(PyDict_SetItem(packed.ptr(), rest.ptr(), value.ptr()));
        } else if (starts_with(k, kGroups, kGroupsLen)) {
            const Py_ssize_t dot = PyUnicode_FindChar(k, '.', kGroupsLen, len, -1);
            if (dot == -2) throw py::error_already_set();
            // body-relative: dot <= 0 or dot == len(body) - 1
            if (dot < 0 || dot - kGroupsLen <= 0 || dot == len - 1) {
                check(PyList_Append(unmatched.ptr(), k));
                return;
            }
            py::object fqn = steal(PyUnicode_Substring(k, kGroupsLen, dot));
            py::object name = steal(PyUnicode_Substring(k, dot + 1, len));
            py::object entry = setdefault_dict(settings_by_fqn, fqn);
            check(PyDict_SetItem(entry.ptr(), name.ptr(), value.ptr()));
        } else {
            check(PyList_Append(unmatched.ptr(), k));
        }
    });

    py::object state_by_fqn = steal(PyDict_New());
    std::unordered_set<PyObject*> owned;  // dicts built here (all alive in state_by_fqn until we return)
    py::object dot_str = steal(PyUnicode_FromString("."));
    const bool known_is_dict = PyDict_CheckExact(known_fqns.ptr());
    for (auto& kv : state_keys) {
        PyObject* k = kv.first.ptr();
        const Py_ssize_t len = PyUnicode_GET_LENGTH(k);
        Py_ssize_t dot = PyUnicode_FindChar(k, '.', kStateLen, len, -1);
        if (dot == -2) throw py::error_already_set();
        py::object fqn;
        while (dot > kStateLen) {  // body-relative dot > 0
            py::object candidate = steal(PyUnicode_Substring(k, kStateLen, dot));
            int found = known_is_dict ? PyDict_Contains(known_fqns.ptr(), candidate.ptr())
                                      : PySequence_Contains(known_fqns.ptr(), candidate.ptr());
            check(found);
            if (!found) {
                found = PyDict_Contains(settings_by_fqn.ptr(), candidate.ptr());
                check(found);
            }
            if (found) {
                fqn = std::move(candidate);
                break;
            }
            dot = PyUnicode_FindChar(k, '.', kStateLen, dot, -1);
            if (dot == -2) throw py::error_already_set();
        }
        if (!fqn) {
            check(PyList_Append(unmatched.ptr(), k));
            continue;
        }
        bool created = false;
        py::object node = setdefault_dict(state_by_fqn, fqn, &created);
        if (created) owned.insert(node.ptr());
        py::object last;
        const Py_ssize_t next_dot = PyUnicode_FindChar(k, '.', dot + 1, len, 1);
        if (next_dot == -2) throw py::error_already_set();
        if (next_dot == -1) {
            last = steal(PyUnicode_Substring(k, dot + 1, len));
        } else {
            py::object rest = steal(PyUnicode_Substring(k, dot + 1, len));
            py::object parts = steal(PyUnicode_Split(rest.ptr(), dot_str.ptr(), -1));
            const Py_ssize_t n_parts = PyList_GET_SIZE(parts.ptr());
            for (Py_ssize_t i = 0; i + 1 < n_parts; ++i) {
                PyObject* part = PyList_GET_ITEM(parts.ptr(), i);
                py::object child = setdefault_dict(node, part, &created);
                if (created) {
                    owned.insert(child.ptr());
                } else if (!PyDict_Check(child.ptr())) {
                    raise_format_error(Msg() << "state key " << py_repr(kv.first) << " nests under a non-dict value of "
                                             << py_repr(fqn));
                } else if (owned.count(child.ptr()) == 0) {  // a dict value of the input: copy, never write into it
                    child = steal(PyObject_CallMethod(child.ptr(), "copy", nullptr));
                    check(PyObject_SetItem(node.ptr(), part, child.ptr()));
                    owned.insert(child.ptr());
                }
                node = std::move(child);
            }
            last = borrow(PyList_GET_ITEM(parts.ptr(), n_parts - 1));
        }
        const int present = PySequence_Contains(node.ptr(), last.ptr());
        check(present);
        if (present) {
            py::object existing = steal(PyObject_GetItem(node.ptr(), last.ptr()));
            if (PyDict_Check(existing.ptr())) {
                raise_format_error(Msg() << "state key " << py_repr(kv.first) << " collides with nested state of "
                                         << py_repr(fqn));
            }
        }
        py::object value = flat_is_dict ? kv.second : steal(PyObject_GetItem(flat.ptr(), k));
        check(PyObject_SetItem(node.ptr(), last.ptr(), value.ptr()));
    }
    return py::make_tuple(settings_by_fqn, state_by_fqn, packed, unmatched);
}

}  // namespace sckpt
