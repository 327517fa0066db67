// walk_parameters / fqn_tables: a model's parameter names (the FQN map) in one iterative walk.
#include <algorithm>

#include "core.hpp"

namespace sckpt {

namespace {

/// Interned attribute names and constants of one walk.
struct Names {
    py::object parameters = steal(PyUnicode_InternFromString("_parameters"));
    py::object modules = steal(PyUnicode_InternFromString("_modules"));
    py::object named_modules = steal(PyUnicode_InternFromString("named_modules"));
    py::object named_parameters = steal(PyUnicode_InternFromString("named_parameters"));
    py::object module = steal(PyUnicode_InternFromString("module"));
    py::object dot = steal(PyUnicode_InternFromString("."));
    py::object empty = steal(PyUnicode_FromString(""));
};

/// ``f"{prefix}.{name}" if prefix else name``
py::object join_name(py::handle prefix, py::handle name, const Names& names) {
    const int nonempty = PyObject_IsTrue(prefix.ptr());
    check(nonempty);
    if (!nonempty) return borrow(name.ptr());
    return concat({fmt(prefix).ptr(), names.dot.ptr(), fmt(name).ptr()});
}

/// ``name in stripped or (wrapper is not None and name == "module" and isinstance(owner, wrapper))``
bool is_stripped(py::handle name, py::handle owner, py::handle stripped, py::handle wrapper, py::handle module_str) {
    const int in_stripped = PySequence_Contains(stripped.ptr(), name.ptr());
    check(in_stripped);
    if (in_stripped) return true;
    if (wrapper.is_none()) return false;
    const int is_module = PyObject_RichCompareBool(name.ptr(), module_str.ptr(), Py_EQ);
    check(is_module);
    if (!is_module) return false;
    const int inst = PyObject_IsInstance(owner.ptr(), wrapper.ptr());
    check(inst);
    return inst != 0;
}

/// ``type(obj).<name> is base``
bool type_attr_is(py::handle obj, py::handle name, py::handle base) {
    py::object attr = steal(PyObject_GetAttr(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr())), name.ptr()));
    return attr.ptr() == base.ptr();
}

/// ``truth(obj)``
bool truthy(py::handle obj) {
    const int t = PyObject_IsTrue(obj.ptr());
    check(t);
    return t != 0;
}

struct Frame {
    py::object mod;
    py::object raw;
    py::object canon;
};

}  // namespace

py::object walk_parameters(py::object model, py::object stripped, py::object module_wrapper,
                           py::object base_named_modules, py::object base_named_parameters) {
    const Names names;
    if (!type_attr_is(model, names.named_parameters, base_named_parameters)) return py::none();
    py::object out = steal(PyList_New(0));
    std::vector<Frame> stack;
    stack.push_back(Frame{model, names.empty, names.empty});
    std::vector<std::pair<py::object, py::object>> children_items;
    while (!stack.empty()) {
        Frame frame = std::move(stack.back());
        stack.pop_back();
        if (!type_attr_is(frame.mod, names.named_modules, base_named_modules)) return py::none();
        const bool canon_is_raw = frame.canon.ptr() == frame.raw.ptr();
        py::object params = steal(PyObject_GetAttr(frame.mod.ptr(), names.parameters.ptr()));
        if (truthy(params)) {
            iterate_items(params, [&](py::handle k, py::handle v) {
                if (v.is_none()) return;
                py::object raw_k = join_name(frame.raw, k, names);
                py::object canon_k;
                if (is_stripped(k, frame.mod, stripped, module_wrapper, names.module)) {
                    canon_k = frame.canon;
                } else if (canon_is_raw) {
                    canon_k = raw_k;
                } else {
                    canon_k = join_name(frame.canon, k, names);
                }
                check(PyList_Append(out.ptr(), py::make_tuple(raw_k, canon_k, v).ptr()));
            });
        }
        py::object children = steal(PyObject_GetAttr(frame.mod.ptr(), names.modules.ptr()));
        if (!truthy(children)) continue;
        // for name, child in reversed(children.items()): pushed in reverse, so popped in order
        children_items.clear();
        if (plain_dict(children, "items")) {
            Py_ssize_t pos = 0;
            PyObject* k = nullptr;
            PyObject* v = nullptr;
            while (PyDict_Next(children.ptr(), &pos, &k, &v)) children_items.emplace_back(borrow(k), borrow(v));
            std::reverse(children_items.begin(), children_items.end());
        } else {
            py::object items = steal(PyObject_CallMethod(children.ptr(), "items", nullptr));
            py::object rev = steal(PyObject_CallFunctionObjArgs(reinterpret_cast<PyObject*>(&PyReversed_Type),
                                                                items.ptr(), nullptr));
            iterate(rev, [&](py::handle pair) {
                py::object kv[2];
                unpack(pair, 2, kv);
                children_items.emplace_back(kv[0], kv[1]);
            });
        }
        for (auto& [name, child] : children_items) {
            if (child.is_none()) continue;
            py::object raw_c = join_name(frame.raw, name, names);
            if (is_stripped(name, frame.mod, stripped, module_wrapper, names.module)) {
                stack.push_back(Frame{child, raw_c, frame.canon});
            } else if (canon_is_raw) {
                stack.push_back(Frame{child, raw_c, raw_c});
            } else {
                stack.push_back(Frame{child, raw_c, join_name(frame.canon, name, names)});
            }
        }
    }
    return out;
}

py::tuple fqn_tables(py::object named) {
    py::object fqn_of = steal(PyDict_New());
    py::object canonical = steal(PyDict_New());
    py::object param_of = steal(PyDict_New());
    iterate(named, [&](py::handle item) {
        py::object t[3];
        unpack(item, 3, t);
        py::object key = steal(PyLong_FromVoidPtr(t[2].ptr()));
        PyObject* found = PyDict_GetItemWithError(fqn_of.ptr(), key.ptr());
        py::object primary;
        py::object fqn = t[1];
        if (found == nullptr) {
            if (PyErr_Occurred()) throw py::error_already_set();
            int taken = PyDict_Contains(param_of.ptr(), fqn.ptr());
            check(taken);
            if (taken) {  // another parameter has this canonical name: keep the raw one
                taken = PyDict_Contains(param_of.ptr(), t[0].ptr());
                check(taken);
                if (taken) {
                    raise_mismatch_error(Msg() << "parameter " << py_repr(t[0]) << " and another parameter both have the FQN "
                                               << py_repr(fqn) << " and " << py_repr(t[0])
                                               << " is taken too; rename one of them");
                }
                fqn = t[0];
            }
            check(PyDict_SetItem(fqn_of.ptr(), key.ptr(), fqn.ptr()));
            check(PyDict_SetItem(param_of.ptr(), fqn.ptr(), t[2].ptr()));
            primary = fqn;
        } else {
            primary = borrow(found);
        }
        if (PyDict_SetDefault(canonical.ptr(), fqn.ptr(), primary.ptr()) == nullptr) throw py::error_already_set();
        if (PyDict_SetDefault(canonical.ptr(), t[0].ptr(), primary.ptr()) == nullptr) throw py::error_already_set();
    });
    return py::make_tuple(fqn_of, canonical, param_of);
}

}  // namespace sckpt
