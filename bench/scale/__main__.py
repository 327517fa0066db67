"""``python -m bench.scale`` (checkout) / ``python -m sparse_ckpt.bench.scale`` (wheel): see scale.py."""

import sys

from .scale import main

if __name__ == "__main__":
    sys.exit(main())
