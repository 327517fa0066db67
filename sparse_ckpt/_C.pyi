# ruff: noqa: N999 - the extension module is named _C
"""Type stub of sparse_ckpt._C, the C++ twin of sparse_ckpt._core_py (same functions, same signatures;
the argument types are the core's input contract, see sparse_ckpt._core_py).

Checked against ``_core_py`` by tests/test_structure.py.
"""

from collections.abc import Callable
from typing import Any, TypeAlias

TensorToParts: TypeAlias = Callable[[Any], tuple[str, tuple[int, ...], str, bytes]]
PartsToTensor: TypeAlias = Callable[[str, tuple[int, ...], str, bytes], Any]
ScalarParts: TypeAlias = Callable[[Any], tuple[str, tuple[int, ...], str, bytes] | None]

MAGIC: bytes
VERSION: int
MAX_DEPTH: int
PACKED_MARKER: str
STATE_PREFIX: str
GROUPS_PREFIX: str
PACKED_PREFIX: str
SCALARS_PREFIX: str
ESCAPE: str
ESCAPE_STR: str
ESCAPE_INT: str
STEP_KEY: str
KEYS_ENTRY: str
WRAPPER_CHILD: str

def assign_state_ids(target_fqns: list[list[str]], state_by_fqn: dict[str, Any]) -> tuple[dict[int, Any], list[str]]: ...

def build_groups(
    param_groups: list[dict], chosen: list[dict | None], copy_settings: Callable[[Any], Any], keep_names: bool
) -> list[dict]: ...

def cast_states(
    leaf: str,
    param_groups: list[dict],
    target: list[list[str]],
    chosen: list[dict | None],
    state_of: dict[str, Any],
    state: dict,
    tensor_type: type,
    check_shapes: Callable[[str, str, Any, Any], None] | None,
    cast_tensor: Callable[[Any, Any, bool, bool, Any, Any], Any],
    cast_value: Callable[[Any, Any, bool, Any], Any],
) -> list[str]: ...

def capture_fqns(
    leaf: str, param_groups: list[dict], state: dict, fqn_of: dict[int, str], tensor_type: type
) -> tuple[list[tuple[dict, list[str]]], dict[str, Any]]: ...

def claim_owners(leaf: str, groups_fqn: list[tuple[dict, list[str]]], owner: dict[str, str]) -> list[tuple[str, int]]: ...

def decode_table(leaf: str, data: bytes, from_parts: PartsToTensor) -> tuple[list[dict], list[bytes], list[tuple[int, list[str]]]]: ...

def decode_layout(
    leaf: str, data: bytes
) -> list[tuple[str, int, list[tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]]]: ...

def encode_layout(
    leaf: str, entries: list[tuple[str, str, str, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]], bucket_bytes: int
) -> tuple[bytes, list[tuple[str, int, list[tuple[int, int]]]]]: ...

def encode_settings(leaf: str, group_index: int, settings: dict[Any, Any], tensor_type: type, to_parts: TensorToParts) -> bytes: ...

def encode_table(leaf: str, groups_fqn: list[tuple[dict, list[str]]], tensor_type: type, to_parts: TensorToParts) -> bytes: ...

def flatten_groups(leaf: str, groups_fqn: list[tuple[dict, list[str]]]) -> dict[str, Any]: ...

def flatten_packed_state(
    leaf: str,
    state_fqn: dict[str, Any],
    known_fqns: Any,
    tensor_type: type,
    cpu_dtypes: dict,
    strided: Any,
    scalar_parts: ScalarParts,
) -> tuple[dict[str, Any], list[tuple[dict[str, Any], list[str]]]]: ...

def flatten_state(leaf: str, state_fqn: dict[str, Any], known_fqns: Any, escape: bool) -> dict[str, Any]: ...

def fqn_tables(named: Any) -> tuple[dict[int, str], dict[str, str], dict[str, Any]]: ...

def fqns_of_groups(leaf: str, param_groups: list[dict], fqn_of: dict[int, str]) -> list[list[str]]: ...

def map_parameters(
    model: Any,
    stripped: Any,
    module_wrapper: type | None,
    base_named_modules: Any,
    base_named_parameters: Any,
    cached: tuple | None,
) -> tuple[tuple | None, dict[int, str], dict[str, str], dict[str, Any]] | None: ...

def match_groups(
    leaf: str, target_fqns: list[list[str]], settings_of: dict[str, Any]
) -> tuple[list[Any], list[str]]: ...

def merge_scalars(
    state_of: dict[str, dict], scalars_of: dict[str, tuple[dict[str, Any], str]], tensor_type: type
) -> dict[str, dict]: ...

def merge_table_settings(
    leaf: str,
    settings: list[dict],
    groups: list[tuple[int, list[str]]],
    canonical: dict[str, str],
    settings_of: dict[str, dict],
) -> tuple[list[int], tuple[str, int] | None]: ...

def unlisted_keys(
    keys_of: dict[str, tuple[tuple[str, ...], str]], state_of: dict[str, dict], owned: dict[str, Any]
) -> list[tuple[str, str]]: ...

def pack_optimizer(
    leaf: str, param_groups: list[dict], state: dict[Any, Any], tensor_type: type
) -> tuple[list[dict], dict[Any, Any], list[Any]]: ...

def plan_scatter(
    leaf: str, layouts: list[bytes], chunk_of: Callable[[str], tuple[tuple[int, ...], tuple[int, ...]] | None]
) -> tuple[list[tuple[Any, ...]], list[tuple[int, int, str, int]], list[tuple[Any, ...]]]: ...

def remap_to_fqns(
    leaf: str,
    packed_groups: list[dict],
    packed_state: dict[Any, Any],
    id_to_param: list[Any],
    fqn_of: dict[int, str],
) -> tuple[list[tuple[dict, list[str]]], dict[str, Any]]: ...

def unflatten(
    flat: dict[str, Any], known_fqns: Any
) -> tuple[dict[str, dict], dict[str, dict], dict[str, bytes], dict[str, bytes], list[str]]: ...
