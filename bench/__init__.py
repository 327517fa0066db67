"""sparse_ckpt's benchmark suite: ``python -m bench --help`` in a checkout; installed from the wheel as
``sparse_ckpt.bench`` (``python -m sparse_ckpt.bench``, ``sparse-ckpt-bench``). Modules import each
other relatively, so both package names work."""
