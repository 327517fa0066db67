"""sparse-ckpt-run's ``sitecustomize``: starts the import hook of ``_sparse_ckpt_run`` (this folder
leads ``PYTHONPATH`` in the command's environment), then runs the ``sitecustomize`` it shadows."""

import _sparse_ckpt_run

_sparse_ckpt_run.start()
