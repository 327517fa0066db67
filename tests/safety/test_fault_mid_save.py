"""A rank killed with SIGKILL in the middle of a 2-rank DCP save.

Two gloo ranks (subprocesses) save checkpoint ``prev`` of a sparse optimizer (one parameter never
gets a gradient, so it has no state), train one more step and start saving ``new``. Rank 1
blocks inside the write (its save planner stops while resolving its first item) and the test
kills it with SIGKILL. Then:

* ``prev`` is byte-for-byte untouched and loads into a fresh optimizer exactly (state equal to
  an uninterrupted reference; no state invented for the gradient-less parameter);
* ``new`` is detectably incomplete: no ``.metadata``; ``dcp.load`` refuses it; and
  ``python -m sparse_ckpt inspect new`` exits with status 2 (when the CLI exists);
* the surviving rank does not hang and does not write ``.metadata``.

DCP writes ``.metadata`` only after every rank reported its writes, so a checkpoint directory is
complete exactly when ``.metadata`` exists. Always save each checkpoint to a new directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import runpy
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import _backends
import pytest
import torch
from helpers import assert_deep_equal
from torch import nn

import sparse_ckpt as sc

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
REPO = TESTS.parent
DEADLINE_S = 90.0  # a safety net for a loaded machine; a normal run takes a fraction of it


# --------------------------------------------------------------------------- the job (shared with the ranks)


def build_job() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A deterministic model/optimizer; ``unused`` never receives a gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    model.unused = nn.Parameter(torch.randn(3))
    opt = torch.optim.Adam(
        [{"params": [*model[0].parameters(), model.unused]}, {"params": model[1].parameters(), "lr": 0.003}], lr=0.01
    )
    return model, opt


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    """``steps`` deterministic steps (batch ``i`` seeded by ``i``)."""
    for i in range(start, start + steps):
        gen = torch.Generator().manual_seed(100 + i)
        opt.zero_grad()
        model(torch.randn(5, 8, generator=gen)).pow(2).mean().backward()
        opt.step()


WORKER = r"""
import os, sys, time
from datetime import timedelta
from pathlib import Path

rank, store, prev, new, marks = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], Path(sys.argv[5])
sys.path[:0] = sys.argv[6].split(os.pathsep)
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import sparse_ckpt as sc
import test_fault_mid_save as job


class StopInWrite(dcp.DefaultSavePlanner):
    # Rank 1 stops for good while resolving the data of its first write item.
    def resolve_data(self, write_item):
        if rank == 1:
            (marks / "rank1_writing").write_text(str(os.getpid()))
            time.sleep(600)
        return super().resolve_data(write_item)


dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60))
model, opt = job.build_job()
job.train(model, opt, 2)
dcp.save({"optim": sc.sparse_state_dict(model, opt)}, checkpoint_id=prev)
if rank == 0:  # the reference, computed with the ranks' own numerics (thread count changes the last bits)
    torch.save(opt.state_dict(), marks / "reference.pt")
dist.barrier()
(marks / f"saved_prev_{rank}").write_text("ok")
while not (marks / "go").exists():
    time.sleep(0.05)
job.train(model, opt, 1, start=2)
sd = sc.sparse_state_dict(model, opt)
sd[f"rank_only_{rank}"] = torch.full((4,), float(rank))  # every rank has an item of its own to write
dcp.save({"optim": sd}, checkpoint_id=new, planner=StopInWrite())
(marks / f"saved_new_{rank}").write_text("unexpected")
"""


def _wait_for(path: Path, procs: list[subprocess.Popen], what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not path.exists():
        for p in procs:
            if p.poll() is not None and not path.exists():
                out = p.stdout.read() if p.stdout else ""
                pytest.fail(f"rank exited ({p.returncode}) before {what}:\n{out[-3000:]}")
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _run_cli(*args: str) -> tuple[int, str]:
    """``python -m sparse_ckpt ARGS`` in this process: ``(exit status, output)``."""
    out = io.StringIO()
    argv = sys.argv
    sys.argv = ["sparse_ckpt", *args]
    try:
        with redirect_stdout(out), redirect_stderr(out):
            runpy.run_module("sparse_ckpt", run_name="__main__", alter_sys=False)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
    return code, out.getvalue()


@_backends.only("python")
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    """Kill rank 1 mid-write: ``prev`` intact and loadable, ``new`` detectably incomplete.

    Runs on the Python core only: the fault is in DCP's write path, which the core does not
    touch, and both cores produce identical tables (tests/core/test_core_differential.py); two
    ranks of torch start-up per backend is the bulk of this test's time.
    """
    if not hasattr(sc, "SparseLoadPlanner"):
        pytest.skip("sparse_ckpt.SparseLoadPlanner not available")
    import torch.distributed.checkpoint as dcp

    prev, new, marks = tmp_path / "prev", tmp_path / "new", tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    procs: list[subprocess.Popen] = []
    try:
        for rank in (0, 1):
            cmd = [
                sys.executable,
                str(script),
                str(rank),
                str(tmp_path / "store"),
                str(prev),
                str(new),
                str(marks),
                os.pathsep.join([str(HERE), str(TESTS)]),
            ]
            procs.append(
                subprocess.Popen(
                    cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        _wait_for(marks / "saved_prev_0", procs, "the first checkpoint")
        _wait_for(marks / "saved_prev_1", procs, "the first checkpoint")
        assert (prev / ".metadata").is_file()
        prev_files = _tree_digest(prev)
        (marks / "go").write_text("go")

        _wait_for(marks / "rank1_writing", procs, "rank 1 to start writing")
        assert int((marks / "rank1_writing").read_text()) == procs[1].pid
        procs[1].send_signal(signal.SIGKILL)
        assert procs[1].wait(timeout=DEADLINE_S) == -signal.SIGKILL
        try:  # the survivor notices the dead peer (gloo) or times out; it must not write .metadata
            rc0 = procs[0].wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            procs[0].kill()
            rc0 = procs[0].wait(timeout=10)
        assert rc0 != 0
        assert not (marks / "saved_new_0").exists() and not (marks / "saved_new_1").exists()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
            if p.stdout:
                p.stdout.close()

    # the new checkpoint is detectably incomplete
    assert new.is_dir() and not (new / ".metadata").exists()
    model, fresh = build_job()
    with pytest.raises((FileNotFoundError, sc.SparseCheckpointError, dcp.CheckpointException)):
        dcp.load(
            {"optim": sc.SparseOptimizerState(model, fresh)},
            checkpoint_id=str(new),
            planner=sc.SparseLoadPlanner(),
            no_dist=True,
        )
    assert not fresh.state
    if importlib.util.find_spec("sparse_ckpt.tools._cli") is not None:
        code, output = _run_cli("inspect", str(new))
        assert code == 2, output
        assert "incomplete" in output and str(new) in output, output

    # the previous checkpoint is untouched and loads exactly
    assert _tree_digest(prev) == prev_files
    reference = torch.load(marks / "reference.pt", weights_only=True)
    model, fresh = build_job()
    dcp.load(
        {"optim": sc.SparseOptimizerState(model, fresh)},
        checkpoint_id=str(prev),
        planner=sc.SparseLoadPlanner(),
        no_dist=True,
    )
    assert model.unused not in fresh.state  # no state invented for the gradient-less parameter
    assert len(reference["state"]) == 4  # 5 parameters, one never stepped
    # key order is not compared: after a multi-rank DCP save it follows the metadata
    assert_deep_equal(fresh.state_dict(), reference, "state_dict", check_order=False, nan_equal="none", mapping=dict)
