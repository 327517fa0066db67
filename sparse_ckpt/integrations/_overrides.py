"""Overriding a trainer's method without restating its parameter list.

An integration that wraps a trainer's method (VeOmni's ``DistributedCheckpointer.save`` and
``load``, torchtitan's ``CheckpointManager.__init__``) takes ``*args, **kwargs``, reads the
arguments it needs by name with `arguments_of` and passes the call on unchanged. A call the
trainer's signature refuses fails with the same ``TypeError`` as the trainer's method, and a
parameter a later trainer version adds reaches the trainer instead of being refused here.
`with_signature_of` gives the override the trainer's signature for ``inspect.signature`` and
``help``.

No trainer package is imported here.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, TypeVar

__all__ = ["arguments_of", "replace_argument", "with_signature_of"]

F = TypeVar("F", bound=Callable[..., Any])


def arguments_of(method: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The arguments of the call ``method(*args, **kwargs)`` by parameter name, defaults filled in.

    ``method`` as the caller sees it: a bound method (``super().__init__``) or a classmethod read
    from its class (``Base.save``) takes no ``self``/``cls``. Raises the ``TypeError`` that the call
    itself would raise when the arguments do not fit ``method``'s signature.
    """
    bound = inspect.signature(method).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def replace_argument(
    method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], name: str, value: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of the call ``method(*args, **kwargs)`` with the argument ``name`` set to
    ``value``, passed the way the call passed its arguments (positionally or by keyword)."""
    bound = inspect.signature(method).bind(*args, **kwargs)
    bound.arguments[name] = value
    return bound.args, bound.kwargs


def with_signature_of(method: Callable[..., Any]) -> Callable[[F], F]:
    """Decorator: the decorated ``(self_or_cls, *args, **kwargs)`` function shows ``method``'s signature.

    ``method`` is the trainer's function as defined (``Base.__init__``, or ``Base.save`` of a
    classmethod: its ``__func__`` is used, so the signature keeps its ``cls``).
    """
    signature = inspect.signature(getattr(method, "__func__", method))

    def decorate(override: F) -> F:
        override.__signature__ = signature  # type: ignore[attr-defined]
        return override

    return decorate
