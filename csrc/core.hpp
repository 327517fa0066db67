// The functions of the C++ core; each is the twin of the same-named function of
// sparse_ckpt/_core_py.py (same arguments, outputs, exception types and messages).
#pragma once

#include "common.hpp"

namespace sckpt {

// module_walk.cpp
py::object walk_parameters(py::object model, py::object stripped, py::object module_wrapper,
                           py::object base_named_modules, py::object base_named_parameters);
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
                               py::object scalar_parts);

// table_codec.cpp
py::bytes encode_settings(py::object leaf, py::object group_index, py::object settings, py::object tensor_type,
                          py::object to_parts);
py::bytes encode_table(py::object leaf, py::object groups_fqn, py::object tensor_type, py::object to_parts);
py::tuple decode_table(py::object leaf, py::object data, py::object from_parts);
/// ``_core_py._scalar_record`` for a ``key`` that is a plain part (an exact str): appends the
/// entry's table-codec bytes to ``out`` and returns true, or leaves ``out`` as it was and
/// returns false when the entry is no scalar-table entry. Used by flatten_packed_state.
bool encode_scalar_record(std::string& out, py::handle leaf, py::handle fqn, py::handle key, py::handle value,
                          py::handle tensor_type, py::handle scalar_parts);

// load_match.cpp
py::tuple match_groups(py::object leaf, py::object target_fqns, py::object settings_of);
py::tuple assign_state_ids(py::object target_fqns, py::object state_by_fqn);

// load_plan.cpp
py::object fqns_of_groups(py::object leaf, py::object param_groups, py::object fqn_of);
py::object build_groups(py::object param_groups, py::object chosen, py::object copy_settings, bool keep_names);
py::object cast_states(py::object leaf, py::object param_groups, py::object target, py::object new_groups,
                       py::object state_of, py::object state, py::object tensor_type, py::object check_shapes,
                       py::object cast_tensor, py::object cast_value);
py::object merge_table_settings(py::object leaf, py::object settings, py::object groups, py::object canonical,
                                py::object settings_of, py::object source_of, py::object table_leaf_of);

// save_pass.cpp
py::tuple capture_fqns(py::object leaf, py::object param_groups, py::object state, py::object fqn_of,
                       py::object tensor_type);
py::object claim_owners(py::object leaf, py::object groups_fqn, py::object owner);

}  // namespace sckpt
