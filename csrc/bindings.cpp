// The pybind11 module ``sparse_ckpt._C``: the C++ twin of ``sparse_ckpt._core_py``.
#include "core.hpp"

#ifndef SPARSE_CKPT_BUILD_ID  // CMakeLists.txt defines it: the hash of the csrc/ sources
#define SPARSE_CKPT_BUILD_ID ""
#endif

PYBIND11_MODULE(_C, m) {
    using namespace sckpt;
    m.doc() = "C++ core of sparse_ckpt: the twin of sparse_ckpt._core_py (same outputs, errors and messages for "
              "every input of the core's contract; see sparse_ckpt._core_py).";

    // The hash of the csrc/ sources this module was built from (CMakeLists.txt; sparse_ckpt/_backend.py).
    m.attr("_BUILD_ID") = py::str(SPARSE_CKPT_BUILD_ID);
    m.attr("MAGIC") = py::bytes(kMagic, 4);
    m.attr("VERSION") = kVersion;
    m.attr("MAX_DEPTH") = kMaxDepth;
    m.attr("PACKED_MARKER") = py::str(kPackedMarker);
    m.attr("STATE_PREFIX") = py::str(kStatePrefix);
    m.attr("GROUPS_PREFIX") = py::str(kGroupsPrefix);
    m.attr("PACKED_PREFIX") = py::str(kPackedPrefix);
    m.attr("SCALARS_PREFIX") = py::str(kScalarsPrefix);
    m.attr("ESCAPE") = py::str(kEscape);
    m.attr("ESCAPE_STR") = py::str(kEscapeStr);
    m.attr("ESCAPE_INT") = py::str(kEscapeInt);
    m.attr("STEP_KEY") = py::str(kStepKey);
    m.attr("KEYS_ENTRY") = py::str(kKeysEntry);
    m.attr("WRAPPER_CHILD") = py::str(kWrapperChild);

    m.def("map_parameters", &map_parameters, py::arg("model"), py::arg("stripped"), py::arg("module_wrapper"),
          py::arg("base_named_modules"), py::arg("base_named_parameters"), py::arg("cached"),
          "(memo, fqn_of, canonical, param_of) of a model, reusing the memo of an earlier call when the "
          "model's modules, keys and parameters are still the same objects; None for an override.");
    m.def("fqn_tables", &fqn_tables, py::arg("named"),
          "(fqn_of, canonical, param_of) from (raw, canonical name, param) triples.");
    m.def("pack_optimizer", &pack_optimizer, py::arg("leaf"), py::arg("param_groups"), py::arg("state"),
          py::arg("tensor_type"),
          "Pack param groups/state exactly as torch.optim.Optimizer.state_dict does: "
          "(packed_groups, packed_state, id_to_param).");
    m.def("remap_to_fqns", &remap_to_fqns, py::arg("leaf"), py::arg("packed_groups"), py::arg("packed_state"),
          py::arg("id_to_param"), py::arg("fqn_of"),
          "Turn a packed (int-id) optimizer dict into (groups_fqn, state_fqn).");
    m.def("flatten_state", &flatten_state, py::arg("leaf"), py::arg("state_fqn"), py::arg("known_fqns"),
          py::arg("escape"),
          "state.{fqn}.{key} for every state entry; nested dicts are flattened with '.' (escaped parts if escape).");
    m.def("flatten_packed_state", &flatten_packed_state, py::arg("leaf"), py::arg("state_fqn"), py::arg("known_fqns"),
          py::arg("tensor_type"), py::arg("cpu_dtypes"), py::arg("strided"), py::arg("scalar_parts"),
          "flatten_state(escape=True) with each parameter's leading scalars hoisted: (items, scalar_groups).");
    m.def("flatten_groups", &flatten_groups, py::arg("leaf"), py::arg("groups_fqn"),
          "param_groups.{fqn}.{key} for every parameter of every group.");
    m.def("unflatten", &unflatten, py::arg("flat"), py::arg("known_fqns"),
          "Split a flat/packed optimizer dict: (settings_by_fqn, state_by_fqn, packed_tables, scalar_tables, "
          "unmatched_keys).");
    m.def("encode_settings", &encode_settings, py::arg("leaf"), py::arg("group_index"), py::arg("settings"),
          py::arg("tensor_type"), py::arg("to_parts"), py::arg("to_name") = py::none(), "Encode one group's settings.");
    m.def("encode_table", &encode_table, py::arg("leaf"), py::arg("groups_fqn"), py::arg("tensor_type"),
          py::arg("to_parts"), py::arg("to_name") = py::none(),
          "Encode a leaf's groups as a table (version 1, or 2 when it holds a dtype or device).");
    m.def("decode_table", &decode_table, py::arg("leaf"), py::arg("data"), py::arg("from_parts"),
          py::arg("from_name") = py::none(),
          "Decode a table (version 1 or 2): (settings, settings_blobs, groups).");
    m.def("match_groups", &match_groups, py::arg("leaf"), py::arg("target_fqns"), py::arg("settings_of"),
          "For each target group pick the saved settings of its FQNs: (chosen, missing).");
    m.def("assign_state_ids", &assign_state_ids, py::arg("target_fqns"), py::arg("state_by_fqn"),
          "Give saved state to the target's packed ids: (packed_state, used_fqns).");
    m.def("fqns_of_groups", &fqns_of_groups, py::arg("leaf"), py::arg("param_groups"), py::arg("fqn_of"),
          "The canonical FQN of every parameter of every group, in group order.");
    m.def("build_groups", &build_groups, py::arg("param_groups"), py::arg("chosen"), py::arg("copy_settings"), py::arg("keep_names"),
          "The new param groups of a load: one new dict per group, params from the live group.");
    m.def("cast_states", &cast_states, py::arg("leaf"), py::arg("param_groups"), py::arg("target"),
          py::arg("chosen"), py::arg("state_of"), py::arg("state"), py::arg("tensor_type"),
          py::arg("check_shapes"), py::arg("cast_tensor"), py::arg("cast_value"),
          "Put each target parameter's saved state, cast as torch would, into state; return the used FQNs.");
    m.def("merge_table_settings", &merge_table_settings, py::arg("leaf"), py::arg("settings"), py::arg("groups"),
          py::arg("canonical"), py::arg("settings_of"),
          "Record a decoded table's settings by canonical FQN: (indices of its empty groups, first clash or None).");
    m.def("merge_scalars", &merge_scalars, py::arg("state_of"), py::arg("scalars_of"), py::arg("tensor_type"),
          "Each FQN's state: its scalars (own dicts and tensors) first, then its per-item entries.");
    m.def("unlisted_keys", &unlisted_keys, py::arg("keys_of"), py::arg("state_of"), py::arg("owned"),
          "(fqn, key) of every recorded state key of an owned FQN that is not a top-level key of its state.");
    m.def("capture_fqns", &capture_fqns, py::arg("leaf"), py::arg("param_groups"), py::arg("state"),
          py::arg("fqn_of"), py::arg("tensor_type"),
          "(groups_fqn, state_fqn) of a live optimizer leaf in one pass (no state_dict post-hooks).");
    m.def("encode_layout", &encode_layout, py::arg("leaf"), py::arg("entries"), py::arg("bucket_bytes"),
          "The layout table of a leaf's buffered state chunks and its buckets: (table, buckets).");
    m.def("plan_scatter", &plan_scatter, py::arg("leaf"), py::arg("layouts"), py::arg("chunk_of"),
          "Where each state chunk this rank needs comes from: (targets, sources, ops).");
    m.def("decode_layout", &decode_layout, py::arg("leaf"), py::arg("data"),
          "A layout table's buckets: [(dtype, numel, [(fqn, key, shape, offsets, sizes), ...]), ...].");
    m.def("crc32c", &crc32c, py::arg("data"), py::arg("value") = 0,
          "CRC-32C (Castagnoli) of a bytes-like object, continuing from value (a CRC of the bytes before).");
    m.def("gather_crc", &gather_crc, py::arg("dest"), py::arg("addresses"), py::arg("sizes"),
          "Copy sizes[i] bytes at each addresses[i], in order, into dest (exactly filled); its CRC-32C.");
    m.def("gather_many", &gather_many, py::arg("jobs"), py::arg("claims") = py::none(), py::arg("from_end") = false,
          "gather_crc of each job (dest, addresses, sizes, checksum) this call claims: its CRC-32C, or None.");
    m.def("claim_owners", &claim_owners, py::arg("leaf"), py::arg("groups_fqn"), py::arg("owner"),
          "Record leaf as owner of its FQNs; return (fqn, group index) of repeated listings.");
    m.def("collect_plain", &collect_plain, py::arg("state_fqn"), py::arg("items"), py::arg("param_of"),
          py::arg("tensor_type"), py::arg("dtensor_type"), py::arg("strided"), py::arg("parts"), py::arg("part_of"),
          py::arg("wholes"), py::arg("whole"), py::arg("spec_of"), py::arg("sharded"),
          py::arg("addresses") = py::none(),
          "Take the parameter-shaped state tensors of plain parameters out of items: (entries, locals).");
}
