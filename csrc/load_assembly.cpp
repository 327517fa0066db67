// The load hot path: fqns_of_groups / build_groups / cast_states (one pass per leaf from a decoded
// checkpoint to what Optimizer.__setstate__ takes) and merge_table_settings (a decoded table's
// settings by canonical FQN). Twins of sparse_ckpt/_core_py/load_assembly.py (same calls of the callbacks,
// in the same order; same outputs and errors for the documented input types).
#include <algorithm>

#include "core.hpp"

namespace sckpt {

namespace {

bool exact_immutable(PyObject* v) {
    return v == Py_None || PyLong_CheckExact(v) || PyFloat_CheckExact(v) || PyBool_Check(v) ||
           PyUnicode_CheckExact(v) || PyBytes_CheckExact(v);
}

/// ``_flat_immutable``: every value an immutable scalar or a tuple of them.
bool flat_immutable(PyObject* settings) {
    Py_ssize_t pos = 0;
    PyObject* k = nullptr;
    PyObject* v = nullptr;
    while (PyDict_Next(settings, &pos, &k, &v)) {
        if (exact_immutable(v)) continue;
        if (PyTuple_CheckExact(v)) {
            bool all = true;
            for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(v) && all; ++i) all = exact_immutable(PyTuple_GET_ITEM(v, i));
            if (all) continue;
        }
        return false;
    }
    return true;
}

/// ``group["params"]`` of an optimizer group (a dict).
py::object group_params(py::handle group, const py::object& key) {
    PyObject* params = PyDict_GetItemWithError(group.ptr(), key.ptr());
    if (params == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        raise_builtin(PyExc_KeyError, steal(PyUnicode_FromString("params")));
    }
    return borrow(params);
}

py::object attr(py::handle obj, const py::object& name) { return steal(PyObject_GetAttr(obj.ptr(), name.ptr())); }

py::object interned(const char* s) { return steal(PyUnicode_InternFromString(s)); }

/// Attribute names looked up once per call (a C-string lookup would build and hash a new str
/// for every tensor).
struct Names {
    py::object shape = interned("shape");
    py::object dtype = interned("dtype");
    py::object device = interned("device");
    py::object is_floating_point = interned("is_floating_point");
    py::object is_cpu = interned("is_cpu");
    py::object fused = interned("fused");
    py::object capturable = interned("capturable");
    py::object step = interned(kStepKey);
    py::object params = interned("params");
};

bool rich_eq(py::handle a, py::handle b) {
    PyObject* r = PyObject_RichCompare(a.ptr(), b.ptr(), Py_EQ);
    if (r == nullptr) throw py::error_already_set();
    const int truth = PyObject_IsTrue(r);
    Py_DECREF(r);
    check(truth);
    return truth != 0;
}

/// ``key == STEP_KEY`` for the state keys the decoder produces (str or int).
/// ``isinstance(v, tensor_type)``, without the generic protocol for the exact type (the usual case).
bool is_tensor_of(PyObject* v, PyObject* tensor_type) {
    if (reinterpret_cast<PyObject*>(Py_TYPE(v)) == tensor_type) return true;
    const int r = PyObject_IsInstance(v, tensor_type);
    check(r);
    return r != 0;
}

bool is_step(PyObject* key, const Names& n) {
    if (key == n.step.ptr()) return true;
    return PyUnicode_Check(key) && PyUnicode_CompareWithASCIIString(key, kStepKey) == 0;
}

/// What cast_states reads of a parameter, each attribute at most once and only when needed.
struct ParamView {
    PyObject* p;
    const Names& n;
    py::object dtype, shape, device;
    int is_cpu = -1;     // -1: not read yet
    int floating = -1;

    py::object& get_dtype() {
        if (!dtype) dtype = attr(p, n.dtype);
        return dtype;
    }
    py::object& get_shape() {
        if (!shape) shape = attr(p, n.shape);
        return shape;
    }
    py::object& get_device() {
        if (!device) device = attr(p, n.device);
        return device;
    }
    bool cpu() {
        if (is_cpu < 0) is_cpu = attr(p, n.is_cpu).ptr() == Py_True ? 1 : 0;
        return is_cpu != 0;
    }
    bool is_floating() {
        if (floating < 0) {
            py::object f = steal(PyObject_CallMethodNoArgs(p, n.is_floating_point.ptr()));
            const int truth = PyObject_IsTrue(f.ptr());
            check(truth);
            floating = truth;
        }
        return floating != 0;
    }
};

/// One saved state tensor's attributes, read once by the plain-ness check and reused by the cast.
struct ValueView {
    py::object key;
    py::object value;
    bool tensor;
    bool step;
    py::object dtype;  // read for a non-step tensor
};

}  // namespace

py::object fqns_of_groups(py::object leaf, py::object param_groups, py::object fqn_of) {
    const Names names;
    py::object out = steal(PyList_New(0));
    Py_ssize_t gi = 0;
    iterate(param_groups, [&](py::handle group) {
        py::object fqns = steal(PyList_New(0));
        iterate(group_params(group, names.params), [&](py::handle p) {
            py::object pid = steal(PyLong_FromVoidPtr(p.ptr()));
            PyObject* fqn = PyDict_GetItemWithError(fqn_of.ptr(), pid.ptr());
            if (fqn == nullptr) {
                if (PyErr_Occurred()) throw py::error_already_set();
                py::object shape = steal(PySequence_Tuple(attr(p, names.shape).ptr()));
                raise_mismatch_error(Msg() << "leaf " << py_repr(leaf) << " group " << static_cast<long long>(gi)
                                           << ": optimizer parameter of shape " << py_repr(shape)
                                           << " is not owned by the model");
            }
            check(PyList_Append(fqns.ptr(), fqn));
        });
        check(PyList_Append(out.ptr(), fqns.ptr()));
        ++gi;
    });
    return out;
}

py::object build_groups(py::object param_groups, py::object chosen, py::object copy_settings, bool keep_names) {
    py::object out = steal(PyList_New(0));
    const Names names;
    const py::object& params_key = names.params;
    py::object names_key = interned("param_names");
    IdMap flat_ok;  // id(settings) -> 0/1
    const Py_ssize_t n_groups = length(param_groups);
    const Py_ssize_t n_chosen = length(chosen);
    for (Py_ssize_t gi = 0; gi < n_groups && gi < n_chosen; ++gi) {
        py::object group = steal(PySequence_GetItem(param_groups.ptr(), gi));
        py::object settings = steal(PySequence_GetItem(chosen.ptr(), gi));
        py::object fresh;
        if (settings.is_none()) {
            py::object own = copy_without_params(group, params_key);
            fresh = steal(PyObject_CallOneArg(copy_settings.ptr(), own.ptr()));
        } else {
            const Py_ssize_t* known = flat_ok.find(settings.ptr());
            bool flat;
            if (known != nullptr) {
                flat = *known != 0;
            } else {
                flat = flat_immutable(settings.ptr());
                flat_ok.emplace(settings.ptr(), flat ? 1 : 0);
            }
            fresh = flat ? steal(PyDict_Copy(settings.ptr())) : steal(PyObject_CallOneArg(copy_settings.ptr(), settings.ptr()));
        }
        check(PyObject_SetItem(fresh.ptr(), params_key.ptr(), group_params(group, names.params).ptr()));
        const int group_named = keep_names ? PyDict_Contains(group.ptr(), names_key.ptr()) : 0;
        check(group_named);
        if (group_named) {
            const int new_named = PySequence_Contains(fresh.ptr(), names_key.ptr());
            check(new_named);
            if (!new_named) {
                PyObject* names = PyDict_GetItemWithError(group.ptr(), names_key.ptr());
                if (names == nullptr) throw py::error_already_set();
                check(PyObject_SetItem(fresh.ptr(), names_key.ptr(), names));
            }
        }
        check(PyList_Append(out.ptr(), fresh.ptr()));
    }
    return out;
}

py::object cast_states(py::object leaf, py::object param_groups, py::object target, py::object chosen,
                       py::object state_of, py::object state, py::object tensor_type, py::object check_shapes,
                       py::object cast_tensor, py::object cast_value) {
    const Names names;
    PyObject* tt = tensor_type.ptr();
    const TypeAttr value_dtype(tensor_type, "dtype"), value_shape(tensor_type, "shape"),
        value_device(tensor_type, "device"), value_is_cpu(tensor_type, "is_cpu");
    // fqn -> param of the first group listing it; the fqns of fused/capturable groups
    py::object where = steal(PyDict_New());
    py::object special_fqns = steal(PySet_New(nullptr));
    const Py_ssize_t n = std::min({length(param_groups), length(target), length(chosen)});
    IdMap special_of;  // chosen settings object -> 0/1 (a few interned objects serve many groups)
    auto flags_of = [&](PyObject* settings) {
        if (!PyDict_Check(settings)) raise_type("a dict", settings);
        for (const py::object* flag : {&names.fused, &names.capturable}) {
            PyObject* v = PyDict_GetItemWithError(settings, flag->ptr());
            if (v == nullptr && PyErr_Occurred()) throw py::error_already_set();
            if (v != nullptr) {
                const int truth = PyObject_IsTrue(v);
                check(truth);
                if (truth) return true;
            }
        }
        return false;
    };
    for (Py_ssize_t gi = 0; gi < n; ++gi) {
        py::object group = steal(PySequence_GetItem(param_groups.ptr(), gi));
        py::object fqns = steal(PySequence_GetItem(target.ptr(), gi));
        py::object settings = steal(PySequence_GetItem(chosen.ptr(), gi));
        bool special;
        if (settings.is_none()) {  // the group keeps its own settings
            special = flags_of(group.ptr());
        } else if (const Py_ssize_t* known = special_of.find(settings.ptr())) {
            special = *known != 0;
        } else {
            special = flags_of(settings.ptr());
            special_of.emplace(settings.ptr(), special ? 1 : 0);  // alive in chosen for the whole call
        }
        py::object params = group_params(group, names.params);
        const Py_ssize_t np = std::min(length(params), length(fqns));
        for (Py_ssize_t i = 0; i < np; ++i) {
            PyObject* fqn = PySequence_Fast_ITEMS(fqns.ptr())[i];
            const Py_ssize_t before = PyDict_GET_SIZE(where.ptr());
            if (PyDict_SetDefault(where.ptr(), fqn, PySequence_Fast_ITEMS(params.ptr())[i]) == nullptr) {
                throw py::error_already_set();
            }
            if (special && PyDict_GET_SIZE(where.ptr()) != before) check(PySet_Add(special_fqns.ptr(), fqn));
        }
    }
    py::object used = steal(PyList_New(0));
    std::vector<ValueView> values;
    iterate_items(state_of, [&](py::handle fqn, py::handle saved) {
        PyObject* found = PyDict_GetItemWithError(where.ptr(), fqn.ptr());
        if (found == nullptr) {
            if (PyErr_Occurred()) throw py::error_already_set();
            return;
        }
        if (saved.is_none()) return;
        py::object p = borrow(found);
        const int is_special = PySet_GET_SIZE(special_fqns.ptr()) ? PySet_Contains(special_fqns.ptr(), fqn.ptr()) : 0;
        check(is_special);
        const bool special = is_special != 0;
        PyObject* special_obj = special ? Py_True : Py_False;
        check(PyList_Append(used.ptr(), fqn.ptr()));
        ParamView pv{p.ptr(), names, {}, {}, {}};
        const bool is_dict = PyDict_CheckExact(saved.ptr());
        // ``_shapes_plain``: every non-step tensor has the param's dtype and shape (one read of each)
        values.clear();
        bool plain = is_dict;
        if (is_dict) {
            Py_ssize_t pos = 0;
            PyObject* k = nullptr;
            PyObject* v = nullptr;
            while (PyDict_Next(saved.ptr(), &pos, &k, &v)) {
                ValueView vv{borrow(k), borrow(v), is_tensor_of(v, tt), false, {}};
                if (vv.tensor) {
                    vv.step = is_step(k, names);
                    if (!vv.step) {
                        vv.dtype = value_dtype.get(v);
                        if (plain && (vv.dtype.ptr() != pv.get_dtype().ptr() ||
                                      !rich_eq(value_shape.get(v), pv.get_shape()))) {
                            plain = false;
                        }
                    }
                } else if (plain && PyDict_CheckExact(v)) {
                    plain = false;
                }
                values.push_back(std::move(vv));
            }
        }
        if (!check_shapes.is_none() && !plain) {
            steal(PyObject_CallFunctionObjArgs(check_shapes.ptr(), leaf.ptr(), fqn.ptr(), p.ptr(), saved.ptr(), nullptr));
        }
        if (!is_dict) {
            py::object v = steal(
                PyObject_CallFunctionObjArgs(cast_value.ptr(), p.ptr(), saved.ptr(), special_obj, Py_None, nullptr));
            check(PyObject_SetItem(state.ptr(), p.ptr(), v.ptr()));
            return;
        }
        py::object out = steal(PyDict_New());
        for (ValueView& vv : values) {
            py::object cast;
            if (vv.tensor) {
                bool keep;
                if (vv.step) {
                    keep = !special;
                } else {
                    keep = vv.dtype.ptr() == pv.get_dtype().ptr() || !pv.is_floating();
                    if (keep) {  // same device: both on the CPU (whose tensors all report 'cpu'), or equal devices
                        const bool both_cpu = pv.cpu() && value_is_cpu.get(vv.value.ptr()).ptr() == Py_True;
                        keep = both_cpu || rich_eq(value_device.get(vv.value.ptr()), pv.get_device());
                    }
                }
                if (keep) {
                    cast = vv.value;
                } else {
                    py::object fl = py::bool_(pv.is_floating());
                    cast = steal(PyObject_CallFunctionObjArgs(cast_tensor.ptr(), vv.value.ptr(), vv.key.ptr(), special_obj,
                                                              fl.ptr(), pv.get_dtype().ptr(), pv.get_device().ptr(),
                                                              nullptr));
                }
            } else {
                cast = steal(PyObject_CallFunctionObjArgs(cast_value.ptr(), p.ptr(), vv.value.ptr(), special_obj,
                                                          vv.key.ptr(), nullptr));
            }
            check(PyDict_SetItem(out.ptr(), vv.key.ptr(), cast.ptr()));
        }
        check(PyObject_SetItem(state.ptr(), p.ptr(), out.ptr()));
    });
    return used;
}

py::tuple merge_table_settings(py::object leaf, py::object settings, py::object groups, py::object canonical,
                               py::object settings_of) {
    (void)leaf;  // the caller names it in its message
    if (!PyDict_Check(canonical.ptr())) raise_type("a dict", canonical);
    if (!PyDict_Check(settings_of.ptr())) raise_type("a dict", settings_of);
    py::object empty = steal(PyList_New(0));
    py::object clash = py::none();
    Py_ssize_t gi = 0;
    iterate(groups, [&](py::handle group) -> bool {
        py::object parts[2];
        unpack(group, 2, parts);
        const py::object& fqns = parts[1];
        if (length(fqns) == 0) {
            check(PyList_Append(empty.ptr(), steal(PyLong_FromSsize_t(gi)).ptr()));
            ++gi;
            return true;
        }
        py::object s = steal(PyObject_GetItem(settings.ptr(), parts[0].ptr()));
        iterate(fqns, [&](py::handle fqn) -> bool {
            PyObject* c = PyDict_GetItemWithError(canonical.ptr(), fqn.ptr());
            if (c == nullptr && PyErr_Occurred()) throw py::error_already_set();
            py::object canon = borrow(c != nullptr ? c : fqn.ptr());
            PyObject* prev = PyDict_SetDefault(settings_of.ptr(), canon.ptr(), s.ptr());
            if (prev == nullptr) throw py::error_already_set();
            if (prev != s.ptr()) {
                clash = py::make_tuple(canon, py::int_(gi));
                return false;
            }
            return true;
        });
        ++gi;
        return clash.is_none();
    });
    return py::make_tuple(empty, clash);
}

}  // namespace sckpt

namespace sckpt {

namespace {

/// ``_core_py.load_assembly._scalar_entry``: the scalar dict and leaf of a ``scalars_of`` value.
std::pair<PyObject*, PyObject*> scalar_entry(py::handle fqn, PyObject* entry) {
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2 || !PyDict_CheckExact(PyTuple_GET_ITEM(entry, 0))) {
        raise_builtin(PyExc_TypeError, Msg() << "merge_scalars: scalars_of[" << py_repr(fqn)
                                             << "] must be a (dict, leaf) tuple, got " << type_name(entry));
    }
    return {PyTuple_GET_ITEM(entry, 0), PyTuple_GET_ITEM(entry, 1)};
}

}  // namespace

py::object merge_scalars(py::object state_of, py::object scalars_of, py::object tensor_type) {
    if (!PyDict_CheckExact(state_of.ptr())) {
        raise_builtin(PyExc_TypeError, Msg() << "merge_scalars: state_of must be a dict, got " << type_name(state_of));
    }
    if (!PyDict_CheckExact(scalars_of.ptr())) {
        raise_builtin(PyExc_TypeError, Msg() << "merge_scalars: scalars_of must be a dict, got "
                                             << type_name(scalars_of));
    }
    py::object clone = steal(PyUnicode_InternFromString("clone"));
    IdMap handed;  // scalar dicts already handed out (all alive in scalars_of)
    // ``own(scalars)``: the dict itself copied for its first taker, with cloned tensors after.
    auto own = [&](PyObject* scalars) -> py::object {
        if (handed.emplace(scalars, 0).second) return steal(PyDict_Copy(scalars));
        py::object out = steal(PyDict_New());
        iterate_items(scalars, [&](py::handle key, py::handle value) {
            py::object taken = is_tensor_of(value.ptr(), tensor_type.ptr())
                                   ? steal(PyObject_CallMethodNoArgs(value.ptr(), clone.ptr()))
                                   : borrow(value.ptr());
            check(PyDict_SetItem(out.ptr(), key.ptr(), taken.ptr()));
        });
        return out;
    };
    py::object merged = steal(PyDict_New());
    Py_ssize_t pos = 0;
    PyObject* f = nullptr;
    PyObject* s = nullptr;
    while (PyDict_Next(state_of.ptr(), &pos, &f, &s)) {
        py::object fqn = borrow(f);
        py::object state = borrow(s);
        PyObject* entry = PyDict_GetItemWithError(scalars_of.ptr(), f);
        if (entry == nullptr || entry == Py_None) {
            if (entry == nullptr && PyErr_Occurred()) throw py::error_already_set();
            check(PyDict_SetItem(merged.ptr(), f, s));
            continue;
        }
        py::object held = borrow(entry);
        auto [scalars, leaf] = scalar_entry(fqn, entry);
        if (!PyDict_CheckExact(s)) {
            raise_builtin(PyExc_TypeError, Msg() << "merge_scalars: state_of[" << py_repr(fqn) << "] must be a dict, got "
                                                 << type_name(state));
        }
        Py_ssize_t kpos = 0;
        PyObject* k = nullptr;
        PyObject* v = nullptr;
        while (PyDict_Next(s, &kpos, &k, &v)) {
            const int clash = PyDict_Contains(scalars, k);
            check(clash);
            if (clash) {
                py::object key = borrow(k);
                raise_format_error(Msg() << "leaf " << py_repr(leaf) << ": state key " << py_repr(key) << " of "
                                         << py_repr(fqn) << " is both in a scalar table and the per-item entry 'state."
                                         << fmt(fqn) << "." << fmt(key) << "' (corrupt or edited checkpoint)");
            }
        }
        py::object fresh = own(scalars);
        check(PyDict_Update(fresh.ptr(), s));
        check(PyDict_SetItem(merged.ptr(), f, fresh.ptr()));
    }
    pos = 0;
    while (PyDict_Next(scalars_of.ptr(), &pos, &f, &s)) {
        py::object fqn = borrow(f);
        py::object entry = borrow(s);
        const int present = PyDict_Contains(state_of.ptr(), f);
        check(present);
        if (present) continue;
        PyObject* scalars = scalar_entry(fqn, s).first;
        if (PyDict_GET_SIZE(scalars) == 0) continue;
        py::object fresh = own(scalars);
        check(PyDict_SetItem(merged.ptr(), f, fresh.ptr()));
    }
    return merged;
}

py::object unlisted_keys(py::object keys_of, py::object state_of, py::object owned) {
    const std::pair<const char*, PyObject*> args[] = {{"keys_of", keys_of.ptr()}, {"state_of", state_of.ptr()},
                                                      {"owned", owned.ptr()}};
    for (const auto& [name, value] : args) {
        if (!PyDict_CheckExact(value)) {
            raise_builtin(PyExc_TypeError, Msg() << "unlisted_keys: " << name << " must be a dict, got "
                                                 << type_name(value));
        }
    }
    py::object out = steal(PyList_New(0));
    iterate_items(keys_of, [&](py::handle fqn, py::handle entry) {
        const int mine = PyDict_Contains(owned.ptr(), fqn.ptr());
        check(mine);
        if (!mine) return;
        PyObject* e = entry.ptr();
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 2 || !PyTuple_CheckExact(PyTuple_GET_ITEM(e, 0))) {
            raise_builtin(PyExc_TypeError, Msg() << "unlisted_keys: keys_of[" << py_repr(fqn)
                                                 << "] must be a (keys, leaf) tuple, got " << type_name(entry));
        }
        PyObject* state = PyDict_GetItemWithError(state_of.ptr(), fqn.ptr());
        if (state == nullptr && PyErr_Occurred()) throw py::error_already_set();
        if (state != nullptr && !PyDict_CheckExact(state)) {
            raise_builtin(PyExc_TypeError, Msg() << "unlisted_keys: state_of[" << py_repr(fqn)
                                                 << "] must be a dict, got " << type_name(state));
        }
        PyObject* keys = PyTuple_GET_ITEM(e, 0);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(keys); ++i) {
            PyObject* key = PyTuple_GET_ITEM(keys, i);
            int found = 0;
            if (state != nullptr) {
                found = PyDict_Contains(state, key);
                check(found);
            }
            if (!found) {
                py::object pair = py::make_tuple(fqn, borrow(key));
                check(PyList_Append(out.ptr(), pair.ptr()));
            }
        }
    });
    return out;
}

}  // namespace sckpt
