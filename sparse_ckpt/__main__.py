"""``python -m sparse_ckpt``: see :mod:`sparse_ckpt.tools._cli`."""

from __future__ import annotations

import sys

from .tools._cli import main

if __name__ == "__main__":
    sys.exit(main())
