"""Twins of csrc/module_walk.cpp: ``map_parameters`` / ``fqn_tables``, a model's parameter names
(the FQN map) in one iterative walk, and the replay that tells in one identity-comparing pass
whether a map made earlier still holds."""

from __future__ import annotations

import array
import collections
from typing import Any

from .._format.keys import WRAPPER_CHILD
from .errors import CheckpointMismatchError

_MEMO_SIZE = 7
"""``map_parameters``'s memo: ``(stripped, module_wrapper, words, keys, slots, fqn_of, canonical)``."""


def map_parameters(
    model: Any,
    stripped: Any,
    module_wrapper: type | None,
    base_named_modules: Any,
    base_named_parameters: Any,
    cached: tuple | None,
) -> tuple[tuple | None, dict[int, str], dict[str, str], dict[str, Any]] | None:
    """The FQN map of ``model``: ``(memo, fqn_of, canonical, param_of)`` (see :func:`fqn_tables`),
    or ``None`` when ``type(model).named_parameters`` is not ``base_named_parameters`` or some
    module's ``type(m).named_modules`` is not ``base_named_modules`` (the caller then uses the
    public API).

    Names come from one iterative walk over each module's ``_parameters`` and ``_modules`` (what
    torch's recursive ``named_modules`` reads), in ``named_parameters(remove_duplicate=False)``
    order. A name component in ``stripped``, or ``module`` directly under a ``module_wrapper``
    instance (DDP), is left out of the canonical name.

    ``memo`` lets a later call skip building the map: ``(stripped, module_wrapper, words, keys,
    slots, fqn_of, canonical)``, where ``words`` (native ``uint64``) and ``keys`` are what the walk
    saw -- per module its ``id``, the number of ``_parameters`` entries and each value's ``id`` (0
    for ``None``), the number of ``_modules`` entries and each child's ``id``, and a wrapper word
    (0 when no key of the module is ``WRAPPER_CHILD`` or there is no wrapper, else 1 + ``isinstance``);
    ``keys`` every key in that order -- and ``slots[i]`` the name ``param_of`` holds the i-th
    parameter found under (``None`` for a repeat). ``memo`` is ``None`` when some mapping is not an
    exact ``dict`` or ``OrderedDict`` or some key not an exact ``str``. Given a memo as ``cached`` (same ``stripped``
    and ``module_wrapper`` objects), the model is walked once comparing every module, key and
    value with it; when all are the same objects in the same places (so a fresh walk would give
    the same names), the result is ``(cached, cached fqn_of, cached canonical, param_of)`` with
    ``param_of`` holding the live parameters; otherwise the map is built anew. The memo holds no
    module or parameter, only their ids (a replaced object fails the comparison or, when a new
    object took a freed one's id and place, gets that place's name, as a fresh walk would give).
    """
    if cached is not None:
        if type(cached) is not tuple or len(cached) != _MEMO_SIZE:
            raise TypeError("map_parameters: cached is not a memo of map_parameters")
        if cached[0] is stripped and cached[1] is module_wrapper:
            param_of = _replay(model, module_wrapper, base_named_modules, base_named_parameters, cached)
            if param_of is not None:
                return cached, cached[5], cached[6], param_of
    trace = _Trace()
    named = _walk(model, stripped, module_wrapper, base_named_modules, base_named_parameters, trace)
    if named is None:
        return None
    fqn_of, canonical, param_of, slots = _tables(named)
    memo = None
    if trace.replayable:
        memo = (stripped, module_wrapper, trace.words.tobytes(), tuple(trace.keys), tuple(slots), fqn_of, canonical)
    return memo, fqn_of, canonical, param_of


_REPLAYABLE = (dict, collections.OrderedDict)
"""Module containers a trace records and a replay reads again exactly (``ModuleList.__delitem__``
leaves an ``OrderedDict``); any other mapping is walked through its ``items()`` but not replayed."""


class _Trace:
    """What :func:`_walk` saw (see :func:`map_parameters`)."""

    def __init__(self) -> None:
        self.words = array.array("Q")
        self.keys: list[Any] = []
        self.replayable = True

    def key(self, k: Any) -> None:
        if type(k) is not str:
            self.replayable = False
        self.keys.append(k)


def _id_word(obj: Any) -> int:
    return 0 if obj is None else id(obj)


def _is_module_key(k: Any) -> bool:
    return type(k) is str and k == WRAPPER_CHILD


def _wrapper_word(mod: Any, module_wrapper: type | None, has_module_key: bool) -> int:
    if not has_module_key or module_wrapper is None:
        return 0
    return 1 + bool(isinstance(mod, module_wrapper))


def _child_names(mod: Any, raw: str, canon: str, k: str, stripped: Any, module_wrapper: type | None) -> tuple[str, str]:
    """``(raw name, canonical name)`` of the entry ``k`` (a parameter or a child module) of ``mod``
    named ``raw``/``canon``: ``k`` is left out of the canonical name when it is in ``stripped``
    or is ``WRAPPER_CHILD`` of a ``module_wrapper``; while nothing was left out the canonical name
    is the raw ``str`` object itself."""
    raw_k = f"{raw}.{k}" if raw else k
    if k in stripped or (module_wrapper is not None and k == WRAPPER_CHILD and isinstance(mod, module_wrapper)):
        return raw_k, canon
    if canon is raw:
        return raw_k, raw_k
    return raw_k, f"{canon}.{k}" if canon else k


def _walk(
    model: Any,
    stripped: Any,
    module_wrapper: type | None,
    base_named_modules: Any,
    base_named_parameters: Any,
    trace: _Trace,
) -> list[tuple[str, str, Any]] | None:
    """``(raw name, canonical name, param)`` for every parameter, recording ``trace``; ``None``
    for an override (see :func:`map_parameters`). While nothing was left out the canonical name
    is the raw ``str`` object itself."""
    if type(model).named_parameters is not base_named_parameters:
        return None
    out: list[tuple[str, str, Any]] = []
    stack: list[tuple[Any, str, str]] = [(model, "", "")]
    words = trace.words
    while stack:
        mod, raw, canon = stack.pop()
        if type(mod).named_modules is not base_named_modules:
            return None
        words.append(id(mod))
        has_module_key = False
        params = mod._parameters
        if type(params) not in _REPLAYABLE:
            trace.replayable = False
        count_at = len(words)
        words.append(0)
        if params:
            for k, v in params.items():
                trace.key(k)
                words.append(_id_word(v))
                has_module_key = has_module_key or _is_module_key(k)
                if v is None:
                    continue
                out.append((*_child_names(mod, raw, canon, k, stripped, module_wrapper), v))
        words[count_at] = len(words) - count_at - 1
        children = mod._modules
        items = list(children.items()) if children else []
        if type(children) not in _REPLAYABLE:
            trace.replayable = False
        words.append(len(items))
        for name, child in items:
            trace.key(name)
            words.append(_id_word(child))
            has_module_key = has_module_key or _is_module_key(name)
        for name, child in reversed(items):
            if child is None:
                continue
            stack.append((child, *_child_names(mod, raw, canon, name, stripped, module_wrapper)))
        words.append(_wrapper_word(mod, module_wrapper, has_module_key))
    return out


def _replay(
    model: Any, module_wrapper: type | None, base_named_modules: Any, base_named_parameters: Any, memo: tuple
) -> dict[str, Any] | None:
    """Walk ``model`` comparing every module, key and value with ``memo``'s trace: the new
    ``param_of`` when all are the same, else ``None`` (see :func:`map_parameters`)."""
    if type(model).named_parameters is not base_named_parameters:
        return None
    raw_words, keys, slots = memo[2], memo[3], memo[4]
    if type(raw_words) is not bytes or type(keys) is not tuple or type(slots) is not tuple:
        raise TypeError("map_parameters: cached is not a memo of map_parameters")
    words = array.array("Q")
    words.frombytes(raw_words[: len(raw_words) - len(raw_words) % words.itemsize])
    wi = ki = si = 0
    param_of: dict[str, Any] = {}
    stack = [model]
    try:
        while stack:
            mod = stack.pop()
            if words[wi] != id(mod) or type(mod).named_modules is not base_named_modules:
                return None
            wi += 1
            has_module_key = False
            replayed = []
            for entries in (mod._parameters, mod._modules):  # each checked against the trace, in order
                if type(entries) not in _REPLAYABLE or words[wi] != len(entries):
                    return None
                wi += 1
                values = []
                for k, v in entries.items():
                    if words[wi] != _id_word(v) or not _same_key(keys[ki], k):
                        return None
                    wi += 1
                    ki += 1
                    has_module_key = has_module_key or _is_module_key(k)
                    values.append(v)
                replayed.append(values)
            params, children = replayed
            for v in params:
                if v is None:
                    continue
                slot = slots[si]
                si += 1
                if slot is not None:
                    param_of[slot] = v
            stack.extend(reversed([v for v in children if v is not None]))
            if words[wi] != _wrapper_word(mod, module_wrapper, has_module_key):
                return None
            wi += 1
    except IndexError:  # the model has more than the trace
        return None
    if wi != len(words) or ki != len(keys) or si != len(slots):
        return None
    return param_of


def _same_key(saved: str, k: Any) -> bool:
    return saved is k or (type(k) is str and saved == k)


def _tables(named: Any) -> tuple[dict[int, str], dict[str, str], dict[str, Any], list[str | None]]:
    """:func:`fqn_tables` and ``slots`` (see :func:`map_parameters`)."""
    fqn_of: dict[int, str] = {}
    canonical: dict[str, str] = {}
    param_of: dict[str, Any] = {}
    slots: list[str | None] = []
    for raw, fqn, param in named:
        primary = fqn_of.get(id(param))
        if primary is None:
            if fqn in param_of:  # another parameter has this canonical name: keep the raw one
                if raw in param_of:
                    raise CheckpointMismatchError(
                        f"parameter {raw!r} and another parameter both have the FQN {fqn!r} "
                        f"and {raw!r} is taken too; rename one of them"
                    )
                fqn = raw
            fqn_of[id(param)] = fqn
            param_of[fqn] = param
            slots.append(fqn)
            primary = fqn
        else:
            slots.append(None)
        canonical.setdefault(fqn, primary)
        canonical.setdefault(raw, primary)
    return fqn_of, canonical, param_of, slots


def fqn_tables(named: Any) -> tuple[dict[int, str], dict[str, str], dict[str, Any]]:
    """``(fqn_of, canonical, param_of)`` from ``(raw, canonical name, param)`` triples.

    ``fqn_of``: ``id(param)`` -> its first canonical name; ``canonical``: every canonical and raw
    name -> the first canonical name of its parameter (first wins); ``param_of``: first canonical
    name -> param. A parameter whose canonical name already names another parameter (a root
    ``w`` and a compiled ``_orig_mod.w``) keeps its raw name as FQN, so no two parameters share one.
    """
    fqn_of, canonical, param_of, _slots = _tables(named)
    return fqn_of, canonical, param_of
