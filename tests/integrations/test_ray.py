"""Ray Train (ray 2.60.0) with torch DSD: Ray's FSDP2 guide resumed exactly by ``integrations.dsd``.

The drill (``tests/ray_drill.py``, a driver script started as a user starts one) runs Ray's FSDP2 guide
on a local cluster (``ray.init(num_cpus=2, include_dashboard=False)``) with 2 CPU workers: the MoE of
:mod:`dsd_moe` (40 parameters, 22 with gradients, ``vision`` in its own group whose lr a scheduler
moves), ``fully_shard``, an ``AppState`` calling DSD's ``get_state_dict``/``set_state_dict`` under
``dcp.save``/``dcp.load``, ``ray.train.report`` with the checkpoint after step 3. The train function
is ``__main__`` code that Ray ships to its workers by value; it imports DSD at its top (function
locals), where a module-global rebinding never reached.

- ``in_code`` (``sparse_ckpt.integrations.dsd.install()`` after the imports at the top of the train
  function): a fresh run of 5 steps (the uninterrupted reference) that checkpoints after step 3;
- ``stock`` (the guide as it is) resuming from that checkpoint: fails, ``Missing key in checkpoint
  state_dict: app.optim.state.layers.0.experts.4.weight.step`` (the fresh optimizer's synthetic step
  asks for state the never-routed experts do not have);
- ``in_code`` resuming, and the stock train function under the ``sparse-ckpt-run`` prefix resuming
  (one routing line per worker): the 2 remaining steps end bit for bit where the uninterrupted run
  ended, 22 parameters with state, every group's lr the scheduler's.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _backends
import dsd_moe
import pytest
import torch
import trainer_drill
from _sampling import EXHAUSTIVE
from launcher.launcher_env import child_env, prefix, run  # tests/launcher: how the drills start a prefixed command

pytest.importorskip(
    "ray.train.torch",
    reason="Ray Train is not installed: pip install --no-deps -r .ci/requirements-ray.txt",
    exc_type=ImportError,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
core_backend = _backends.run_once
"""Four Ray Train runs in subprocesses: once, on the default backend."""

DRIVER = Path(__file__).resolve().parents[1] / "ray_drill.py"
PAGE = trainer_drill.PAGES / "ray.md"  # docs/integrations/ray.md
UNROUTED = "layers.0.experts.4.weight"


def record(root: Path, run_name: str) -> dict[str, Any]:
    return json.loads((root / f"{run_name}.json").read_text())


def outcome(root: Path, run_name: str) -> dict[str, Any]:
    return torch.load(root / f"{run_name}.pt", weights_only=False)


@pytest.fixture(scope="module")
def drill() -> Iterator[tuple[Path, str]]:
    """Both drivers' results (``ROOT``) and the prefixed driver's output."""
    root = Path(tempfile.mkdtemp(prefix="sc_ray_"))  # short: Ray's socket paths live under its session dir
    env = child_env({"RAY_DEDUP_LOGS": "0"})  # one routing line per worker, not "[repeated 2x]"
    try:
        first = run(
            [sys.executable, str(DRIVER), str(root), "in_code:fresh", "stock:resume", "in_code:resume"],
            env=env,
            timeout=1500,
        )
        assert first.returncode == 0, first.stdout[-6000:]
        second = run([*prefix(), sys.executable, str(DRIVER), str(root), "prefixed:resume"], env=env, timeout=900)
        assert second.returncode == 0, second.stdout[-6000:]
        yield root, second.stdout
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(
    not EXHAUSTIVE,
    reason="starts a Ray cluster (~95 s): CI runs it (SPARSE_CKPT_EXHAUSTIVE_SWEEPS=1, tests/_sampling.py)",
)
def test_ray_train_resumes_exactly_in_code_and_with_the_prefix_and_stock_fails(
    drill: tuple[Path, str], core_backend: str
) -> None:
    root, prefixed_output = drill
    fresh = record(root, "in_code-fresh")
    assert fresh["ok"], fresh["error"][-4000:]
    reference = outcome(root, "in_code-fresh")
    assert reference["with_state"] == dsd_moe.STEPPED and len(reference["params"]) == dsd_moe.PARAMS

    stock = record(root, "stock-resume")
    assert not stock["ok"], "the stock resume succeeded: the drill no longer shows the failure"
    assert "Missing key in checkpoint state_dict" in stock["error"] and UNROUTED in stock["error"], stock["error"][
        -4000:
    ]

    for name in ("in_code-resume", "prefixed-resume"):
        got = record(root, name)
        assert got["ok"], f"{name}: {got['error'][-4000:]}"
        trainer_drill.assert_resumed(outcome(root, name), reference, name)
    routed = [line for line in prefixed_output.splitlines() if "routed torch DSD" in line and "RayTrainWorker" in line]
    assert len(routed) == 2, prefixed_output[-4000:]


def test_the_pages_line_is_where_the_drill_puts_it() -> None:
    """docs/integrations/ray.md's block is the start of the drill's in-code train function: its imports,
    then ``install()`` (statements compared, comments aside)."""
    import ast
    import inspect

    import ray_drill

    block = trainer_drill.doc_block(PAGE, "sc_dsd.install()")
    page = ast.parse(block.code).body[0]
    drill = ast.parse(inspect.getsource(ray_drill.train_in_code)).body[0]
    assert isinstance(page, ast.FunctionDef) and isinstance(drill, ast.FunctionDef)
    shown = [ast.dump(s) for s in page.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    ran = [ast.dump(s) for s in drill.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    assert shown == ran[: len(shown)] and len(shown) == 3, (shown, ran)
