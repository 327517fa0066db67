"""The resume drill (``bench/drills/resume.py``: train, kill a save, resume at other world sizes), at test
sizes, under each core backend.

One drill per backend (cached for the tests of this module): an uninterrupted 2-rank FSDP2 run of
a MoE + frozen vision tower model with a three-leaf ``MultiOptimizer`` and async saves every 2
steps; the same run SIGKILLed (every rank's process group) while the save of step 6 is in flight;
resumes from the last complete checkpoint (step 4) at world sizes 2, 1 and 4, trained on to step 8.
The tests then check what the drill found: the killed checkpoint is incomplete, every resume is
bit-identical to the uninterrupted run, and no optimizer state exists for unrouted experts or the
frozen vision leaf. A broken resume (one app-state key not loaded) must fail the comparison.
The drills run as on a GPU machine: no fork in this process (``forbid_fork``) and no default mesh
in the ranks (``_dist.guarded``).
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import guarded

import sparse_ckpt as sc
from bench.drills import resume
from sparse_ckpt.tools import inspect_checkpoint

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
    pytest.mark.usefixtures("forbid_fork"),  # ranks start from a fork server or by spawn (tests/conftest.py)
]

CFG = resume.DrillConfig(steps=8, every=2)  # saves at 2, 4, 6, 8; the save of step 6 is killed
RESUME_SIZES = (2, 1, 4)
_DRILLS: dict[str, resume.DrillResult] = {}


@pytest.fixture
def drill(core_backend: str, tmp_path_factory: pytest.TempPathFactory) -> resume.DrillResult:
    """The drill of the active backend (run once per backend, then reused)."""
    if core_backend not in _DRILLS:
        root = tmp_path_factory.mktemp(f"drill-{core_backend}")
        _DRILLS[core_backend] = resume.run_drill(
            CFG, nproc=2, resume_sizes=RESUME_SIZES, root=root, rank_fn=guarded(resume.train_run)
        )
    result = _DRILLS[core_backend]
    assert result.reference["backend"] == core_backend
    return result


def test_config() -> None:
    assert CFG.save_steps() == [2, 4, 6, 8]
    assert CFG.kill_step() == 6
    assert resume.DrillConfig(steps=8, every=2, kill_at=4).kill_step() == 4
    for bad in ({"kill_at": 2}, {"kill_at": 5}, {"steps": 3}):
        with pytest.raises(ValueError):
            resume.DrillConfig(**{"steps": 8, "every": 2, **bad}).kill_step()


def test_killed_save_is_incomplete(drill: resume.DrillResult) -> None:
    ckpt = drill.root / "killed" / "ckpt"
    assert drill.kill_step == 6 and drill.incomplete == ["step-6"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4", "step-6"]  # the loop never got further
    assert list((ckpt / "step-6").glob("*.distcp")), "the in-flight save had written data files"
    assert not (ckpt / "step-6" / ".metadata").exists()
    with pytest.raises(FileNotFoundError):
        dcp.FileSystemReader(str(ckpt / "step-6")).read_metadata()
    assert resume.latest_complete(ckpt) == (4, ckpt / "step-4")
    assert drill.resumed_from == "step-4"


@pytest.mark.parametrize("world_size", RESUME_SIZES)
def test_resume_is_bit_identical(drill: resume.DrillResult, world_size: int) -> None:
    info = drill.resumes[world_size]
    assert info["world_size"] == world_size and info["resumed_from"] == "step-4"
    assert [s["step"] for s in info["saves"]] == [6, 8]
    # run_drill compared everything; these are the counts of what it compared
    n_routed = CFG.n_blocks * CFG.routed * 2  # up and down of every routed expert
    n_dense = 3 + CFG.n_blocks  # adapter, embed, head, routers
    assert info["checks"] == {
        "params": 39,
        "state_params": n_routed + n_dense,
        "state_tensors": 3 * (n_routed + n_dense),
    }


def test_no_state_for_unrouted_experts_or_vision(drill: resume.DrillResult) -> None:
    paths = [
        drill.root / "reference" / "ckpt" / "step-8",
        drill.root / "killed" / "ckpt" / "step-4",
        *(drill.root / f"resume-{n}" / "ckpt" / "step-8" for n in RESUME_SIZES),
    ]
    for path in paths:
        assert resume.check_checkpoint_keys(path, CFG) > 0
        [report] = inspect_checkpoint(str(path))["optimizers"]
        leaves = {leaf["name"]: leaf for leaf in report["leaves"]}
        # leaves in order of their tables in the metadata, which DCP's cross-rank dedup decides
        assert sorted(leaves) == ["dense", "experts", "vision"]
        n_unrouted = CFG.n_blocks * (CFG.n_experts - CFG.routed) * 2
        assert leaves["experts"]["without_state"] == n_unrouted, path
        assert leaves["dense"]["without_state"] == 0, path
        assert leaves["vision"]["with_state"] == 0 and leaves["vision"]["without_state"] == 2, path
    ref = torch.load(drill.root / "reference" / resume.SNAPSHOT, weights_only=True)
    assert ref["lr"]["vision"] == [0.0025]
    assert all(st for st in ref["state"].values()), "no {} state entries"
    # the schedule moved the frozen leaf's lr across the kill: 0.005 in the checkpoint resumed from
    [report] = inspect_checkpoint(str(drill.root / "killed" / "ckpt" / "step-4"))["optimizers"]
    vision = next(leaf for leaf in report["leaves"] if leaf["name"] == "vision")
    assert [g["settings"]["lr"] for g in vision["groups"]] == [0.005]


@pytest.mark.parametrize("skip", ["optim", "sched"])
def test_broken_resume_is_caught(drill: resume.DrillResult, tmp_path: Path, skip: str) -> None:
    """Resuming without the optimizer (or the schedulers) trains on, but the comparison fails."""
    resume.run_ranks(
        guarded(resume.train_run),
        2,
        CFG,
        str(tmp_path / "ckpt"),
        str(tmp_path),
        str(drill.root / "killed" / "ckpt"),
        None,
        (skip,),
        err_dir=str(tmp_path),
    )
    ref = torch.load(drill.root / "reference" / resume.SNAPSHOT, weights_only=True)
    got = torch.load(tmp_path / resume.SNAPSHOT, weights_only=True)
    with pytest.raises(AssertionError, match=f"resume without {skip}: "):
        resume.compare_snapshots(ref, got, f"resume without {skip}")


def test_compare_snapshots_sees_one_ulp(drill: resume.DrillResult) -> None:
    ref = torch.load(drill.root / "reference" / resume.SNAPSHOT, weights_only=True)
    got: dict[str, Any] = torch.load(drill.root / "reference" / resume.SNAPSHOT, weights_only=True)
    key = next(iter(got["state"]))
    t = got["state"][key]["exp_avg"]
    t.view(-1)[0] = torch.nextafter(t.view(-1)[0], torch.tensor(float("inf")))
    with pytest.raises(AssertionError, match="exp_avg"):
        resume.compare_snapshots(ref, got, "one ulp")


def test_scheduler_state_refuses_int_keys() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = resume.SchedulerState({"a": torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4])})
    with pytest.raises(TypeError, match="non-string key 2"):
        state.state_dict()


def test_cli(core_backend: str, tmp_path: Path) -> None:
    """``python -m bench.resume`` at 1 rank, resumed at 2 (once: the CLI is the same drill)."""
    if core_backend != "python":
        pytest.skip("the CLI runs the same drill; once is enough")
    out = io.StringIO()
    with redirect_stdout(out):
        code = resume.main(
            ["--nproc", "1", "--steps", "4", "--every", "1", "--resume-sizes", "2", "--out", str(tmp_path / "run")]
        )
    text = out.getvalue()
    assert code == 0, text
    assert "SIGKILL" in text and "last complete: step-2" in text and "resume drill: PASS" in text
    assert text.count("stall") >= 4 + 1 and "mean step" in text
    assert f"core {sc.backend()}" in text


def test_default_resume_sizes() -> None:
    assert resume.default_resume_sizes(2, None) == [2, 1, 4]  # CPU: every size
    assert resume.default_resume_sizes(1, 1) == [1]  # one GPU: one rank
    assert resume.default_resume_sizes(2, 2) == [2, 1]
    assert resume.default_resume_sizes(4, 8) == [4, 1, 2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here: the drill would run")
def test_cli_device_cuda_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert resume.main(["--device", "cuda"]) == 2
    assert "--device cuda: torch.cuda.is_available() is False" in capsys.readouterr().err


def test_cli_device_cuda_one_rank_per_gpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """More ranks than GPUs is refused before any process starts, naming the count (one GPU simulated)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for argv in (["--nproc", "2"], ["--nproc", "1", "--resume-sizes", "1,2"]):
        assert resume.main(["--device", "cuda", *argv]) == 2
        err = capsys.readouterr().err
        assert "one rank per GPU: a world size of 2 needs 2 GPUs, this machine has 1" in err, err
