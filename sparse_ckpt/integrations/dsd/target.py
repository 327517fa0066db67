"""The optimizer dicts this integration hands out, and how a trainer's own ``dcp.load`` fills them.

Every dict that `sparse_ckpt.integrations.dsd.get_optimizer_state_dict` returns is a
`DsdStateDict`: a plain ``dict`` in DSD's layout, *marked* by its class (a subclass of
`sparse_ckpt._dcp.stateful.SparseStateDict` carrying the model and optimizers it was built from).
A trainer that resumes builds its load target that way (``get_optimizer_state_dict`` on the fresh
optimizer, then ``dcp.load({"optim": osd, ...})``); the target of a fresh optimizer lacks the
checkpoint's state keys, and DSD's own target invents them with a synthetic step.

`rebuild_marked` runs in ``DefaultLoadPlanner.set_up_planner`` (patched by ``install()``,
so it reaches ``planner=None``, ``DefaultLoadPlanner()`` and every subclass that calls
``super().set_up_planner``; `sparse_ckpt.SparseLoadPlanner` does it itself): each marked
dict in the load target is rebuilt from the checkpoint's metadata, exactly as the library's planner
rebuilds its own targets -- the state the checkpoint has (this rank's parameters), every group's
settings, tables of a sparse_ckpt checkpoint -- so state that exists reaches the optimizer and
state that does not stays absent. Unmarked dicts (DSD's own, anything else) are planned as DCP
plans them, with one exception and one check. A trainer may copy the returned dict into a new one
before ``dcp.load`` (NeMo Automodel's ``OptimizerState`` does), which loses the mark; for a fresh
optimizer that copy asks for no state at all. `rebuild_copies` recognises such a copy (its
items are the very objects a recent call returned for an optimizer without state, still alive:
`remember_stateless`) and rebuilds it like the marked dict; any other unmarked optimizer dict
that asks for none of the state its checkpoint holds, or for the state of only some of its own
parameters while the checkpoint holds state of another of them (a copy of a dict handed out for
an optimizer that already had some state), fails the load there instead of silently leaving that
state unread: rebuilt or refused, never applied in part.
"""

from __future__ import annotations

import copy
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ..._dcp.paths import metadata_path, metadata_paths
from ..._dcp.planner import _find_targets, _TargetBuilder
from ..._dcp.stateful import SparseOptimizerState, SparseStateDict
from ..._format.keys_record import is_record_key
from ..._format.nested import NESTED_KEYS
from ..._torch_internals import caller_frame, dcp_storage_reader
from ...errors import CheckpointMismatchError

__all__ = [
    "DsdStateDict",
    "align_key_records",
    "marked_targets",
    "rebuild_copies",
    "rebuild_load_target",
    "rebuild_marked",
    "remember_stateless",
]

_STATE, _GROUPS = NESTED_KEYS


class DsdStateDict(SparseStateDict):
    """A DSD-layout optimizer dict made by ``integrations.dsd``: a ``dict`` whose class marks it as a
    load target `rebuild_marked` may rebuild. Copies (``copy.copy``, ``copy.deepcopy``) are
    plain dicts of its items; a pickle (``torch.save``) is a ``collections.OrderedDict`` of them,
    which ``torch.load`` reads with ``weights_only=True`` (its default; a ``dict`` built by a pickled
    call is refused there), as it reads a module's ``state_dict()``. No origin record: DSD's dicts
    carry none, and a full state dict is meant to travel."""

    __slots__ = ()

    def __init__(self, items: Mapping[str, Any], owner: SparseOptimizerState) -> None:
        super().__init__(items, owner)
        self.origin = None

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (OrderedDict, (), None, None, iter(dict(self).items()))

    def __copy__(self) -> dict[str, Any]:
        return dict(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return copy.deepcopy(dict(self), memo)


_STATELESS: deque[tuple[dict[str, Any], Callable[[], SparseOptimizerState | None]]] = deque(maxlen=8)
"""The last dicts handed out that ask for no state (a fresh optimizer's): their items (the optimizer's
own small ``param_groups`` values, or its nested ``state``/``param_groups`` objects) and how to make
their owner again (weak references: nothing here keeps a model or an optimizer alive)."""


def remember_stateless(target: DsdStateDict, make_owner: Callable[[], SparseOptimizerState | None]) -> None:
    """Record ``target`` if it asks for no state: a load target that is a shallow copy of it (a
    trainer that copies the returned dict before ``dcp.load``, e.g. NeMo Automodel's
    ``OptimizerState``) is then rebuilt like the dict itself (`rebuild_copies`)."""
    if not any(found[1] == _STATE for path in _leaf_paths(target) if (found := _section(path)) is not None):
        _STATELESS.append((dict(target), make_owner))


def _node(state_dict: Any, path: tuple[str | int, ...]) -> Any:
    for part in path:
        state_dict = state_dict[part] if isinstance(state_dict, Mapping) else state_dict[int(part)]
    return state_dict


class _Unmarked:
    """What one unmarked optimizer dict of a load target asks DCP for: the object paths of its state
    entries, and the FQNs whose settings it asks for (its parameters)."""

    __slots__ = ("asked", "fqns", "groups")

    def __init__(self) -> None:
        self.asked: set[tuple[str | int, ...]] = set()
        self.groups = False
        self.fqns: set[str] = set()


def _unmarked(state_dict: Any) -> dict[tuple[str | int, ...], _Unmarked]:
    """Path -> `_Unmarked` for each unmarked optimizer dict of a load target that asks for settings
    (every `SparseStateDict` is marked: a planner rebuilds it from the checkpoint)."""
    marked = {path for path, _target in _find_targets(state_dict, ())}
    found_at: dict[tuple[str | int, ...], _Unmarked] = {}
    for path in _leaf_paths(state_dict):
        found = _section(path)
        if found is None or found[0] in marked:
            continue
        entry = found_at.setdefault(found[0], _Unmarked())
        if found[1] == _STATE:
            entry.asked.add(path)
            continue
        entry.groups = True
        part = path[len(found[0])]
        if isinstance(part, str) and part.startswith(_GROUPS + "."):  # flat: param_groups.{fqn}.{setting}
            entry.fqns.add(part[len(_GROUPS) + 1 :].rsplit(".", 1)[0])
    for prefix, entry in found_at.items():  # nested: each group's "params" list of FQNs
        node = _node(state_dict, prefix) if entry.groups else None
        groups = node.get(_GROUPS) if isinstance(node, Mapping) else None
        if isinstance(groups, list):
            entry.fqns.update(f for g in groups if isinstance(g, Mapping) for f in _fqns(g.get("params")))
    return {prefix: entry for prefix, entry in found_at.items() if entry.groups}


def _fqns(params: Any) -> Iterator[str]:
    """The FQNs a load target's ``params`` entry lists. The hook sees every load target in the process,
    whoever built it: a placeholder (``None``, torchtune's target for a stock async checkpoint), a
    ``Tensor`` or a list of parameter ids asks DCP for an item like any other value and lists no FQN."""
    if isinstance(params, (list, tuple)):
        yield from (f for f in params if isinstance(f, str))


def _state_fqn(path: tuple[str | int, ...], prefix: tuple[str | int, ...], fqns: set[str]) -> str | None:
    """The FQN of ``fqns`` a checkpoint state entry at ``path`` below ``prefix`` belongs to (flat:
    the longest FQN prefix of ``state.{fqn}.{key}``; nested: ``state``/``{fqn}``), else ``None``."""
    part = path[len(prefix)] if len(path) > len(prefix) else None
    if part == _STATE:
        fqn = path[len(prefix) + 1] if len(path) > len(prefix) + 1 else None
        return fqn if fqn in fqns else None
    if not isinstance(part, str) or not part.startswith(_STATE + "."):
        return None
    rest = part[len(_STATE) + 1 :]
    while "." in rest:
        rest = rest.rsplit(".", 1)[0]
        if rest in fqns:
            return rest
    return None


def _starved(
    unmarked: dict[tuple[str | int, ...], _Unmarked], metadata: Metadata
) -> dict[tuple[str | int, ...], tuple[str, str | None]]:
    """``path -> (a checkpoint key, its parameter's FQN or None)`` for every unmarked optimizer dict
    under which the checkpoint holds state that DCP would silently leave unread: any state, for a
    dict that asks for none; for one that asks for some, the state of one of its own parameters that
    it does not ask for (a shallow copy of a dict handed out for an optimizer with partial state)."""
    out: dict[tuple[str | int, ...], tuple[str, str | None]] = {}
    if not unmarked:
        return out
    for key in metadata.state_dict_metadata:
        path = metadata_path(metadata, key)
        found = _section(path)
        if found is None or found[1] != _STATE or found[0] not in unmarked or found[0] in out:
            continue
        entry = unmarked[found[0]]
        if not entry.asked:
            out[found[0]] = (key, None)
        elif path not in entry.asked:
            fqn = _state_fqn(path, found[0], entry.fqns)
            if fqn is not None:
                out[found[0]] = (key, fqn)
    return out


def _copied_from(node: dict[str, Any]) -> SparseOptimizerState | None:
    """The owner of the remembered stateless dict ``node`` is a shallow copy of (the same keys, the
    very same values), made again; ``None`` when there is none or its optimizer is gone."""
    for items, make_owner in reversed(_STATELESS):
        if len(items) == len(node) and all(k in items and items[k] is v for k, v in node.items()):
            owner = make_owner()
            if owner is not None:
                return owner
    return None


def rebuild_load_target(
    state_dict: Any,
    metadata: Metadata | None,
    frame: Any = None,
    *,
    marked: bool = True,
    allow_partial_load: bool = False,
    keys: set[str] | None = None,
) -> int:
    """Rebuild what ``DefaultLoadPlanner.set_up_planner`` rebuilds in the load target ``state_dict``:
    the marked dicts (`rebuild_marked`; not with ``marked=False``: the library's planner rebuilds
    those itself), then the recognised copies (`rebuild_copies`). Returns how many were rebuilt.
    ``frame``: the caller of ``set_up_planner`` (to reach the load's storage reader for
    ``state_layout="buffers"`` checkpoints; ``None``: this function's caller). ``allow_partial_load``
    and ``keys`` are `rebuild_marked`'s and `rebuild_copies`'s."""
    if metadata is None:
        return 0
    frame = frame if frame is not None else caller_frame(1)
    done = rebuild_marked(state_dict, metadata, frame, allow_partial_load, keys) if marked else 0
    return done + rebuild_copies(state_dict, metadata, frame, allow_partial_load, keys)


def rebuild_copies(
    state_dict: Any, metadata: Metadata, frame: Any, allow_partial_load: bool, keys: set[str] | None
) -> int:
    """Rebuild, exactly like a marked dict (`rebuild_marked`, ``allow_partial_load`` included), every
    unmarked optimizer dict of the load target that asks for no state and is a shallow copy of a dict
    handed out for an optimizer still alive (`remember_stateless`; NeMo Automodel's ``OptimizerState``
    merges the dicts into a new one before ``dcp.load``): the copy gets the rebuilt items, so DCP fills
    it and ``set_optimizer_state_dict`` loads it. Any other unmarked optimizer dict that asks for no
    state while the checkpoint holds state under its path is a `sparse_ckpt.CheckpointMismatchError`
    (DCP would read the settings and leave the state unread, silently), raised before any copy is
    touched; so is one that asks for the state of some of its parameters and not of another whose state
    the checkpoint holds (its copy was made for an optimizer with partial state). Returns how many
    copies were rebuilt; ``keys`` (`SparseLoadPlanner`'s optimizer keys)
    gets the DCP keys the copies read, so that planner unpickles their bytes items with
    ``weights_only=True`` as it does its own targets'."""
    unmarked = _unmarked(state_dict)
    if not unmarked:
        return 0
    copies: dict[tuple[str | int, ...], tuple[dict[str, Any], SparseOptimizerState]] = {}
    for path in (p for p, entry in unmarked.items() if not entry.asked) if _STATELESS else ():
        node = _node(state_dict, path)
        owner = _copied_from(node) if type(node) is dict else None
        if owner is not None:
            copies[path] = node, owner
    for path, (key, fqn) in _starved({p: e for p, e in unmarked.items() if p not in copies}, metadata).items():
        where = ".".join(map(str, path))
        if fqn is None:
            raise CheckpointMismatchError(
                f"the checkpoint holds optimizer state under {where!r} (e.g. {key!r}) and the load target's optimizer "
                "dict there asks for none of it: DCP would load the param groups and silently leave the state "
                "unread. With sparse_ckpt.integrations.dsd installed, put the dict get_optimizer_state_dict "
                "returned into the load target itself (a copy of it is rebuilt from the checkpoint only while its "
                "optimizer is alive and its values are the very objects that call returned)"
            )
        raise CheckpointMismatchError(
            f"the checkpoint holds optimizer state of {fqn!r} under {where!r} ({key!r}) and the load target's "
            "optimizer dict there asks for the state of only some of its parameters, not this one: DCP would load "
            "the rest and silently leave this state unread (stock DSD refuses the load too). A copy of the dict "
            "get_optimizer_state_dict returned for an optimizer that already holds some state loses the mark that "
            "has it rebuilt from the checkpoint: put the returned dict itself into the load target, or load into a "
            "fresh optimizer"
        )
    if not copies:
        return 0
    targets = {path: DsdStateDict(node, owner) for path, (node, owner) in copies.items()}
    done = _rebuild(targets.items(), metadata, frame, allow_partial_load, keys)
    for path, (node, _owner) in copies.items():  # one left as it was (allow_partial_load) gets its own items
        node.clear()
        node.update(targets[path])
    return done


def marked_targets(node: Any) -> Iterator[tuple[tuple[str | int, ...], DsdStateDict]]:
    """Every `DsdStateDict` below ``node`` (dicts and lists), with its DCP object path
    (the library planner's walk, `sparse_ckpt._dcp.planner._find_targets`, keeping the marked dicts)."""
    return ((path, target) for path, target in _find_targets(node, ()) if isinstance(target, DsdStateDict))


def rebuild_marked(
    state_dict: Any, metadata: Metadata, frame: Any, allow_partial_load: bool, keys: set[str] | None
) -> int:
    """Rebuild every marked dict in the load target ``state_dict`` from ``metadata`` (see the
    module doc); returns how many. ``frame``: the caller of ``set_up_planner`` (to reach the
    load's storage reader for ``state_layout="buffers"`` checkpoints). With ``allow_partial_load``
    (the planner's), a marked dict the checkpoint has nothing for is left as it is, as DCP leaves
    target entries the checkpoint lacks; without it that is a `CheckpointMismatchError`. ``keys`` gets the
    DCP keys the rebuilt dicts read (their bytes items are then read weights-only)."""
    targets = list(marked_targets(state_dict))
    if not targets:
        return 0
    return _rebuild(targets, metadata, frame, allow_partial_load, keys)


def _rebuild(
    targets: Iterable[tuple[tuple[str | int, ...], DsdStateDict]],
    metadata: Metadata,
    frame: Any,
    allow_partial_load: bool,
    keys: set[str] | None = None,
) -> int:
    """Rebuild each ``(path in the load target, dict)`` of ``targets`` from the checkpoint (``frame``:
    the load's, for its storage reader); with ``allow_partial_load`` one the checkpoint has nothing
    under is left as it is, as DCP leaves what it lacks. Returns how many were rebuilt (``keys``: gets
    the DCP keys they read)."""
    paths = metadata_paths(metadata)
    reader = dcp_storage_reader(frame)
    done = 0
    for path, target in targets:
        if allow_partial_load and not any(len(p) > len(path) and p[: len(path)] == path for p in paths.values()):
            continue
        read = _TargetBuilder(target, metadata, reader).rebuild(path, paths)
        if keys is not None:
            keys.update(read)
        done += 1
    return done


def align_key_records(state_dict: Any, metadata: Metadata | None) -> None:
    """Give every dict of the load target that holds a key record entry (a copy of a dict this
    integration returned, which lost its mark; marked dicts are rebuilt from the checkpoint) the
    checkpoint's record entries under its path instead: DCP then reads those, and the load checks
    them, while a record the checkpoint lacks (a stock DSD checkpoint, or another optimizer's state
    keys: the record's key is its digest) is not asked for (DCP would fail on the missing key)."""
    if metadata is None:
        return
    paths = list(metadata_paths(metadata).values())
    saved: dict[tuple[str | int, ...], list[str]] = {}
    for path in paths:
        if isinstance(path[-1], str) and is_record_key(path[-1]):
            saved.setdefault(tuple(path[:-1]), []).append(path[-1])
    _align(state_dict, (), saved, paths)


def _align(
    node: Any, path: tuple[str | int, ...], saved: Mapping[tuple[str | int, ...], list[str]], paths: list[Any]
) -> None:
    if isinstance(node, dict):
        n = len(path)
        # a dict the checkpoint holds nothing under is left as it is (DCP's missing key, or allow_partial_load)
        if any(map(is_record_key, node)) and any(len(p) > n and tuple(p[:n]) == path for p in paths):
            wanted = saved.get(path, [])
            for key in [k for k in node if is_record_key(k) and k not in wanted]:
                del node[key]
            for key in wanted:
                node.setdefault(key, b"")
        for key, value in node.items():
            if isinstance(value, (dict, list)):
                _align(value, (*path, str(key)), saved, paths)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            if isinstance(value, (dict, list)):
                _align(value, (*path, i), saved, paths)


def _leaf_paths(node: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """The object paths of the values DCP would plan below ``node`` (an empty dict has none)."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from _leaf_paths(value, (*path, str(key)))
    elif isinstance(node, list) and node and all(isinstance(v, (Mapping, list)) for v in node):
        for i, value in enumerate(node):
            yield from _leaf_paths(value, (*path, i))
    else:
        yield path


def _section(path: tuple[str | int, ...]) -> tuple[tuple[str | int, ...], str] | None:
    """``(prefix, "state" | "param_groups")`` for a path into an optimizer dict (DSD's nested
    layout: a ``state``/``param_groups`` part; flat: a part starting with ``state.``/``param_groups.``)."""
    for i, part in enumerate(path):
        if isinstance(part, str):
            for name in NESTED_KEYS:
                if part == name or part.startswith(name + "."):
                    return path[:i], name
    return None
