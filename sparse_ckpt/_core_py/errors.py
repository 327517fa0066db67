"""Twin of csrc/errors.cpp: the exception classes the core raises. Both cores raise the classes of
:mod:`sparse_ckpt.errors` (the C++ core looks them up there at raise time), plus the builtin
``TypeError``/``ValueError`` for input outside the contract (see :mod:`.common`)."""

from ..errors import CheckpointFormatError, CheckpointMismatchError, UnsupportedStateDictError

__all__ = ["CheckpointFormatError", "CheckpointMismatchError", "UnsupportedStateDictError"]
