"""``python -m bench`` (checkout) / ``python -m sparse_ckpt.bench`` (wheel): run the benchmark (see README.md)."""

from .run import main

if __name__ == "__main__":
    raise SystemExit(main())
