"""sparse_ckpt's benchmark suite (DESIGN §8): ``python -m bench --help``."""
