"""Hugging Face ``Trainer`` (transformers + accelerate, FSDP2) resumed exactly by ``integrations.dsd``.

The trainer drill (:mod:`trainer_drill`'s MoE and checks) with the real packages: 2 Gloo ranks, FSDP2
over a CPU mesh, the MoE of
:mod:`dsd_moe` (40 parameters, 22 with gradients, ``vision`` in its own AdamW group whose lr a
LambdaLR moves), trained for 5 steps with a checkpoint after step 3 through ``Trainer``'s own
checkpointing (``save_steps=3``: ``_save_checkpoint`` -> accelerate's ``save_fsdp_optimizer`` ->
DSD's ``get_optimizer_state_dict`` + ``dcp.save``), and resumed in fresh processes with
``trainer.train(resume_from_checkpoint=...)``:

- stock (pinned): the resume fails with ``Missing key in checkpoint state_dict:
  optimizer.state.layers.0.experts.4.weight.step`` after DSD's synthetic step put state on all
  40 parameters of the fresh optimizer;
- with ``sparse_ckpt.integrations.dsd.install()`` called *after* ``from transformers import
  Trainer`` (which binds accelerate's ``save_fsdp_optimizer``/``load_fsdp_optimizer``): the stock
  checkpoint and the installed run's own checkpoint both resume, the next two steps equal the
  uninterrupted run bit for bit, the optimizer holds state for the 22 parameters that stepped, and
  ``vision``'s lr is the scheduler's.

Trainer runs FSDP only on accelerator devices (accelerate picks ``MULTI_CPU``, i.e. DDP, on CPU);
:func:`hf_cpu_fsdp2.cpu_fsdp2` applies the CPU recipe of docs/integrations/hugging-face.md ("Accelerate")
to the accelerator the Trainer creates, and builds the optimizer and scheduler the drill needs with
``create_optimizer``/``create_scheduler`` (Trainer's documented hooks); the runs are :mod:`hf_drill`'s.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "accelerate", reason="accelerate is not installed (pip install --no-deps -r .ci/requirements-accelerate.txt)"
)
pytest.importorskip(
    "transformers",
    reason=(
        "transformers is not installed (pip install --no-deps -r .ci/requirements-veomni.txt: "
        "transformers 5.9.0 and its imports)"
    ),
)

import _backends
import hf_drill
from _dist import run_ranks
from hf_cpu_fsdp2 import moe_trainer
from hf_drill import SAVE_AT
from trainer_drill import MARKS

pytestmark = MARKS

STOCK_ERROR = r"Missing key in checkpoint state_dict: optimizer\.state\.layers\.0\.experts\.4\.weight\.step"


def trainer(output_dir: str) -> Any:
    """A fresh Trainer on a fresh MoE (seed 0), FSDP2 on CPU, AdamW (two groups) and LambdaLR."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=output_dir, remove_unused_columns=False, **hf_drill.TRAINING_ARGS)
    return moe_trainer(Trainer, args)


def checkpoint_size(path: Path) -> dict[str, int]:
    """Items under ``optimizer`` and bytes of an ``optimizer_0`` DCP directory."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    items = sum(1 for k in metadata.state_dict_metadata if k.startswith("optimizer."))
    return {"items": items, "bytes": sum(f.stat().st_size for f in path.iterdir())}


@_backends.only(_backends.DEFAULT)
def test_hf_trainer_resumes_exactly_with_dsd_install(tmp_path: Path) -> None:
    run_ranks(functools.partial(hf_drill.uninterrupted, trainer), 2, str(tmp_path), timeout=300)
    sizes = {s: checkpoint_size(tmp_path / s / f"checkpoint-{SAVE_AT}" / "optimizer_0") for s in ("stock", "sparse")}
    # a stepped optimizer: the same entries, and the key record (docs/formats.md, *Key record*)
    assert sizes["stock"]["items"] + 1 == sizes["sparse"]["items"], sizes
    run_ranks(functools.partial(hf_drill.resumed, trainer, STOCK_ERROR), 2, str(tmp_path), timeout=300)
    print(json.dumps(sizes))


def test_accelerate_install_reaches_transformers_trainer_imported_before() -> None:
    """``transformers.trainer`` binds accelerate's ``save_fsdp_optimizer``/``load_fsdp_optimizer`` when it
    is imported; ``integrations.accelerate.install()`` afterwards replaces those names too, and
    ``uninstall()`` puts accelerate's own back."""
    import transformers.trainer as hf_trainer
    from accelerate.utils import fsdp_utils

    from sparse_ckpt.integrations import accelerate as integration

    assert hf_trainer.save_fsdp_optimizer is fsdp_utils.save_fsdp_optimizer  # bound at import
    integration.install()
    try:
        assert hf_trainer.save_fsdp_optimizer is integration.save_fsdp_optimizer
        assert hf_trainer.load_fsdp_optimizer is integration.load_fsdp_optimizer
    finally:
        integration.uninstall()
    assert hf_trainer.save_fsdp_optimizer is fsdp_utils.save_fsdp_optimizer
    assert hf_trainer.load_fsdp_optimizer is fsdp_utils.load_fsdp_optimizer
