// flatten_state / flatten_packed_state / flatten_groups / unflatten: the flat key layout (DSD's,
// and the packed format's per-item state with its scalar tables), both directions.
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core.hpp"

namespace sckpt {

namespace {

/// ``type(part) is str and "." not in part`` (the flat layout's rule); ``plain`` adds "and not
/// part.startswith('~')" (the packed layout's rule, see sparse_ckpt/_format/keys.py).
bool is_part(py::handle part, bool plain) {
    PyObject* p = part.ptr();
    if (!PyUnicode_CheckExact(p)) return false;
    const Py_ssize_t len = PyUnicode_GET_LENGTH(p);
    const Py_ssize_t dot = PyUnicode_FindChar(p, '.', 0, len, 1);
    if (dot == -2) throw py::error_already_set();
    if (dot != -1) return false;
    return !plain || len == 0 || PyUnicode_READ_CHAR(p, 0) != static_cast<Py_UCS4>(kEscape[0]);
}

py::object replace(py::handle s, const char* from, const char* to) {
    py::object f = steal(PyUnicode_FromString(from));
    py::object t = steal(PyUnicode_FromString(to));
    return steal(PyUnicode_Replace(s.ptr(), f.ptr(), t.ptr(), -1));
}

/// format.escape_part: ``~s`` + quoted str, ``~i`` + int; a null object for other types.
py::object escape_part(py::handle part) {
    if (PyUnicode_Check(part.ptr())) {
        py::object quoted = replace(replace(part, "%", "%25"), ".", "%2E");
        py::object head = steal(PyUnicode_FromString(kEscapeStr));
        return concat({head.ptr(), quoted.ptr()});
    }
    if (PyLong_CheckExact(part.ptr())) {
        py::object head = steal(PyUnicode_FromString(kEscapeInt));
        py::object text = steal(PyObject_Str(part.ptr()));
        return concat({head.ptr(), text.ptr()});
    }
    return py::object();
}

/// format.unescape_part for a part starting with ``~`` of state key ``key``.
py::object unescape_part(py::handle part, py::handle key) {
    PyObject* p = part.ptr();
    const Py_ssize_t len = PyUnicode_GET_LENGTH(p);
    if (starts_with(p, kEscapeStr, lit_len(kEscapeStr))) {
        py::object body = steal(PyUnicode_Substring(p, lit_len(kEscapeStr), len));
        return replace(replace(body, "%2E", "."), "%25", "%");
    }
    if (starts_with(p, kEscapeInt, lit_len(kEscapeInt))) {
        Py_ssize_t i = lit_len(kEscapeInt);
        if (i < len && PyUnicode_READ_CHAR(p, i) == '-') ++i;
        bool ok = i < len;
        for (Py_ssize_t j = i; j < len && ok; ++j) {
            const Py_UCS4 c = PyUnicode_READ_CHAR(p, j);
            ok = c >= '0' && c <= '9';
        }
        if (ok) {
            py::object text = steal(PyUnicode_Substring(p, lit_len(kEscapeInt), len));
            return steal(PyLong_FromUnicodeObject(text.ptr(), 10));
        }
    }
    raise_format_error(Msg() << "state key " << py_repr(key) << " has an invalid escaped part " << py_repr(part));
}

/// ``" -> ".join(repr(k) for k in path)``
py::object path_repr(const std::vector<py::handle>& path) {
    Msg m;
    for (size_t i = 0; i < path.size(); ++i) {
        if (i) m << " -> ";
        m << py_repr(path[i]);
    }
    return m.str();
}

struct FlattenCtx {
    PyObject* out;
    PyObject* dot;
    py::handle leaf;
    py::handle fqn;
    py::handle known;
    bool escape;
    Py_ssize_t state_len;  // len(kStatePrefix)
    std::vector<py::object>* emitted = nullptr;  // when set, every key written is appended, relative to
    PyObject* root = nullptr;                    // this prefix ("state.{fqn}"): a top-level key's part itself
};

bool known_contains(const FlattenCtx& c, PyObject* full) {
    py::object body = steal(PyUnicode_Substring(full, c.state_len, PyUnicode_GET_LENGTH(full)));
    const int found = PySequence_Contains(c.known.ptr(), body.ptr());
    check(found);
    return found != 0;
}

/// Python's ``_state_part``.
py::object state_part(const FlattenCtx& c, py::handle key, std::vector<py::handle>& path) {
    if (is_part(key, true)) return borrow(key.ptr());
    if (c.escape) {
        py::object escaped = escape_part(key);
        if (escaped) return escaped;
        path.push_back(key);
        raise_format_error(Msg() << "leaf " << py_repr(c.leaf) << ": state key " << path_repr(path) << " of "
                                 << py_repr(c.fqn) << " is a " << type_name(key) << "; state keys must be str or int");
    }
    if (is_part(key, false)) return borrow(key.ptr());
    path.push_back(key);
    raise_format_error(Msg() << "leaf " << py_repr(c.leaf) << ": state key " << path_repr(path) << " of "
                             << py_repr(c.fqn)
                             << " cannot be written in the flat format (a key must be a str without '.'); "
                                "save with format='packed'");
}

void flatten_into(const FlattenCtx& c, PyObject* prefix, py::handle value, std::vector<py::handle>& path);

/// Python's ``_flatten_item``: one entry ``key: item`` of the (nested) state under ``prefix``.
void flatten_item(const FlattenCtx& c, PyObject* prefix, py::handle key, py::handle item,
                  std::vector<py::handle>& path) {
    py::object part = state_part(c, key, path);
    py::object full = concat({prefix, c.dot, part.ptr()});
    if (PyDict_Check(item.ptr())) {
        if (PyDict_GET_SIZE(item.ptr()) == 0) {
            path.push_back(key);
            raise_format_error(Msg() << "leaf " << py_repr(c.leaf) << ": state key " << path_repr(path) << " of "
                                     << py_repr(c.fqn) << " holds an empty dict, which has no flat key");
        }
        if (known_contains(c, full.ptr())) {  // keys below would read as that parameter's state
            py::object escaped;
            if (c.escape && part.ptr() == key.ptr()) escaped = escape_part(key);
            py::object alt;
            if (escaped) alt = concat({prefix, c.dot, escaped.ptr()});
            if (!escaped || known_contains(c, alt.ptr())) {
                path.push_back(key);
                py::object owner = steal(PyUnicode_Substring(full.ptr(), c.state_len, PyUnicode_GET_LENGTH(full.ptr())));
                raise_format_error(Msg() << "leaf " << py_repr(c.leaf) << ": nested state " << path_repr(path)
                                         << " of " << py_repr(c.fqn) << " would be read back as state of parameter "
                                         << py_repr(owner) << (c.escape ? "" : "; save with format='packed'"));
            }
            full = std::move(alt);
        }
        path.push_back(key);
        flatten_into(c, full.ptr(), item, path);
        path.pop_back();
    } else {
        check(PyDict_SetItem(c.out, full.ptr(), item.ptr()));
        if (c.emitted != nullptr) {
            if (prefix == c.root) {
                c.emitted->push_back(std::move(part));  // a top-level entry: its part (often the key itself)
            } else {
                const Py_ssize_t cut = PyUnicode_GET_LENGTH(c.root) + 1;
                c.emitted->push_back(steal(PyUnicode_Substring(full.ptr(), cut, PyUnicode_GET_LENGTH(full.ptr()))));
            }
        }
    }
}

/// Python's ``_keys_record``: the grouping bytes of the ``~keys`` entry (UTF-8, lone surrogates
/// passed through; only compared, never decoded).
void append_keys_record(std::string& blob, const std::vector<py::object>& keys) {
    put_len_u32(blob, lit_len(kKeysEntry));
    blob.append(kKeysEntry, static_cast<size_t>(lit_len(kKeysEntry)));
    blob.push_back(static_cast<char>(7));  // the codec's tuple tag
    put_len_u32(blob, static_cast<Py_ssize_t>(keys.size()));
    for (const auto& k : keys) {
        blob.push_back(static_cast<char>(5));  // the codec's str tag
        if (PyBytes_Check(k.ptr())) {  // recorded as its surrogate-passing bytes
            put_len_u32(blob, PyBytes_GET_SIZE(k.ptr()));
            blob.append(PyBytes_AS_STRING(k.ptr()), static_cast<size_t>(PyBytes_GET_SIZE(k.ptr())));
            continue;
        }
        Py_ssize_t n = 0;
        const char* raw = PyUnicode_AsUTF8AndSize(k.ptr(), &n);  // cached in the str: no new object
        if (raw == nullptr) throw py::error_already_set();
        put_len_u32(blob, n);
        blob.append(raw, static_cast<size_t>(n));
    }
}

/// Python's ``_flatten_into``; the recursion guard turns a self-referencing dict into the
/// RecursionError Python raises instead of a C stack overflow.
void flatten_into(const FlattenCtx& c, PyObject* prefix, py::handle value, std::vector<py::handle>& path) {
    if (Py_EnterRecursiveCall(" while calling a Python object") != 0) throw py::error_already_set();
    struct Leave {
        ~Leave() { Py_LeaveRecursiveCall(); }
    } leave;
    iterate_items(value, [&](py::handle key, py::handle item) { flatten_item(c, prefix, key, item, path); });
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

// ``state.{fqn}`` for one parameter's state, which must be a dict (else a format error naming leaf and FQN).
py::object state_prefix_of(py::handle leaf, py::handle fqn, py::handle state, const py::object& state_prefix) {
    if (!PyDict_Check(state.ptr())) {
        raise_format_error(Msg() << "leaf " << py_repr(leaf) << ": state of " << py_repr(fqn) << " is a "
                                 << type_name(state) << ", expected a dict");
    }
    py::object fqn_str = fmt(fqn);
    return concat({state_prefix.ptr(), fqn_str.ptr()});
}

}  // namespace

py::object flatten_state(py::object leaf, py::object state_fqn, py::object known_fqns, bool escape) {
    py::object out = steal(PyDict_New());
    py::object dot = steal(PyUnicode_FromString("."));
    py::object state_prefix = steal(PyUnicode_FromString(kStatePrefix));
    iterate_items(state_fqn, [&](py::handle fqn, py::handle state) {
        py::object prefix = state_prefix_of(leaf, fqn, state, state_prefix);
        FlattenCtx ctx{out.ptr(), dot.ptr(), leaf, fqn, known_fqns, escape, lit_len(kStatePrefix)};
        std::vector<py::handle> path;
        flatten_into(ctx, prefix.ptr(), state, path);
    });
    return out;
}

py::tuple flatten_packed_state(py::object leaf, py::object state_fqn, py::object known_fqns, py::object tensor_type,
                               py::object cpu_dtypes, py::object strided, py::object scalar_parts) {
    const ScalarSpec spec(tensor_type, cpu_dtypes, strided, scalar_parts);
    py::object out = steal(PyDict_New());
    py::object groups = steal(PyList_New(0));
    std::vector<py::object> group_fqns;  // the fqns list of each group (also alive in ``groups``)
    std::unordered_map<std::string, size_t> index_of;
    py::object dot = steal(PyUnicode_FromString("."));
    py::object state_prefix = steal(PyUnicode_FromString(kStatePrefix));
    py::object keys_entry = steal(PyUnicode_InternFromString(kKeysEntry));
    std::string blob;
    std::vector<std::pair<py::object, py::object>> scalars;
    std::vector<py::object> emitted;
    iterate_items(state_fqn, [&](py::handle fqn, py::handle state) {
        py::object prefix = state_prefix_of(leaf, fqn, state, state_prefix);
        FlattenCtx ctx{out.ptr(), dot.ptr(), leaf, fqn, known_fqns, true, lit_len(kStatePrefix), &emitted, prefix.ptr()};
        std::vector<py::handle> path;
        emitted.clear();
        scalars.clear();  // (key, value) of the leading run; a dict is built only for a new group
        blob.assign(4, '\0');  // u32 n_keys, written below
        bool leading = true;
        iterate_items(state, [&](py::handle key, py::handle item) {
            if (leading) {
                if (is_part(key, true) && encode_scalar_record(blob, leaf, fqn, key, item, spec)) {
                    scalars.emplace_back(borrow(key.ptr()), borrow(item.ptr()));
                    return;
                }
                leading = false;
            }
            flatten_item(ctx, prefix.ptr(), key, item, path);
        });
        if (scalars.empty() && emitted.empty()) return;  // an empty state dict: no state
        for (size_t i = 0; i < emitted.size(); ++i) {
            if (PyUnicode_AsUTF8AndSize(emitted[i].ptr(), nullptr) == nullptr) {  // Python's _recorded_key
                if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) throw py::error_already_set();
                PyErr_Clear();
                emitted[i] = steal(PyUnicode_AsEncodedString(emitted[i].ptr(), "utf-8", "surrogatepass"));
            }
        }
        append_keys_record(blob, emitted);
        std::string ident;
        put_len_u32(ident, static_cast<Py_ssize_t>(scalars.size() + 1));  // the scalars and the keys record
        blob.replace(0, 4, ident);
        auto found = index_of.find(blob);
        if (found == index_of.end()) {
            index_of.emplace(blob, group_fqns.size());
            // the keys record's tuple is built for a new group only (a parameter joining a group has
            // the group's keys: its blob is the group's)
            py::object keys = steal(PyTuple_New(static_cast<Py_ssize_t>(emitted.size())));
            for (size_t i = 0; i < emitted.size(); ++i) {
                PyTuple_SET_ITEM(keys.ptr(), static_cast<Py_ssize_t>(i), emitted[i].inc_ref().ptr());
            }
            scalars.emplace_back(keys_entry, keys);
            py::object dict = steal(PyDict_New());
            for (const auto& kv : scalars) check(PyDict_SetItem(dict.ptr(), kv.first.ptr(), kv.second.ptr()));
            py::object fqns = steal(PyList_New(0));
            check(PyList_Append(fqns.ptr(), fqn.ptr()));
            py::object entry = py::make_tuple(dict, fqns);
            check(PyList_Append(groups.ptr(), entry.ptr()));
            group_fqns.push_back(std::move(fqns));
        } else {
            check(PyList_Append(group_fqns[found->second].ptr(), fqn.ptr()));
        }
    });
    return py::make_tuple(out, groups);
}

py::object flatten_groups(py::object leaf, py::object groups_fqn) {
    py::object out = steal(PyDict_New());
    py::object dot = steal(PyUnicode_FromString("."));
    py::object head = steal(PyUnicode_FromString(kGroupsPrefix));
    long gi = -1;
    iterate(groups_fqn, [&](py::handle entry) {
        ++gi;
        py::object parts[2];
        unpack(entry, 2, parts);
        py::handle settings = parts[0];
        iterate_items(settings, [&](py::handle key, py::handle) {
            if (!is_part(key, false)) {
                raise_format_error(Msg() << "leaf " << py_repr(leaf) << " group " << gi << ": setting key "
                                         << py_repr(key)
                                         << " cannot be written in the flat format (a key must be a str without '.'); "
                                            "save with format='packed'");
            }
        });
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
    static constexpr Py_ssize_t kStateLen = lit_len(kStatePrefix);
    static constexpr Py_ssize_t kGroupsLen = lit_len(kGroupsPrefix);
    static constexpr Py_ssize_t kPackedLen = lit_len(kPackedPrefix);
    static constexpr Py_ssize_t kScalarsLen = lit_len(kScalarsPrefix);

    py::object settings_by_fqn = steal(PyDict_New());
    py::object packed = steal(PyDict_New());
    py::object scalars = steal(PyDict_New());
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
        if (starts_with(k, kScalarsPrefix, kScalarsLen)) {
            if (!PyBytes_Check(value.ptr())) {
                raise_format_error(Msg() << "scalar table " << py_repr(key) << " is a " << type_name(value)
                                         << ", expected bytes");
            }
            py::object rest = steal(PyUnicode_Substring(k, kScalarsLen, len));
            check(PyDict_SetItem(scalars.ptr(), rest.ptr(), value.ptr()));
        } else if (starts_with(k, kStatePrefix, kStateLen)) {
            state_keys.emplace_back(borrow(k), flat_is_dict ? borrow(value.ptr()) : py::object());
        } else if (starts_with(k, kPackedPrefix, kPackedLen)) {
            if (!PyBytes_Check(value.ptr())) {
                raise_format_error(Msg() << "packed group table " << py_repr(key) << " is a " << type_name(value)
                                         << ", expected bytes");
            }
            py::object rest = steal(PyUnicode_Substring(k, kPackedLen, len));
            check(PyDict_SetItem(packed.ptr(), rest.ptr(), value.ptr()));
        } else if (starts_with(k, kGroupsPrefix, kGroupsLen)) {
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

    if (PyCallable_Check(known_fqns.ptr())) {
        known_fqns = steal(PyObject_CallFunctionObjArgs(known_fqns.ptr(), packed.ptr(), nullptr));
    }
    const bool unescape = PyDict_GET_SIZE(packed.ptr()) > 0 || PyDict_GET_SIZE(scalars.ptr()) > 0;
    py::object state_by_fqn = steal(PyDict_New());
    std::unordered_set<PyObject*> owned;  // dicts built here (all alive in state_by_fqn until we return)
    py::object dot_str = steal(PyUnicode_FromString("."));
    const bool known_is_dict = PyDict_CheckExact(known_fqns.ptr());
    // Keys of one parameter come together: when a key is ``state.{previous owner}.{one part}``,
    // that owner is its longest known prefix (a longer one would end at a dot of the part).
    py::object prev_fqn;
    Py_ssize_t prev_len = 0;
    // The last parts met (``exp_avg``, ``step``, ...) reused as they are, not rebuilt per key.
    std::vector<py::object> recent_parts;
    for (auto& kv : state_keys) {
        PyObject* k = kv.first.ptr();
        const Py_ssize_t len = PyUnicode_GET_LENGTH(k);
        if (prev_fqn && len > kStateLen + prev_len + 1 &&
            PyUnicode_READ_CHAR(k, kStateLen + prev_len) == '.' &&
            PyUnicode_Tailmatch(k, prev_fqn.ptr(), kStateLen, kStateLen + prev_len, -1) == 1) {
            const Py_ssize_t part_at = kStateLen + prev_len + 1;
            const Py_ssize_t more = PyUnicode_FindChar(k, '.', part_at, len, 1);
            if (more == -2) throw py::error_already_set();
            if (more == -1) {
                py::object part;
                for (const py::object& r : recent_parts) {
                    if (PyUnicode_GET_LENGTH(r.ptr()) == len - part_at &&
                        PyUnicode_Tailmatch(k, r.ptr(), part_at, len, 1) == 1) {
                        part = r;
                        break;
                    }
                }
                if (!part) {
                    part = steal(PyUnicode_Substring(k, part_at, len));
                    if (recent_parts.size() < 8) recent_parts.push_back(part);
                }
                if (unescape && starts_with(part.ptr(), kEscape, lit_len(kEscape))) part = unescape_part(part, kv.first);
                py::object node = dict_get(state_by_fqn, prev_fqn);  // built for the previous key
                const int present = PyDict_Contains(node.ptr(), part.ptr());
                check(present);
                if (present && PyDict_Check(PyDict_GetItemWithError(node.ptr(), part.ptr()))) {
                    raise_format_error(Msg() << "state key " << py_repr(kv.first) << " collides with nested state of "
                                             << py_repr(prev_fqn));
                }
                py::object value = kv.second ? kv.second : steal(PyObject_GetItem(flat.ptr(), k));
                check(PyDict_SetItem(node.ptr(), part.ptr(), value.ptr()));
                continue;
            }
        }
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
        prev_fqn = fqn;
        prev_len = PyUnicode_GET_LENGTH(fqn.ptr());
        bool created = false;
        // a top-level node is never another node's child, so it needs no entry in ``owned``
        py::object node = setdefault_dict(state_by_fqn, fqn, &created);
        py::object last;
        const Py_ssize_t next_dot = PyUnicode_FindChar(k, '.', dot + 1, len, 1);
        if (next_dot == -2) throw py::error_already_set();
        auto decoded = [&](py::object part) {
            if (unescape && starts_with(part.ptr(), kEscape, lit_len(kEscape))) return unescape_part(part, kv.first);
            return part;
        };
        if (next_dot == -1) {
            last = decoded(steal(PyUnicode_Substring(k, dot + 1, len)));
        } else {
            py::object rest = steal(PyUnicode_Substring(k, dot + 1, len));
            py::object parts = steal(PyUnicode_Split(rest.ptr(), dot_str.ptr(), -1));
            const Py_ssize_t n_parts = PyList_GET_SIZE(parts.ptr());
            if (unescape) {
                for (Py_ssize_t i = 0; i < n_parts; ++i) {
                    py::object part = decoded(borrow(PyList_GET_ITEM(parts.ptr(), i)));
                    check(PyList_SetItem(parts.ptr(), i, part.release().ptr()));
                }
            }
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
    return py::make_tuple(settings_by_fqn, state_by_fqn, packed, scalars, unmatched);
}

}  // namespace sckpt
