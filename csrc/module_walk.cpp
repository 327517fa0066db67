// map_parameters / fqn_tables: a model's parameter names (the FQN map) in one iterative walk,
// and the replay that tells in one identity-comparing pass whether a map made earlier still holds.
#include <array>

#include "core.hpp"

namespace sckpt {

namespace {

/// Interned attribute names and constants of one walk.
struct Names {
    py::object parameters = steal(PyUnicode_InternFromString("_parameters"));
    py::object modules = steal(PyUnicode_InternFromString("_modules"));
    py::object named_modules = steal(PyUnicode_InternFromString("named_modules"));
    py::object named_parameters = steal(PyUnicode_InternFromString("named_parameters"));
    py::object module = steal(PyUnicode_InternFromString(kWrapperChild));
    py::object dot = steal(PyUnicode_InternFromString("."));
    py::object empty = steal(PyUnicode_FromString(""));
    py::object getattribute = steal(PyUnicode_InternFromString("__getattribute__"));
};

/// ``f"{prefix}.{name}" if prefix else name``
py::object join_name(py::handle prefix, py::handle name, const Names& names) {
    const int nonempty = PyObject_IsTrue(prefix.ptr());
    check(nonempty);
    if (!nonempty) return borrow(name.ptr());
    return concat({fmt(prefix).ptr(), names.dot.ptr(), fmt(name).ptr()});
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

/// ``type(k) is str and k == WRAPPER_CHILD``
bool is_module_key(PyObject* k) { return PyUnicode_CheckExact(k) && PyUnicode_CompareWithASCIIString(k, kWrapperChild) == 0; }

/// ``id(obj)``, ``0`` for ``None`` (the trace's word for a slot holding ``None``).
uint64_t id_word(PyObject* obj) { return obj == Py_None ? 0 : static_cast<uint64_t>(reinterpret_cast<uintptr_t>(obj)); }

/// ``for k, v in m.items(): f(k, v)`` as torch's ``named_modules`` reads a module's
/// ``_parameters``/``_modules``: an exact dict directly, any other mapping (an ``OrderedDict``,
/// say) through its own ``items()``, whose pairs must be tuples.
template <class F>
void for_each_entry(py::handle m, F&& f) {
    if (PyDict_CheckExact(m.ptr())) {
        iterate_items(m, f);
        return;
    }
    py::object items = steal(PyObject_CallMethod(m.ptr(), "items", nullptr));
    py::object it = steal(PyObject_GetIter(items.ptr()));
    while (PyObject* raw = PyIter_Next(it.ptr())) {
        py::object pair = steal(raw);
        py::object kv[2];
        unpack(pair, 2, kv);
        f(kv[0], kv[1]);
    }
    if (PyErr_Occurred()) throw py::error_already_set();
}

/// A module container the trace can record and a replay read again exactly: an exact dict or an
/// exact ``OrderedDict`` (``ModuleList.__delitem__`` leaves one behind), whose ``items()`` run no
/// Python code.
bool replayable_mapping(PyObject* m) { return PyDict_CheckExact(m) || PyODict_CheckExact(m); }

/// ``(key, value)`` of a replayable mapping in ``items()`` order, stopping when ``f`` returns false;
/// false when it stopped. An exact dict is read in place; an OrderedDict through its items.
template <class F>
bool each_entry(PyObject* m, F&& f) {
    if (PyDict_CheckExact(m)) {
        Py_ssize_t pos = 0;
        PyObject* k = nullptr;
        PyObject* v = nullptr;
        while (PyDict_Next(m, &pos, &k, &v)) {
            if (!f(k, v)) return false;
        }
        return true;
    }
    py::object items = steal(PyObject_CallMethod(m, "items", nullptr));
    py::object list = steal(PySequence_List(items.ptr()));
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list.ptr()); ++i) {
        PyObject* pair = PyList_GET_ITEM(list.ptr(), i);
        if (!f(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1))) return false;
    }
    return true;
}

/// The walk's per-call state: the caller's objects and what it learnt of module types.
struct Walk {
    const Names names;
    py::handle stripped;
    py::handle wrapper;
    py::handle base_named_modules;
    IdMap type_ok;  // type -> 1 when its named_modules is the base one (types outlive the call: modules hold them)
    IdMap dict_ok;  // type -> 1 when its ``_parameters``/``_modules`` attributes are found in the instance dict

    /// ``getattr(mod, name)`` for ``name`` ``_parameters`` or ``_modules``. When the module's type looks
    /// attributes up generically (its ``__getattribute__`` is object's; a ``__getattr__`` runs only for
    /// a missing attribute) and has no data descriptor of either name, the generic lookup returns the
    /// instance dict's entry whenever there is one: read it there (no per-module type lookups, no
    /// ``__getattr__`` hook machinery). Anything else -- no such entry, no instance dict, another
    /// type -- goes through ``PyObject_GetAttr``, so the result is always ``getattr``'s.
    py::object module_attr(PyObject* mod, const py::object& name) {
        PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(mod));
        const Py_ssize_t* known = dict_ok.find(type);
        const bool plain = known != nullptr ? *known != 0 : dict_ok.emplace(type, plain_lookup(Py_TYPE(mod)) ? 1 : 0).first != 0;
        if (plain) {
            PyObject* dict = PyObject_GenericGetDict(mod, nullptr);  // new reference, or NULL and an error
            if (dict == nullptr) {
                PyErr_Clear();
            } else {
                py::object held = steal(dict);
                if (PyDict_Check(dict)) {
                    PyObject* value = PyDict_GetItemWithError(dict, name.ptr());
                    if (value != nullptr) return borrow(value);
                    if (PyErr_Occurred()) throw py::error_already_set();
                }
            }
        }
        return steal(PyObject_GetAttr(mod, name.ptr()));
    }

    bool plain_lookup(PyTypeObject* t) const {
        if (t->tp_getattro != PyObject_GenericGetAttr && !PyType_HasFeature(t, Py_TPFLAGS_HEAPTYPE)) return false;
        PyObject* getattribute = names.getattribute.ptr();
        const bool generic = _PyType_Lookup(t, getattribute) == _PyType_Lookup(&PyBaseObject_Type, getattribute);
        if (!generic) return false;
        for (const py::object* name : {&names.parameters, &names.modules}) {
            PyObject* d = _PyType_Lookup(t, name->ptr());  // borrowed; no exception set
            if (d != nullptr && Py_TYPE(d)->tp_descr_set != nullptr) return false;  // a data descriptor wins
        }
        return true;
    }

    bool named_modules_ok(PyObject* mod) {
        PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(mod));
        if (const Py_ssize_t* known = type_ok.find(type)) return *known != 0;
        const bool ok = type_attr_is(mod, names.named_modules, base_named_modules);
        type_ok.emplace(type, ok ? 1 : 0);
        return ok;
    }

    /// ``name in stripped or (wrapper is not None and name == WRAPPER_CHILD and isinstance(owner, wrapper))``
    bool is_stripped(py::handle name, py::handle owner) const {
        const int in_stripped = PySequence_Contains(stripped.ptr(), name.ptr());
        check(in_stripped);
        if (in_stripped) return true;
        if (wrapper.is_none()) return false;
        const int is_module = PyObject_RichCompareBool(name.ptr(), names.module.ptr(), Py_EQ);
        check(is_module);
        if (!is_module) return false;
        const int inst = PyObject_IsInstance(owner.ptr(), wrapper.ptr());
        check(inst);
        return inst != 0;
    }

    /// The trace's wrapper word of a module: 0 when no key of it is ``WRAPPER_CHILD`` (or there is no
    /// wrapper), else 1 + ``isinstance(mod, wrapper)``.
    uint64_t wrapper_word(PyObject* mod, bool has_module_key) const {
        if (!has_module_key || wrapper.is_none()) return 0;
        const int inst = PyObject_IsInstance(mod, wrapper.ptr());
        check(inst);
        return 1 + static_cast<uint64_t>(inst != 0);
    }
};

/// What the walk saw, in walk order, for a later replay: per module ``id(module)``, the number
/// of ``_parameters`` entries and each value's ``id`` (0 for None), the number of ``_modules``
/// entries and each child's ``id``, the wrapper word; every key in ``keys``.
struct Trace {
    std::vector<uint64_t> words;
    py::object keys = steal(PyList_New(0));
    bool replayable = true;  // false once a mapping is not replayable_mapping or a key not an exact str

    void key(py::handle k) {
        if (!PyUnicode_CheckExact(k.ptr())) replayable = false;
        check(PyList_Append(keys.ptr(), k.ptr()));
    }
};

struct Frame {
    py::object mod;
    py::object raw;
    py::object canon;
};

/// ``_core_py.module_walk._walk``: the ``(raw name, canonical name, param)`` triples, or ``None`` (an override).
py::object walk(Walk& w, py::handle model, py::handle base_named_parameters, Trace& trace) {
    const Names& names = w.names;
    if (!type_attr_is(model, names.named_parameters, base_named_parameters)) return py::none();
    py::object out = steal(PyList_New(0));
    std::vector<Frame> stack;
    stack.push_back(Frame{borrow(model.ptr()), names.empty, names.empty});
    std::vector<std::pair<py::object, py::object>> children_items;
    while (!stack.empty()) {
        Frame frame = std::move(stack.back());
        stack.pop_back();
        if (!w.named_modules_ok(frame.mod.ptr())) return py::none();
        trace.words.push_back(id_word(frame.mod.ptr()));
        bool has_module_key = false;
        const bool canon_is_raw = frame.canon.ptr() == frame.raw.ptr();
        py::object params = w.module_attr(frame.mod.ptr(), names.parameters);
        if (!replayable_mapping(params.ptr())) trace.replayable = false;
        const size_t count_at = trace.words.size();
        trace.words.push_back(0);
        if (truthy(params)) {
            for_each_entry(params, [&](py::handle k, py::handle v) {
                trace.key(k);
                trace.words.push_back(id_word(v.ptr()));
                has_module_key = has_module_key || is_module_key(k.ptr());
                if (v.is_none()) return;
                py::object raw_k = join_name(frame.raw, k, names);
                py::object canon_k;
                if (w.is_stripped(k, frame.mod)) {
                    canon_k = frame.canon;
                } else if (canon_is_raw) {
                    canon_k = raw_k;
                } else {
                    canon_k = join_name(frame.canon, k, names);
                }
                check(PyList_Append(out.ptr(), py::make_tuple(raw_k, canon_k, v).ptr()));
            });
        }
        trace.words[count_at] = trace.words.size() - count_at - 1;
        py::object children = w.module_attr(frame.mod.ptr(), names.modules);
        children_items.clear();
        if (truthy(children)) {
            for_each_entry(children, [&](py::handle k, py::handle v) { children_items.emplace_back(borrow(k.ptr()), borrow(v.ptr())); });
        }
        if (!replayable_mapping(children.ptr())) trace.replayable = false;
        trace.words.push_back(children_items.size());
        for (auto& [name, child] : children_items) {
            trace.key(name);
            trace.words.push_back(id_word(child.ptr()));
            has_module_key = has_module_key || is_module_key(name.ptr());
        }
        // pushed in reverse, so popped in order
        for (auto it = children_items.rbegin(); it != children_items.rend(); ++it) {
            auto& [name, child] = *it;
            if (child.is_none()) continue;
            py::object raw_c = join_name(frame.raw, name, names);
            if (w.is_stripped(name, frame.mod)) {
                stack.push_back(Frame{child, raw_c, frame.canon});
            } else if (canon_is_raw) {
                stack.push_back(Frame{child, raw_c, raw_c});
            } else {
                stack.push_back(Frame{child, raw_c, join_name(frame.canon, name, names)});
            }
        }
        trace.words.push_back(w.wrapper_word(frame.mod.ptr(), has_module_key));
    }
    return out;
}

/// ``_core_py.module_walk._tables``: ``(fqn_of, canonical, param_of, slots)``; ``slots[i]`` is the name
/// ``param_of`` holds the i-th triple's parameter under, or ``None`` for a repeated parameter.
std::array<py::object, 4> tables(py::handle named) {
    py::object fqn_of = steal(PyDict_New());
    py::object canonical = steal(PyDict_New());
    py::object param_of = steal(PyDict_New());
    py::object slots = steal(PyList_New(0));
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
            check(PyList_Append(slots.ptr(), fqn.ptr()));
            primary = fqn;
        } else {
            primary = borrow(found);
            check(PyList_Append(slots.ptr(), Py_None));
        }
        if (PyDict_SetDefault(canonical.ptr(), fqn.ptr(), primary.ptr()) == nullptr) throw py::error_already_set();
        if (PyDict_SetDefault(canonical.ptr(), t[0].ptr(), primary.ptr()) == nullptr) throw py::error_already_set();
    });
    return {fqn_of, canonical, param_of, slots};
}

/// ``a == b`` for two exact str objects.
bool same_key(PyObject* a, PyObject* b) {
    if (a == b) return true;
    if (!PyUnicode_CheckExact(b)) return false;
    const int c = PyUnicode_Compare(a, b);
    if (c == -1 && PyErr_Occurred()) throw py::error_already_set();
    return c == 0;
}

/// The memo's fields (``_core_py.module_walk.map_parameters`` documents them).
enum MemoField { kStripped, kWrapper, kWords, kKeys, kSlots, kFqnOf, kCanonical, kMemoSize };

/// ``_core_py.module_walk._replay``: walk ``model`` comparing every module, key and value with the memo's
/// trace; the new ``param_of`` when all of them are the same, else ``None``.
py::object replay(Walk& w, py::handle model, py::handle base_named_parameters, py::handle memo) {
    const Names& names = w.names;
    if (!type_attr_is(model, names.named_parameters, base_named_parameters)) return py::none();
    py::object words_obj = borrow(PyTuple_GET_ITEM(memo.ptr(), kWords));
    PyObject* keys = PyTuple_GET_ITEM(memo.ptr(), kKeys);
    PyObject* slots = PyTuple_GET_ITEM(memo.ptr(), kSlots);
    if (!PyBytes_CheckExact(words_obj.ptr()) || !PyTuple_CheckExact(keys) || !PyTuple_CheckExact(slots)) {
        raise_builtin(PyExc_TypeError, Msg() << "map_parameters: cached is not a memo of map_parameters");
    }
    const size_t n_words = static_cast<size_t>(PyBytes_GET_SIZE(words_obj.ptr())) / sizeof(uint64_t);
    const char* word_bytes = PyBytes_AS_STRING(words_obj.ptr());
    const Py_ssize_t n_keys = PyTuple_GET_SIZE(keys);
    const Py_ssize_t n_slots = PyTuple_GET_SIZE(slots);
    size_t wi = 0;
    Py_ssize_t ki = 0;
    Py_ssize_t si = 0;
    auto next_word = [&](uint64_t& out) {
        if (wi >= n_words) return false;
        std::memcpy(&out, word_bytes + wi * sizeof(uint64_t), sizeof(uint64_t));
        ++wi;
        return true;
    };
    // ``k`` is the next key and ``v`` the next value of the trace
    auto same_entry = [&](PyObject* k, PyObject* v) {
        uint64_t word = 0;
        if (ki >= n_keys || !next_word(word) || word != id_word(v)) return false;
        return same_key(PyTuple_GET_ITEM(keys, ki++), k);
    };
    py::object param_of = steal(PyDict_New());
    std::vector<py::object> stack{borrow(model.ptr())};
    std::vector<py::object> children;
    while (!stack.empty()) {
        py::object held = std::move(stack.back());
        stack.pop_back();
        PyObject* mod = held.ptr();
        uint64_t word = 0;
        if (!next_word(word) || word != id_word(mod) || !w.named_modules_ok(mod)) return py::none();
        bool has_module_key = false;
        py::object params = w.module_attr(mod, names.parameters);
        if (!replayable_mapping(params.ptr()) || !next_word(word) ||
            word != static_cast<uint64_t>(PyDict_GET_SIZE(params.ptr()))) {
            return py::none();
        }
        const bool params_same = each_entry(params.ptr(), [&](PyObject* k, PyObject* v) {
            if (!same_entry(k, v)) return false;
            has_module_key = has_module_key || is_module_key(k);
            if (v == Py_None) return true;
            if (si >= n_slots) return false;
            PyObject* slot = PyTuple_GET_ITEM(slots, si++);
            if (slot != Py_None) check(PyDict_SetItem(param_of.ptr(), slot, v));
            return true;
        });
        if (!params_same) return py::none();
        py::object mods = w.module_attr(mod, names.modules);
        if (!replayable_mapping(mods.ptr()) || !next_word(word) ||
            word != static_cast<uint64_t>(PyDict_GET_SIZE(mods.ptr()))) {
            return py::none();
        }
        children.clear();
        const bool mods_same = each_entry(mods.ptr(), [&](PyObject* k, PyObject* v) {
            if (!same_entry(k, v)) return false;
            has_module_key = has_module_key || is_module_key(k);
            if (v != Py_None) children.emplace_back(borrow(v));
            return true;
        });
        if (!mods_same) return py::none();
        for (auto it = children.rbegin(); it != children.rend(); ++it) stack.push_back(*it);
        if (!next_word(word) || word != w.wrapper_word(mod, has_module_key)) return py::none();
    }
    if (wi != n_words || ki != n_keys || si != n_slots) return py::none();
    return param_of;
}

}  // namespace

py::object map_parameters(py::object model, py::object stripped, py::object module_wrapper,
                          py::object base_named_modules, py::object base_named_parameters, py::object cached) {
    Walk w{Names(), stripped, module_wrapper, base_named_modules, IdMap(), IdMap()};
    if (!cached.is_none()) {
        if (!PyTuple_CheckExact(cached.ptr()) || PyTuple_GET_SIZE(cached.ptr()) != kMemoSize) {
            raise_builtin(PyExc_TypeError, Msg() << "map_parameters: cached is not a memo of map_parameters");
        }
        if (PyTuple_GET_ITEM(cached.ptr(), kStripped) == stripped.ptr() &&
            PyTuple_GET_ITEM(cached.ptr(), kWrapper) == module_wrapper.ptr()) {
            py::object param_of = replay(w, model, base_named_parameters, cached);
            if (!param_of.is_none()) {
                return py::make_tuple(cached, borrow(PyTuple_GET_ITEM(cached.ptr(), kFqnOf)),
                                      borrow(PyTuple_GET_ITEM(cached.ptr(), kCanonical)), param_of);
            }
        }
    }
    Trace trace;
    py::object named = walk(w, model, base_named_parameters, trace);
    if (named.is_none()) return py::none();
    auto [fqn_of, canonical, param_of, slots] = tables(named);
    py::object memo = py::none();
    if (trace.replayable) {
        py::bytes words(reinterpret_cast<const char*>(trace.words.data()), trace.words.size() * sizeof(uint64_t));
        memo = py::make_tuple(stripped, module_wrapper, words, steal(PyList_AsTuple(trace.keys.ptr())),
                              steal(PyList_AsTuple(slots.ptr())), fqn_of, canonical);
    }
    return py::make_tuple(memo, fqn_of, canonical, param_of);
}

py::tuple fqn_tables(py::object named) {
    auto [fqn_of, canonical, param_of, slots] = tables(named);
    return py::make_tuple(fqn_of, canonical, param_of);
}

}  // namespace sckpt
