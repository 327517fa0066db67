"""The docs tests check the Markdown (its python blocks run as written, its links resolve), not the
core: each runs once, on the backend ``import sparse_ckpt`` chose (see tests/_backends.py)."""

import _backends

core_backend = _backends.run_once
