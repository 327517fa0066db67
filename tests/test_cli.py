"""``python -m sparse_ckpt inspect|convert`` in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_optimizer_equal, make_moe, train
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt import cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run(
        [sys.executable, "-m", "sparse_ckpt", *args], check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def build(seed: int) -> tuple[nn.Module, sc.MultiOptimizer]:
    model = make_moe(seed)
    experts = [{"params": list(model.experts[e].parameters())} for e in range(3)]
    opt = sc.MultiOptimizer(
        model,
        {
            "dense": torch.optim.AdamW(model.dense_params(), lr=0.01),
            "experts": torch.optim.AdamW(experts, lr=0.01),
            "idle": torch.optim.AdamW(model.experts[3].parameters(), lr=0.01),
        },
    )
    return model, opt


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, nn.Module, sc.MultiOptimizer]:
    model, opt = build(0)
    train(model, opt, 2, only_experts=[0, 1])  # expert 2 and the idle leaf stay stateless
    for group in opt["idle"].param_groups:
        group["lr"] = 0.0025
    path = tmp_path / "ckpt"
    dcp.save({"model": model.state_dict(), "optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=path)
    return path, model, opt


def test_inspect_text_and_json(checkpoint: tuple[Path, nn.Module, sc.MultiOptimizer]) -> None:
    path, model, opt = checkpoint
    text = run_cli("inspect", str(path))
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "optimizer optim: packed format" in out
    assert "leaf 'idle': 1 group(s), 3 params (0 with state, 3 without)" in out
    assert "lr=0.0025, betas=(0.9, 0.999)" in out
    assert "leaf 'experts': 3 group(s), 9 params (6 with state, 3 without)" in out
    assert "state exp_avg_sq: float32 x6" in out

    js = run_cli("inspect", str(path), "--json", "--key", "optim")
    assert js.returncode == 0, js.stderr
    report = json.loads(js.stdout)
    assert report["checkpoint"] == str(path)
    [o] = report["optimizers"]
    assert (o["key"], o["format"]) == ("optim", "packed")
    assert [leaf["name"] for leaf in o["leaves"]] == ["dense", "experts", "idle"]
    leaves = {leaf["name"]: leaf for leaf in o["leaves"]}
    experts = leaves["experts"]
    assert [(g["params"], g["with_state"], g["without_state"]) for g in experts["groups"]] == [(3, 3, 0), (3, 3, 0), (3, 0, 3)]
    idle = leaves["idle"]["groups"][0]["settings"]
    assert idle["lr"] == 0.0025 and idle["betas"] == [0.9, 0.999] and idle["weight_decay"] == 0.01
    for name, o_leaf in (("dense", opt["dense"]), ("experts", opt["experts"])):
        keys = leaves[name]["state_keys"]
        assert set(keys) == {"step", "exp_avg", "exp_avg_sq"}
        assert keys["exp_avg"]["dtypes"] == ["float32"] and keys["exp_avg"]["count"] == len(o_leaf.state)
        expected = sum(t.numel() * t.element_size() for st in o_leaf.state.values() for t in st.values())
        assert leaves[name]["state_bytes"] == expected
    assert leaves["idle"]["state_keys"] == {} and leaves["idle"]["state_bytes"] == 0
    assert o["with_state"] + o["without_state"] == o["params"] == sum(1 for _ in model.parameters())
    assert o["disk_bytes"] > o["state_bytes"] > 0 and o["table_bytes"] > 0
    assert o["state_without_group"] == [] and o["unmatched_keys"] == []


def test_convert_round_trip(checkpoint: tuple[Path, nn.Module, sc.MultiOptimizer], tmp_path: Path) -> None:
    path, _model, opt = checkpoint
    flat, packed = tmp_path / "flat", tmp_path / "packed"
    r = run_cli("convert", str(path), str(flat), "--to", "flat")
    assert r.returncode == 0, r.stderr
    r = run_cli("convert", str(flat), str(packed), "--to", "packed", "--key", "optim")
    assert r.returncode == 0, r.stderr

    def keys(p: Path) -> set[str]:
        return set(dcp.FileSystemReader(str(p)).read_metadata().state_dict_metadata)

    flat_keys = keys(flat)
    assert not any("__packed__" in k for k in flat_keys)
    assert "optim.param_groups.experts.3.up.weight.lr" in flat_keys
    state = {k for k in keys(path) if not k.startswith("optim.param_groups.")}
    assert {k for k in flat_keys if not k.startswith("optim.param_groups.")} == state  # model + state unchanged
    packed_keys = keys(packed)
    assert {k for k in packed_keys if not k.startswith("optim.param_groups.")} == state
    assert [k for k in packed_keys if "__packed__" in k] and all(
        k.startswith("optim.param_groups.__packed__.optim.") for k in packed_keys if k.startswith("optim.param_groups.")
    )

    for src in (flat, packed):
        model2, opt2 = build(seed=1)
        msd = model2.state_dict()
        dcp.load({"model": msd, "optim": sc.SparseOptimizerState(model2, opt2)}, checkpoint_id=src,
                 planner=sc.SparseLoadPlanner())
        model2.load_state_dict(msd)
        assert_optimizer_equal(opt, opt2, grads=False)
        assert not opt2["idle"].state and opt2["idle"].param_groups[0]["lr"] == 0.0025


def test_convert_to_flat_refuses_escaped_state_keys(tmp_path: Path) -> None:
    """A packed checkpoint with a state key the flat layout cannot hold (here ``'ema.decay'``)."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.state[model.weight]["ema.decay"] = torch.tensor(0.9)
    dcp.save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=tmp_path / "src")
    r = run_cli("convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--to", "flat")
    assert r.returncode == 1 and "escaped part" in r.stderr and "ema%2Edecay" in r.stderr, r.stderr
    r = run_cli("inspect", str(tmp_path / "src"))  # the planner guard item is not an optimizer entry
    assert r.returncode == 0 and "__sparse_ckpt__" not in r.stdout and "unrecognised" not in r.stdout, r.stdout


def test_not_a_checkpoint_exits_2(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_cli("inspect", str(empty))
    assert r.returncode == 2
    assert "incomplete or not a DCP checkpoint" in r.stderr and "Traceback" not in r.stderr


def test_usage_errors_exit_2_in_process(
    checkpoint: tuple[Path, nn.Module, sc.MultiOptimizer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same entry point in-process (no interpreter start-up): more exit-2 paths."""
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 16)  # data written, metadata never committed
    assert cli.main(["convert", str(partial), str(tmp_path / "out"), "--to", "flat"]) == 2
    assert "incomplete or not a DCP checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert cli.main(["inspect", str(tmp_path / "missing")]) == 2
    assert "incomplete or not a DCP checkpoint" in capsys.readouterr().err

    path, _model, _opt = checkpoint
    assert cli.main(["inspect", str(path), "--key", "optimizer"]) == 2
    assert "no optimizer entries under key 'optimizer' (found: 'optim')" in capsys.readouterr().err
    assert cli.main(["convert", str(path), str(partial), "--to", "flat"]) == 2
    assert "is not an empty directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["convert", str(path), str(tmp_path / "x"), "--to", "dense"])
    assert exc.value.code == 2
