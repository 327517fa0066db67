"""The packaging tests check what is built and shipped (metadata, the public API, the wheel), not
the core: each runs once, on the backend ``import sparse_ckpt`` chose (see tests/_backends.py)."""

import _backends

core_backend = _backends.run_once
