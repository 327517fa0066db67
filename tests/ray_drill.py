"""The Ray Train drill's driver script (``python tests/ray_drill.py ROOT RUN...``; tests/integrations/test_ray.py).

Ray's FSDP2 guide, on 2 CPU workers (``ScalingConfig(num_workers=2, use_gpu=False)``, Gloo): the train
function builds the drills' MoE (:mod:`dsd_moe`: 40 parameters, 22 with gradients, ``vision`` in its
own group whose lr a scheduler moves), ``fully_shard`` over a CPU mesh, and checkpoints an ``AppState``
``Stateful`` whose ``state_dict``/``load_state_dict`` call DSD's ``get_state_dict``/``set_state_dict``
under ``dcp.save``/``dcp.load``, reporting the checkpoint with ``ray.train.report``; a resumed run
reads ``ray.train.get_checkpoint()``. This script is ``__main__``, so Ray ships the train functions to
its workers by value (cloudpickle), as it does a user's script.

Each ``RUN`` is ``KIND:PHASE``. ``KIND``: ``stock`` (the guide as it is: DSD imported at the top of
the train function), ``in_code`` (the same, then ``sparse_ckpt.integrations.dsd.install()``, where a
Ray user puts the line) or ``prefixed`` (the stock function, for a driver started as ``sparse-ckpt-run
python tests/ray_drill.py ...``: the prefix routes DSD in every worker). ``PHASE``: ``fresh`` (5 steps,
the checkpoint after step 3; its path goes to ``ROOT/checkpoint.txt``) or ``resume`` (from that
checkpoint, to step 5; Ray Train v2 has no ``resume_from_checkpoint``: the path goes in the train
loop's config). Rank 0 writes the end state (:func:`trainer_drill.outcome`) to ``ROOT/KIND-PHASE.pt``;
the driver writes ``ROOT/KIND-PHASE.json``: ``{"ok": ..., "error": ...}``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

SAVE_AT, STEPS = 3, 5


def _train(config: dict[str, Any], get_state_dict: Any, set_state_dict: Any) -> None:
    """The guide's train loop with the DSD functions the train function bound (its locals)."""
    import dsd_moe
    import ray.train
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import trainer_drill
    from torch.distributed.checkpoint.stateful import Stateful

    model = trainer_drill.sharded(0)
    optimizer = dsd_moe.optimizer(model)
    scheduler = dsd_moe.scheduler(optimizer)
    rank = dist.get_rank()

    class AppState(Stateful):
        """Ray's FSDP2 guide's ``AppState`` (plus the scheduler)."""

        def state_dict(self) -> dict[str, Any]:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            return {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict()}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            set_state_dict(model, optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])
            scheduler.load_state_dict(state_dict["scheduler"])

    start = 0
    # Ray Train v2 resumes a run from its own latest checkpoint; another run's is passed in
    checkpoint = ray.train.get_checkpoint() or (ray.train.Checkpoint(config["resume"]) if config["resume"] else None)
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            dcp.load({"app": AppState()}, checkpoint_id=directory)
        start = SAVE_AT
    for step in range(start, STEPS):
        dsd_moe.train(model, optimizer, scheduler, range(step, step + 1), rank)
        if step + 1 == SAVE_AT and checkpoint is None:
            with tempfile.TemporaryDirectory() as directory:
                dcp.save({"app": AppState()}, checkpoint_id=directory)
                ray.train.report({"step": SAVE_AT}, checkpoint=ray.train.Checkpoint.from_directory(directory))
    result = trainer_drill.outcome(model, optimizer, scheduler)
    if rank == 0:
        torch.save(result, config["out"])
    ray.train.report({"step": STEPS, "with_state": len(optimizer.state)})


def train_stock(config: dict[str, Any]) -> None:
    """The guide's train function: DSD imported at its top."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _train(config, get_state_dict, set_state_dict)


def train_in_code(config: dict[str, Any]) -> None:
    """The same with the in-code line where a Ray user puts it: after the imports at the function's top."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import sparse_ckpt.integrations.dsd as sc_dsd

    sc_dsd.install()
    _train(config, get_state_dict, set_state_dict)


TRAIN = {"stock": train_stock, "in_code": train_in_code, "prefixed": train_stock}
"""``prefixed``: the stock train function, for a driver run under ``sparse-ckpt-run`` (its own result files)."""


def _error_text(exc: BaseException) -> str:
    parts = ["".join(traceback.format_exception(exc))]
    for failure in getattr(exc, "worker_failures", {}).values():  # Ray Train v2's WorkerGroupError
        parts.append(
            "".join(traceback.format_exception(failure)) if isinstance(failure, BaseException) else str(failure)
        )
    return "\n".join(parts)


def main(root: Path, runs: list[str]) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        for run in runs:
            kind, phase = run.split(":")
            resume = (root / "checkpoint.txt").read_text() if phase == "resume" else None
            trainer = TorchTrainer(
                TRAIN[kind],
                train_loop_config={"out": str(root / f"{kind}-{phase}.pt"), "resume": resume},
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                run_config=RunConfig(storage_path=str(root / "ray_results"), name=f"{kind}-{phase}"),
            )
            record: dict[str, Any] = {"ok": False, "error": ""}
            try:
                result = trainer.fit()
                record["ok"] = True
                if phase == "fresh":
                    (root / "checkpoint.txt").write_text(result.checkpoint.path)
            except Exception as exc:  # noqa: BLE001 - the stock resume fails: recorded for the test
                record["error"] = _error_text(exc)
            (root / f"{kind}-{phase}.json").write_text(json.dumps(record))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
