"""Pure-Python reference core, the twin of the C++ core ``sparse_ckpt._C`` (``csrc/``).

This package is the contract of the core: every function here has a C++ twin with identical
outputs (including dict key order) and identical exception types and messages for every input
inside the input contract (:mod:`.common`). The core owns only the hot loops; it knows nothing of
hooks, DCP or torch beyond the ``tensor_type`` and the tensor (de)serialising callbacks it is
handed. The formats it reads and writes are specified in docs/formats.md.

One module per C++ source file, same base name: ``csrc/X.cpp`` <-> ``_core_py/X.py``
(``common.py`` also mirrors ``common.hpp``; ``bindings.cpp`` <-> this ``__init__``). This module
exposes exactly the names ``sparse_ckpt._C`` exposes; ``sparse_ckpt/_C.pyi`` is generated from it
(``python csrc/gen_stub.py``), and tests/core/test_core_stub.py checks names and signatures of both
cores against each other. CONTRIBUTING.md has the recipe for adding a core function.
"""

from .._format.keys import (
    ESCAPE,
    ESCAPE_INT,
    ESCAPE_STR,
    GROUPS_PREFIX,
    KEYS_ENTRY,
    PACKED_MARKER,
    PACKED_PREFIX,
    SCALARS_PREFIX,
    STATE_PREFIX,
    STEP_KEY,
    WRAPPER_CHILD,
)
from .bucket_collect import collect_plain
from .capture import pack_optimizer, remap_to_fqns
from .checksum import crc32c, gather_crc, gather_many
from .common import MAGIC, MAX_DEPTH, VERSION
from .flat_keys import flatten_groups, flatten_packed_state, flatten_state, unflatten
from .layout_codec import decode_layout, encode_layout, plan_scatter
from .load_assembly import build_groups, cast_states, fqns_of_groups, merge_scalars, merge_table_settings, unlisted_keys
from .load_match import assign_state_ids, match_groups
from .module_walk import fqn_tables, map_parameters
from .save_pass import capture_fqns, claim_owners
from .table_codec import decode_table, encode_settings, encode_table

__all__ = [
    "ESCAPE",
    "ESCAPE_INT",
    "ESCAPE_STR",
    "GROUPS_PREFIX",
    "KEYS_ENTRY",
    "MAGIC",
    "MAX_DEPTH",
    "PACKED_MARKER",
    "PACKED_PREFIX",
    "SCALARS_PREFIX",
    "STATE_PREFIX",
    "STEP_KEY",
    "VERSION",
    "WRAPPER_CHILD",
    "assign_state_ids",
    "build_groups",
    "capture_fqns",
    "cast_states",
    "claim_owners",
    "collect_plain",
    "crc32c",
    "decode_layout",
    "decode_table",
    "encode_layout",
    "encode_settings",
    "encode_table",
    "flatten_groups",
    "flatten_packed_state",
    "flatten_state",
    "fqn_tables",
    "fqns_of_groups",
    "gather_crc",
    "gather_many",
    "map_parameters",
    "match_groups",
    "merge_scalars",
    "merge_table_settings",
    "pack_optimizer",
    "plan_scatter",
    "remap_to_fqns",
    "unflatten",
    "unlisted_keys",
]
