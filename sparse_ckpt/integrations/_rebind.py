"""The one rebinding mechanism of the integrations: reaching the callers of a function that an
integration replaces, however they bound it.

Two ways, for two kinds of function:

- `bindings` finds the names other modules bound to a function before an integration replaced it. A
  trainer that did ``from accelerate.utils import save_fsdp_optimizer`` (``transformers.trainer``
  does, when it is imported) holds the function object in its own globals; replacing the attribute
  of the defining module does not reach it. `bindings` finds every such name in the loaded modules by
  identity (modules imported later bind the replacement themselves). Accelerate's and torchtune's
  integrations use it.
- *Routing* reaches every binding at once, also those `bindings` cannot see (function locals,
  closures, ``functools.partial``, default arguments, code that cloudpickle, pickle or
  multiprocessing unpickled: they all hold the function object itself, or look it up by module and
  name): the function object stays, its ``__code__`` is swapped for a trampoline of the same
  parameters that calls the replacement (`route_code`). A plain function without a closure allows
  that (`unroutable` says why another does not); the trampoline keeps the original code as its last
  constant, so `original_code` and `pristine` (a clone that runs the original) are derived from the
  function itself, never from a record that an interrupt could leave stale. torch DSD's integration
  uses it.

`all_or_nothing` applies a list of such changes so that an interrupt at any point leaves all of them
or none. No trainer package is imported here.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["all_or_nothing", "bindings", "original_code", "pristine", "route_code", "routed", "unroutable"]

ROUTE_FILE = "<sparse_ckpt route to {target}>"
"""The ``co_filename`` of a trampoline (what a traceback shows for its frame)."""
_ROUTE_PREFIX = ROUTE_FILE.split("{", 1)[0]
_NOT_PLAIN = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


def bindings(replacements: Mapping[int, tuple[Any, Any]], skip: Iterable[Any] = ()) -> list[tuple[Any, str, Any, Any]]:
    """``(module, name, original, replacement)`` for every global of a loaded module (other than
    those in ``skip``) bound to one of the originals; ``replacements`` maps ``id(original)`` to
    ``(original, replacement)``. Nothing is changed here."""
    skipped = {id(m) for m in skip}
    out = []
    for module in list(sys.modules.values()):
        if module is None or id(module) in skipped:
            continue
        try:
            namespace = vars(module)
        except TypeError:  # pragma: no cover - an odd sys.modules entry
            continue
        for name, value in list(namespace.items()):
            pair = replacements.get(id(value))
            if pair is not None and value is pair[0]:
                out.append((module, name, value, pair[1]))
    return out


def unroutable(fn: Any) -> str | None:
    """Why ``fn``'s code cannot be swapped for a trampoline (``None``: it can): it must be a plain
    Python function (not a builtin, a method, a ``functools`` wrapper or a generator) without a
    closure, taking no ``*args``/``**kwargs``."""
    if type(fn) is not types.FunctionType:
        return f"is a {type(fn).__module__}.{type(fn).__qualname__}, not a plain Python function"
    if fn.__closure__:
        return "has a closure"
    code = original_code(fn)
    if code.co_flags & _NOT_PLAIN:
        return "is a generator or a coroutine"
    if code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS):
        return "takes *args or **kwargs"
    return None


def routed(fn: Any) -> bool:
    """Whether ``fn``'s code is a trampoline (`route_code`)."""
    code = getattr(fn, "__code__", None)
    return isinstance(code, types.CodeType) and code.co_filename.startswith(_ROUTE_PREFIX)


def original_code(fn: Any) -> types.CodeType:
    """``fn``'s own code: the code it had before it was routed (kept in the trampoline)."""
    code: types.CodeType = fn.__code__
    return code.co_consts[-1] if routed(fn) else code


def pristine(fn: Any) -> Any:
    """A clone of plain function ``fn`` that runs its original code (`original_code`) in its
    globals, with its defaults, keyword defaults, names, doc and annotations: what calls the function
    as it was while ``fn`` itself is routed. Anything `unroutable` is returned as it is."""
    if unroutable(fn) is not None:
        return fn
    clone = types.FunctionType(original_code(fn), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ is not None else None
    clone.__qualname__, clone.__module__, clone.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    clone.__annotations__ = dict(fn.__annotations__)
    clone.__dict__.update(fn.__dict__)
    return clone


def route_code(fn: Any, module: str, attr: str) -> types.CodeType:
    """A trampoline for plain function ``fn`` (see `unroutable`): a code object with ``fn``'s
    parameters (names, kinds, order; the defaults stay on the function object, so its signature is
    unchanged) whose body calls ``module.attr`` (imported if needed) with every argument (positional-only
    ones by position, the others by name) and returns its result. ``fn``'s original code is its last
    constant. Nothing is changed here: ``fn.__code__ = route_code(...)`` routes ``fn``."""
    why = unroutable(fn)
    if why is not None:
        raise TypeError(f"{fn!r} {why}: its code cannot be routed")
    code = original_code(fn)
    names = code.co_varnames
    n_pos, n_posonly, n_kw = code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount
    params = list(names[:n_pos])
    if n_posonly:
        params.insert(n_posonly, "/")
    if n_kw:
        params += ["*", *names[n_pos : n_pos + n_kw]]
    args = [*names[:n_posonly], *(f"{n}={n}" for n in names[n_posonly : n_pos + n_kw])]
    target = f"{module}.{attr}"
    if not all(part.isidentifier() for part in (*names[: n_pos + n_kw], *target.split("."), code.co_name)):
        raise ValueError(f"not identifiers: {code.co_name}{tuple(params)} -> {target}")  # pragma: no cover
    source = (
        f"def {code.co_name}({', '.join(params)}):\n"
        f"    return __import__({module!r}, None, None, ({attr!r},)).{attr}({', '.join(args)})\n"
    )
    compiled = compile(source, ROUTE_FILE.format(target=target), "exec", dont_inherit=True)
    (body,) = (c for c in compiled.co_consts if isinstance(c, types.CodeType))
    named = {"co_qualname": code.co_qualname} if hasattr(code, "co_qualname") else {}  # Python >= 3.11
    return body.replace(co_consts=(*body.co_consts, code), **named)


def all_or_nothing(changes: Sequence[tuple[Callable[[], None], Callable[[], None]]]) -> None:
    """Apply ``changes`` (``(do, undo)`` pairs, each an idempotent assignment) in order; if anything
    raises (a ``KeyboardInterrupt`` included) the ones begun are undone, in reverse, and the exception
    propagates. An undo is recorded before its change runs, so an interrupt between the two undoes a
    change that did not happen, which an idempotent undo makes harmless."""
    begun: list[Callable[[], None]] = []
    try:
        for do, undo in changes:
            begun.append(undo)
            do()
    except BaseException:
        for undo in reversed(begun):
            undo()
        raise
