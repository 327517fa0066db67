// The functions of the C++ core; each is the twin of the same-named function of the module with
// the same base name in sparse_ckpt/_core_py/ (csrc/X.cpp <-> sparse_ckpt/_core_py/X.py; same
// arguments, outputs, exception types and messages).
#pragma once

#include "common.hpp"

namespace sckpt {

// module_walk.cpp
py::object map_parameters(py::object model, py::object stripped, py::object module_wrapper,
                          py::object base_named_modules, py::object base_named_parameters, py::object cached);
py::tuple fqn_tables(py::object named);

// capture.cpp
py::tuple pack_optimizer(py::object leaf, py::object param_groups, py::object state, py::object tensor_type);
py::tuple remap_to_fqns(py::object leaf, py::object packed_groups, py::object packed_state, py::object id_to_param,
                        py::object fqn_of);

// flat_keys.cpp
py::object flatten_state(py::object leaf, py::object state_fqn, py::object known_fqns, bool escape);
py::object flatten_groups(py::object leaf, py::object groups_fqn);
py::tuple unflatten(py::object flat, py::object known_fqns);
py::tuple flatten_packed_state(py::object leaf, py::object state_fqn, py::object known_fqns, py::object tensor_type,
                               py::object cpu_dtypes, py::object strided, py::object scalar_parts);

// table_codec.cpp
py::bytes encode_settings(py::object leaf, py::object group_index, py::object settings, py::object tensor_type,
                          py::object to_parts, py::object to_name);
py::bytes encode_table(py::object leaf, py::object groups_fqn, py::object tensor_type, py::object to_parts,
                       py::object to_name);
py::tuple decode_table(py::object leaf, py::object data, py::object from_parts, py::object from_name);
/// ``obj.name``, fastest for objects of one exact type: when that type uses the generic attribute lookup
/// and ``name`` is a data descriptor of it (a getset, as torch's tensor properties are), the
/// descriptor found once is called directly -- what the generic lookup does for a data
/// descriptor, without the per-object type lookup. Otherwise it is ``PyObject_GetAttr``. Valid
/// while the type's attributes do not change (the core's callbacks do not change them).
class TypeAttr {
public:
    TypeAttr(py::handle type, const char* name);
    py::object get(PyObject* obj) const {
        if (descr_ && reinterpret_cast<PyObject*>(Py_TYPE(obj)) == type_.ptr()) {
            return steal(get_(descr_.ptr(), obj, type_.ptr()));
        }
        return steal(PyObject_GetAttr(obj, name_.ptr()));
    }

private:
    py::object name_;
    py::object type_;
    py::object descr_;
    descrgetfunc get_ = nullptr;
};

/// What flatten_packed_state needs to tell a scalar-table entry (see _core_py.table_codec.scalar_record):
/// the callers' objects and the attributes read of a 0-d ``tensor_type`` value.
struct ScalarSpec {
    ScalarSpec(py::handle tensor_type_, py::handle cpu_dtypes_, py::handle strided_, py::handle scalar_parts_);
    py::handle tensor_type;
    py::handle cpu_dtypes;  // exact dict: dtype -> (str name, int itemsize), checked by the constructor;
                            // no complex dtype (the only ones with a conj bit)
    py::handle strided;
    py::handle scalar_parts;
    TypeAttr ndim, dtype, requires_grad, is_cpu, layout;
    py::object is_neg, data_ptr;  // method names
};

/// ``_core_py.table_codec.scalar_record`` for a ``key`` that is a plain part (an exact str): appends the
/// entry's table-codec bytes to ``out`` and returns true, or leaves ``out`` as it was and
/// returns false when the entry is no scalar-table entry. Used by flatten_packed_state.
bool encode_scalar_record(std::string& out, py::handle leaf, py::handle fqn, py::handle key, py::handle value,
                          const ScalarSpec& spec);

// load_match.cpp
py::tuple match_groups(py::object leaf, py::object target_fqns, py::object settings_of);
py::tuple assign_state_ids(py::object target_fqns, py::object state_by_fqn);

// load_assembly.cpp
py::object fqns_of_groups(py::object leaf, py::object param_groups, py::object fqn_of);
py::object build_groups(py::object param_groups, py::object chosen, py::object copy_settings, bool keep_names);
py::object cast_states(py::object leaf, py::object param_groups, py::object target, py::object chosen,
                       py::object state_of, py::object state, py::object tensor_type, py::object check_shapes,
                       py::object cast_tensor, py::object cast_value);
py::tuple merge_table_settings(py::object leaf, py::object settings, py::object groups, py::object canonical,
                               py::object settings_of);
py::object merge_scalars(py::object state_of, py::object scalars_of, py::object tensor_type);
py::object unlisted_keys(py::object keys_of, py::object state_of, py::object owned);

// checksum.cpp
py::object crc32c(py::object data, py::object value);
py::object gather_crc(py::object dest, py::object addresses, py::object sizes);
py::object gather_many(py::object jobs, py::object claims, py::object from_end);

// layout_codec.cpp
py::tuple encode_layout(py::object leaf, py::object entries, py::object bucket_bytes);
py::tuple plan_scatter(py::object leaf, py::object layouts, py::object chunk_of);
py::object decode_layout(py::object leaf, py::object data);

// save_pass.cpp
py::tuple capture_fqns(py::object leaf, py::object param_groups, py::object state, py::object fqn_of,
                       py::object tensor_type);
py::object claim_owners(py::object leaf, py::object groups_fqn, py::object owner);

// bucket_collect.cpp
py::tuple collect_plain(py::object state_fqn, py::object items, py::object param_of, py::object tensor_type,
                        py::object dtensor_type, py::object strided, py::object parts, py::object part_of,
                        py::object wholes, py::object whole, py::object spec_of, py::object sharded,
                        py::object addresses);

}  // namespace sckpt
