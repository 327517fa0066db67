"""``sparse_ckpt.integrations.torchtune.install`` / ``uninstall`` / ``installed`` (torchtune 0.6.1).

In a fresh interpreter (so that torchtune is not imported yet): importing the integration does not
import torchtune; ``install()`` before torchtune's imports reaches the names a later ``from
torchtune.training import ...`` binds and ``CheckpointClient``; a module that bound torchtune's
functions before ``install()`` is rebound; a second ``install()`` changes nothing; ``uninstall()``
puts torchtune's exact objects back everywhere. The sync marker round-trips and a newer one is refused.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip(
    "torchtune", reason="torchtune is not installed (pip install --no-deps -r .ci/requirements-torchtune.txt)"
)

import _backends

from sparse_ckpt.errors import CheckpointFormatError
from sparse_ckpt.integrations._torchtune_stock import MARKER, split_marker, sync_marker

SCRIPT = textwrap.dedent(
    """
    import sys, types
    import sparse_ckpt.integrations.torchtune as sc_tune
    assert "torchtune" not in sys.modules, "importing the integration imported torchtune"
    assert not sc_tune.installed()

    NAMES = ("get_full_optimizer_state_dict", "load_from_full_optimizer_state_dict")
    import importlib
    distributed = importlib.import_module("torchtune.training._distributed")
    theirs = {n: getattr(distributed, n) for n in NAMES}
    client = importlib.import_module("torchtune.training.checkpointing._checkpoint_client").CheckpointClient
    methods = {n: vars(client)[n] for n in ("_save_checkpoint_async", "load_distributed_checkpoint")}
    early = types.ModuleType("early_user")  # a module that bound torchtune's functions before install()
    early.load = theirs["load_from_full_optimizer_state_dict"]
    sys.modules["early_user"] = early

    sc_tune.install()
    sc_tune.install()  # idempotent
    assert sc_tune.installed()
    from torchtune import training
    from torchtune.training import load_from_full_optimizer_state_dict as late
    for n in NAMES:
        assert getattr(training, n) is getattr(sc_tune, n) is getattr(distributed, n), n
    assert late is sc_tune.load_from_full_optimizer_state_dict
    assert early.load is sc_tune.load_from_full_optimizer_state_dict
    for n, original in methods.items():
        assert vars(client)[n] is not original and vars(client)[n].__wrapped__ is original, n

    sc_tune.uninstall()
    assert not sc_tune.installed()
    for n in NAMES:
        assert getattr(training, n) is theirs[n] is getattr(distributed, n), n
    assert early.load is theirs["load_from_full_optimizer_state_dict"]
    for n, original in methods.items():
        assert vars(client)[n] is original, n
    sc_tune.uninstall()  # no-op
    print("ok")
    """
)


@_backends.only(_backends.DEFAULT)
def test_install_before_imports_rebinds_and_uninstall_restores() -> None:
    """Install before torchtune's imports, twice; rebinding of early names; exact restore."""
    done = subprocess.run([sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@_backends.only(_backends.DEFAULT)
def test_sync_marker_round_trips_and_a_newer_one_is_refused() -> None:
    """The marker says the integration wrote a dict; a dict without it is stock; a newer version is refused."""
    osd = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["w"]}]}
    assert split_marker({**osd, **sync_marker()}) == (osd, True)
    assert split_marker(osd) == (osd, False)
    with pytest.raises(CheckpointFormatError, match="newer sparse_ckpt"):
        split_marker({**osd, MARKER: {"layout": "dsd-nested", "version": 99}})
