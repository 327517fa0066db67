"""``sparse-ckpt-run CMD ...``: run a command with sparse_ckpt active in every Python process it starts.

`main` (the console script ``sparse-ckpt-run``, also ``python -m sparse_ckpt run``) puts the folder
``_sitecustomize/`` at the front of ``PYTHONPATH`` and replaces itself with the command
(``os.execvpe``: same pid, signals and exit status). Every Python interpreter the command starts
then runs that folder's ``sitecustomize``, whose import hook activates the selected integrations
(`activate`) once the modules they patch are imported. docs/launcher.md is the user's guide.

- `cli`: options, environment, ``--check``;
- `activate`: what a process does when a trigger module was imported (install, log, warn or fail);
- ``_sitecustomize/``: the hook, standard library only (nothing heavy at interpreter start).
"""

from __future__ import annotations

from .cli import environment, main

__all__ = ["environment", "main"]
