"""sparse_ckpt for every trainer built on torch DSD (``torch.distributed.checkpoint.state_dict``).

Hugging Face ``Trainer``/Accelerate, Lightning, OLMo-core, NeMo Automodel and others save and load
optimizers with DSD's ``get_optimizer_state_dict``/``set_optimizer_state_dict`` (or
``get_state_dict``/``set_state_dict``) and ``dcp.save``/``dcp.load``. DSD runs a *synthetic step*
on an optimizer without state (inventing ``step`` and zero moments for every parameter, also in the
live optimizer), and a checkpoint of an optimizer where some parameters never stepped cannot be
resumed (``Missing key ... .step``). This package provides the same four functions, with DSD's
signatures, ``StateDictOptions`` and layouts, exact and sparse (:mod:`.functions`), a load target
a trainer's own ``dcp.load`` fills from the checkpoint (:mod:`.target`), and :func:`install`, the
one line that routes a trainer's existing calls through them (:mod:`.patching`)::

    import sparse_ckpt.integrations.dsd as sc_dsd
    sc_dsd.install()   # after the trainer's imports is fine

No trainer package is imported here.
"""

from __future__ import annotations

from .functions import get_optimizer_state_dict, get_state_dict, set_optimizer_state_dict, set_state_dict
from .patching import install, installed, uninstall
from .target import DsdStateDict

__all__ = [
    "DsdStateDict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "install",
    "installed",
    "set_optimizer_state_dict",
    "set_state_dict",
    "uninstall",
]
