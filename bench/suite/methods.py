"""The catalogue of what the bench measures: every :class:`Method` and its id.

A method id reads ``family/op[/backend][/fmt][/part]`` (e.g. ``sparse/save/cpp/packed``,
``dcp/load/packed/stateful``); :func:`plan_methods` lists every method in run order, the same for
every scale and layout. The ids the report divides are named constants here, so renaming a method
fails loudly (``verdicts.check_method_ids``) instead of turning a target into N/A.
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("cpp", "python")
FORMATS = ("packed", "flat")
NAIVE = "naive"
"""DCP format id of the naive layout (:func:`naive_state_dict`)."""
STATEFUL = "stateful"
"""DCP part id of the whole optimizer saved as a ``SparseOptimizerState`` and loaded with the planner."""
FIRST_CALL = "first"
"""part of the sparse save/load figures measured with no kept FQN map (``sc.clear_fqn_cache()``
before each sample, untimed): the first call on a model, which builds the map (see
``sparse_ckpt._fqn``); the plain figures are later calls, which check and reuse it."""
DCP_VARIANTS = (
    ("packed", "all"),
    ("packed", "groups"),
    ("packed", STATEFUL),
    ("flat", "all"),
    ("flat", "groups"),
    (NAIVE, "all"),
)
"""``(format, part)`` of every DCP figure, in run order."""
CORE_FUNCTIONS = (
    "pack_optimizer",
    "remap_to_fqns",
    "flatten_state",
    "flatten_groups",
    "encode_table",
    "decode_table",
    "unflatten.packed",
    "unflatten.flat",
    "match_groups",
    "assign_state_ids",
)
SPARSE_FAMILIES = ("sparse", "core")
"""Families whose figures are sparse_ckpt's own (the growth target applies to them)."""


def method_id(family: str, op: str, backend: str | None = None, fmt: str | None = None, part: str | None = None) -> str:
    """The id of a method (``family/op[/backend][/fmt][/part]``), without building its :class:`Method`."""
    return "/".join(x for x in (family, op, backend, fmt, part) if x)


def sparse_id(op: str, backend: str, fmt: str = "packed") -> str:
    """``sparse/{save,load}/{backend}/{fmt}``."""
    return method_id("sparse", op, backend, fmt)


def dcp_id(op: str, fmt: str, part: str) -> str:
    """``dcp/{save,load}/{fmt}/{part}``."""
    return method_id("dcp", op, None, fmt, part)


def core_id(function: str, backend: str) -> str:
    """``core/{fn}/{backend}[/{fmt}]`` for an entry of :data:`CORE_FUNCTIONS` (``unflatten.packed``)."""
    op, _, fmt = function.partition(".")
    return method_id("core", op, backend, fmt or None)


# Method ids that the targets, the plots and the command line refer to by name: a renamed method
# changes these, and verdicts.check_method_ids() fails loudly instead of a target turning N/A.
FLOOR_STATE_DICT = method_id("floor", "state_dict")
FLOOR_LOAD_STATE_DICT = method_id("floor", "load_state_dict")
DSD_GET = method_id("dsd", "get")
DSD_SET = method_id("dsd", "set")
DCP_STATEFUL_SAVE = dcp_id("save", "packed", STATEFUL)
DCP_STATEFUL_LOAD = dcp_id("load", "packed", STATEFUL)
DCP_NAIVE_SAVE = dcp_id("save", NAIVE, "all")
DCP_NAIVE_LOAD = dcp_id("load", NAIVE, "all")
DCP_PACKED_SAVE = dcp_id("save", "packed", "all")
DCP_PACKED_GROUPS_SAVE = dcp_id("save", "packed", "groups")
EXPORT_SAVE = method_id("export", "save")
EXPORT_LOAD = method_id("export", "load")


@dataclass(frozen=True)
class Method:
    """One measured operation."""

    family: str
    """``floor``, ``sparse``, ``dsd``, ``dcp``, ``export`` or ``core``."""
    op: str
    """``state_dict``, ``save``, ``load``, ``get``, ``set`` or a core function name."""
    backend: str | None = None
    fmt: str | None = None
    part: str | None = None
    """DCP only: ``all`` (state + groups), ``groups`` (param-group metadata alone) or ``stateful``
    (the whole optimizer as a ``SparseOptimizerState``, loaded with ``SparseLoadPlanner``)."""

    @property
    def id(self) -> str:
        """``family/op[/backend][/fmt][/part]``."""
        return method_id(self.family, self.op, self.backend, self.fmt, self.part)

    @property
    def label(self) -> str:
        """Human-readable name for tables and plots."""
        names = {
            ("floor", "state_dict"): "optimizer.state_dict() (floor)",
            ("floor", "load_state_dict"): "optimizer.load_state_dict() (floor)",
            ("sparse", "save"): "sparse_state_dict",
            ("sparse", "load"): "load_sparse_state_dict",
            ("dsd", "get"): "DSD get_optimizer_state_dict",
            ("dsd", "set"): "DSD set_optimizer_state_dict",
            ("dcp", "save"): "dcp.save",
            ("dcp", "load"): "dcp.load",
            ("export", "save"): "export_checkpoint (safetensors + JSON, from the SparseOptimizerState checkpoint)",
            ("export", "load"): "load_export",
        }
        base = names.get((self.family, self.op), f"core.{self.op}")
        if self.part == "groups":
            base += " (param groups only)"
        elif self.part == FIRST_CALL:
            base += " (first call: FQN map built)"
        elif self.part == STATEFUL:
            base += " (SparseOptimizerState)" if self.op == "save" else " (SparseLoadPlanner)"
        elif self.fmt == NAIVE:
            base += " (naive layout)"
        return base


def plan_methods() -> list[Method]:
    """Every method, in run order (the same list for every scale and layout)."""
    out = [Method("floor", "state_dict"), Method("floor", "load_state_dict")]
    for backend in BACKENDS:
        for fmt in FORMATS:
            out.append(Method("sparse", "save", backend, fmt))
            out.append(Method("sparse", "load", backend, fmt))
    out += [Method("sparse", op, "cpp", "packed", FIRST_CALL) for op in ("save", "load")]
    out += [Method("dsd", "get"), Method("dsd", "set")]
    for fmt, part in DCP_VARIANTS:
        out.append(Method("dcp", "save", None, fmt, part))
        out.append(Method("dcp", "load", None, fmt, part))
    out += [Method("export", "save"), Method("export", "load")]
    for backend in BACKENDS:
        for name in CORE_FUNCTIONS:
            op, _, fmt = name.partition(".")
            out.append(Method("core", op, backend, fmt or None))
    assert [m.id for m in out if m.family == "core"] == [core_id(f, b) for b in BACKENDS for f in CORE_FUNCTIONS]
    return out


def planned_ids() -> frozenset[str]:
    """The ids of :func:`plan_methods` (what a full run measures or records as skipped)."""
    return frozenset(m.id for m in plan_methods())
