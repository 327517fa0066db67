"""The folder ``sparse-ckpt-run`` puts at the front of ``PYTHONPATH``: ``sitecustomize.py`` and the
import hook it starts (``_sparse_ckpt_run.py``, standard library only). Not imported as a package
except to read `_sparse_ckpt_run`'s table (``sparse_ckpt.launcher``)."""
