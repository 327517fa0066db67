"""The launcher tests check process start-up and the integrations' activation, not the core: each
runs once, on the backend ``import sparse_ckpt`` chose (see tests/_backends.py)."""

import _backends

core_backend = _backends.run_once
