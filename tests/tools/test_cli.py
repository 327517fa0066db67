"""``python -m sparse_ckpt inspect|verify|diff|convert|export``: exit codes and output, in a subprocess
where the interpreter matters (tracebacks, closed pipes), else in-process through ``cli.main``."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import _backends
import child_process
import pytest
import torch
import torch.distributed.checkpoint as dcp
from child_process import REPO, repo_env
from helpers import assert_optimizer_equal, moe_with_leaves, sparse_dcp_load, train
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt.tools import _cli as cli
from sparse_ckpt.tools import inspect_checkpoint
from sparse_ckpt.tools._reader import expand_scalar_tables, open_checkpoint, read_entries
from sparse_ckpt.tools.inspect import expert_summary, id_ranges

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
# Each test runs the CLI in a child process (a torch import each): the default core backend by default,
# both under SPARSE_CKPT_EXHAUSTIVE_SWEEPS=1 (.ci/run), as for the multi-rank tests (`_backends.ranks`).


def run_cli(*args: str, warnings: str | None = "ignore") -> subprocess.CompletedProcess[str]:
    """``python -m sparse_ckpt *args`` in a child process (``PYTHONWARNINGS=warnings``; None: unset)."""
    env = repo_env({k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"})
    if warnings is not None:
        env["PYTHONWARNINGS"] = warnings
    return child_process.run([sys.executable, "-m", "sparse_ckpt", *args], env=env)


build = moe_with_leaves


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, nn.Module, sc.MultiOptimizer]:
    model, opt = build(0)
    train(model, opt, 2, only_experts=[0, 1])  # expert 2 and the idle leaf stay stateless
    for group in opt["idle"].param_groups:
        group["lr"] = 0.0025
    path = tmp_path / "ckpt"
    # Per-item state: these tests name, flip and truncate single state items (the default layout's
    # buffers: tests/dcp/test_buffers.py, tests/dcp/test_auto_layout.py).
    state = sc.SparseOptimizerState(model, opt, state_layout="per_tensor")
    dcp.save({"model": model.state_dict(), "optim": state}, checkpoint_id=path)
    return path, model, opt


@_backends.ranks
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
    assert [(g["params"], g["with_state"], g["without_state"]) for g in experts["groups"]] == [
        (3, 3, 0),
        (3, 3, 0),
        (3, 0, 3),
    ]
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


@_backends.ranks
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
    # model + state unchanged; the scalar tables became per-item state (DSD's layout has no tables)
    md = open_checkpoint(path)
    tables = [k for k in md.state_dict_metadata if k.startswith("optim.state.__packed__.")]
    assert len(tables) == 2  # leaves 'dense' and 'experts' (leaf 'idle' has no state)
    read = read_entries(path, md, tables)
    expanded = expand_scalar_tables({k.removeprefix("optim."): v for k, v in read.items()}, flat=True)
    assert expanded and all(k.endswith(".step") for k in expanded)
    state = {k for k in keys(path) if not k.startswith("optim.param_groups.") and k not in tables}
    state |= {f"optim.{k}" for k in expanded}
    assert {k for k in flat_keys if not k.startswith("optim.param_groups.")} == state  # model + state unchanged
    packed_keys = keys(packed)
    assert {k for k in packed_keys if not k.startswith("optim.param_groups.")} == state
    assert [k for k in packed_keys if "__packed__" in k] and all(
        k.startswith("optim.param_groups.__packed__.optim.")
        for k in packed_keys
        if k.startswith("optim.param_groups.") and not k.endswith(".lr")
    )
    # the converted packed checkpoint is guarded against foreign loaders like one sparse_ckpt saves;
    # the flat one holds no guard (its param_groups.*.lr entries are the real settings)
    assert {k for k in packed_keys if k.endswith(".lr")} == {
        "optim.param_groups.embed.weight.lr",
        "optim.param_groups.0.lr",
    }
    assert "optim.param_groups.0.lr" not in flat_keys

    for src in (flat, packed):
        model2, opt2 = build(seed=1)
        msd = model2.state_dict()
        sparse_dcp_load(src, model2, opt2, state={"model": msd})
        model2.load_state_dict(msd)
        assert_optimizer_equal(opt, opt2, grads=False)
        assert not opt2["idle"].state and opt2["idle"].param_groups[0]["lr"] == 0.0025


@_backends.ranks
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


@_backends.ranks
def test_not_a_checkpoint_exits_2(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_cli("inspect", str(empty))
    assert r.returncode == 2
    assert "incomplete or not a DCP checkpoint" in r.stderr and "Traceback" not in r.stderr


@_backends.ranks
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


# --------------------------------------------------------------------------- inspect --params, experts


@_backends.ranks
def test_inspect_params_and_expert_counts(
    checkpoint: tuple[Path, nn.Module, sc.MultiOptimizer], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _model, _opt = checkpoint
    assert cli.main(["inspect", str(path), "--params"]) == 0
    out = capsys.readouterr().out
    assert "experts with state: 2/3 in 1 layer(s) (per layer: 2/3; FQNs '...experts.N...')" in out
    assert "      experts  2/3 with state; without state: 2" in out
    assert "    parameters without state (3):\n      experts.2.up.weight\n      experts.2.up.bias\n" in out
    assert "experts with state: 0/1 in 1 layer(s)" in out  # leaf 'idle' holds expert 3
    assert cli.main(["inspect", str(path)]) == 0
    plain = capsys.readouterr().out
    assert "experts with state: 2/3" in plain and "parameters without state" not in plain

    report = inspect_checkpoint(str(path), params=True)
    leaves = {leaf["name"]: leaf for leaf in report["optimizers"][0]["leaves"]}
    [layer] = leaves["experts"]["experts"]
    assert layer == {
        "layer": "experts",
        "experts": 3,
        "with_state": 2,
        "partial": 0,
        "without_state": 1,
        "without_state_ids": [2],
        "partial_ids": [],
    }
    assert leaves["idle"]["params_without_state"] == [
        "experts.3.up.weight",
        "experts.3.up.bias",
        "experts.3.down.weight",
    ]
    assert "params_without_state" not in inspect_checkpoint(str(path))["optimizers"][0]["leaves"][0]


@_backends.ranks
def test_expert_summary_layers_and_partial_experts() -> None:
    fqns = [f"model.layers.{layer}.mlp.experts.{e}.{w}" for layer in (10, 2) for e in range(4) for w in ("w1", "w2")]
    fqns += ["model.layers.2.mlp.shared_experts.w1", "model.layers.2.attn.q.weight"]  # not routed experts
    stateful = {f for f in fqns if ".experts.0." in f or ".experts.3.w1" in f or "layers.10.mlp.experts.1." in f}
    rows = expert_summary(fqns, stateful.__contains__)
    assert [r["layer"] for r in rows] == ["model.layers.2.mlp.experts", "model.layers.10.mlp.experts"]
    assert [(r["with_state"], r["partial"], r["without_state"]) for r in rows] == [(1, 1, 2), (2, 1, 1)]
    assert rows[0]["partial_ids"] == [3] and rows[0]["without_state_ids"] == [1, 2]


@_backends.ranks
def test_expert_ids_as_ranges_in_text_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--params`` text compresses runs of expert ids (``0-3, 7, 9-199``); ``--json`` keeps every id."""
    assert id_ranges([]) == ""
    assert id_ranges([5]) == "5"
    assert id_ranges([0, 1, 2, 3, 7, 9, 10]) == "0-3, 7, 9-10"
    assert id_ranges([1, 3, 5]) == "1, 3, 5"

    model = nn.Module()
    model.experts = nn.ModuleList(nn.Linear(1, 1, bias=False) for _ in range(200))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for e in (4, 5, 6, 8):  # only these experts were routed: they have momentum buffers
        model.experts[e].weight.grad = torch.ones(1, 1)
    opt.step()
    dcp.save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=tmp_path / "ckpt")

    assert cli.main(["inspect", str(tmp_path / "ckpt"), "--params"]) == 0
    out = capsys.readouterr().out
    assert "      experts  4/200 with state; without state: 0-3, 7, 9-199\n" in out
    assert cli.main(["inspect", str(tmp_path / "ckpt"), "--params", "--json"]) == 0
    [leaf] = json.loads(capsys.readouterr().out)["optimizers"][0]["leaves"]
    [layer] = leaf["experts"]
    assert layer["without_state_ids"] == [*range(4), 7, *range(9, 200)]


def _wide_checkpoint(path: Path) -> None:
    """An optimizer over 4 x 1000 stateless experts: `inspect --params` prints > 64 KiB."""
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Module() for _ in range(4))
    for layer in model.layers:
        layer.experts = nn.ModuleList(nn.Linear(1, 1, bias=False) for _ in range(1000))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dcp.save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=path)


@_backends.only("python")
@pytest.mark.parametrize("unbuffered", [False, True])
def test_closed_pipe_is_quiet(tmp_path: Path, unbuffered: bool) -> None:
    """``inspect --params | head -1``: nothing at all on stderr, exit 1 -- what the "Note on SIGPIPE"
    of Python's signal module documentation recommends (README, CLI, exit status). With
    PYTHONUNBUFFERED=1 Python's text layer may drop the write that fails, so the status can be 0
    there; stderr is still empty."""
    path = tmp_path / "wide"
    _wide_checkpoint(path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparse_ckpt", "inspect", str(path), "--params"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # what `| head -1` does
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) in ((0, 1) if unbuffered else (1,))
    assert first.startswith(b"checkpoint: ")
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
    assert err == "", err


@_backends.ranks
def test_broken_pipe_in_process(
    checkpoint: tuple[Path, nn.Module, sc.MultiOptimizer],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    class Closed(io.StringIO):
        def write(self, _text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert cli.main(["inspect", str(checkpoint[0])]) == 1
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- damaged checkpoints


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@_backends.ranks
def test_damaged_checkpoints_exit_1_with_one_line(
    checkpoint: tuple[Path, nn.Module, sc.MultiOptimizer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = checkpoint[0]
    [data] = [p.name for p in path.iterdir() if p.suffix == ".distcp"]

    garbage = tmp_path / "garbage"
    shutil.copytree(path, garbage)
    (garbage / ".metadata").write_bytes(b"\x00not a pickle" * 20)
    for command in ("inspect", "verify"):
        assert cli.main([command, str(garbage)]) == 1
        assert ".metadata' cannot be read" in _one_line_error(capsys)
    assert cli.main(["diff", str(path), str(garbage)]) == 1
    _one_line_error(capsys)

    no_data = tmp_path / "no_data"
    shutil.copytree(path, no_data)
    (no_data / data).unlink()
    assert cli.main(["inspect", str(no_data)]) == 1
    assert f"{data}': the file is missing" in _one_line_error(capsys)
    assert cli.main(["verify", str(no_data)]) == 1
    assert f"data file '{data}' is missing" in capsys.readouterr().out
    assert cli.main(["export", str(no_data), str(tmp_path / "out")]) == 1
    assert f"{data}': the file is missing" in _one_line_error(capsys)

    r = run_cli("inspect", str(garbage))  # and really no traceback from the interpreter
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


@_backends.ranks
def test_verify_finds_truncation_and_bit_flips(
    checkpoint: tuple[Path, nn.Module, sc.MultiOptimizer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = checkpoint[0]
    assert cli.main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("OK") and "problem" not in out
    assert cli.main(["verify", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    md = dcp.FileSystemReader(str(path)).read_metadata()
    assert (
        report["ok"]
        and report["items"] == report["read"] == len(md.state_dict_metadata)
        and report["crc_unchecked"] == 0
    )

    [data] = [p.name for p in path.iterdir() if p.suffix == ".distcp"]
    truncated = tmp_path / "truncated"
    shutil.copytree(path, truncated)
    with open(truncated / data, "r+b") as f:
        f.truncate(os.path.getsize(truncated / data) - 100)
    assert cli.main(["inspect", str(truncated)]) == 1  # inspect checks file sizes too
    captured = capsys.readouterr()
    assert "storage problem: " in captured.out and "run `python -m sparse_ckpt verify`" in captured.err
    assert cli.main(["verify", str(truncated)]) == 1
    out = capsys.readouterr().out
    assert "truncated: needs bytes" in out and out.rstrip().endswith("1 problem(s)"), out

    # One byte of a state tensor's data flipped: torch.load accepts it, the item's CRC-32 does not.
    flipped = tmp_path / "flipped"
    shutil.copytree(path, flipped)
    key = "optim.state.experts.0.up.weight.exp_avg"
    [info] = [s for i, s in md.storage_data.items() if i.fqn == key]
    blob = (path / data).read_bytes()
    member = next(
        z
        for z in zipfile.ZipFile(io.BytesIO(blob[info.offset : info.offset + info.length])).infolist()
        if "/data/" in z.filename
    )
    at = info.offset + member.header_offset
    name_len, extra_len = struct.unpack("<HH", blob[at + 26 : at + 30])
    at += 30 + name_len + extra_len + 3
    (flipped / data).write_bytes(blob[:at] + bytes([blob[at] ^ 0x40]) + blob[at + 1 :])
    assert cli.main(["verify", str(flipped), "--json"]) == 1
    [problem] = json.loads(capsys.readouterr().out)["problems"]
    assert problem["key"] == key and "CRC" in problem["problem"], problem


# --------------------------------------------------------------------------- diff, --version, export


@_backends.ranks
def test_diff(
    checkpoint: tuple[Path, nn.Module, sc.MultiOptimizer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, model, opt = checkpoint
    assert cli.main(["diff", str(path), str(path), "--exit-code"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("no differences")

    train(model, opt, 1, only_experts=[2], seed=5)  # expert 2 gains state
    opt["dense"].param_groups[0]["lr"] = 0.005
    st = opt["dense"].state[model.embed.weight]
    st["exp_avg"] = st["exp_avg"].to(torch.bfloat16)
    moved = opt["experts"].param_groups[1]["params"].pop()  # experts.1.down.weight -> idle
    opt["idle"].param_groups[0]["params"].append(moved)
    opt["idle"].state[moved] = opt["experts"].state.pop(moved)
    other = tmp_path / "b"
    dcp.save({"model": model.state_dict(), "optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=other)

    assert cli.main(["diff", str(path), str(other)]) == 0
    out = capsys.readouterr().out
    dense = "'embed.weight', 'embed.bias', 'router.weight', 'norm.weight', 'norm.bias', 'head.weight', 'head.bias'"
    assert f"  7 param(s) {dense}: lr 0.01 -> 0.005" in out
    assert "  1 param(s) 'experts.1.down.weight': lr 0.01 -> 0.0025" in out  # moved into the idle leaf's group
    assert "  3 param(s) gained state: 'experts.2.up.weight', 'experts.2.up.bias', 'experts.2.down.weight'" in out
    assert "  state exp_avg of 'embed.weight': float32 (8, 8) -> bfloat16 (8, 8)" in out
    assert "layout:" not in out and out.rstrip().endswith("6 difference(s)")
    assert cli.main(["diff", str(path), str(other), "--layout"]) == 0
    out = capsys.readouterr().out
    assert "  layout: leaf 'experts' group 1: -1 param(s): 'experts.1.down.weight'" in out
    assert "  layout: leaf 'idle' group 0: +1 param(s): 'experts.1.down.weight'" in out
    assert out.rstrip().endswith("8 difference(s)")
    assert cli.main(["diff", str(path), str(other), "--exit-code", "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    [o] = report["optimizers"]
    assert o["leaves"] == []
    assert o["settings"][0] == {"fqns": dense.replace("'", "").split(", "), "changed": {"lr": [0.01, 0.005]}}
    assert o["state_changes"] == [
        {
            "fqn": "embed.weight",
            "key": "exp_avg",
            "a": {"dtype": "float32", "shape": [8, 8]},
            "b": {"dtype": "bfloat16", "shape": [8, 8]},
        }
    ]
    assert report["differences"] == 1 + 1 + 3 + 1


@_backends.ranks
def test_diff_compares_meaning_not_layout(
    checkpoint: tuple[Path, nn.Module, sc.MultiOptimizer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A MultiOptimizer checkpoint and its lossless flat copy (no leaves, groups by settings) mean the same."""
    path, _model, _opt = checkpoint
    flat = tmp_path / "flat"
    assert cli.main(["convert", str(path), str(flat), "--to", "flat", "--key", "optim"]) == 0
    capsys.readouterr()
    assert cli.main(["diff", str(path), str(flat), "--exit-code"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("no differences")
    assert cli.main(["diff", str(path), str(flat), "--exit-code", "--layout"]) == 3
    out = capsys.readouterr().out
    assert "  layout: leaf 'dense': only in a (1 group(s), 7 params)" in out
    assert "  layout: leaf 'optim': only in b (" in out


@_backends.ranks
def test_convert_shows_no_torch_warning(checkpoint: tuple[Path, nn.Module, sc.MultiOptimizer], tmp_path: Path) -> None:
    """torch's single-process DCP warning is not the CLI user's business (warnings left on here)."""
    path, _model, _opt = checkpoint
    for args in (
        ["convert", str(path), str(tmp_path / "flat"), "--to", "flat", "--key", "optim"],
        ["diff", str(path), str(tmp_path / "flat")],
    ):
        r = run_cli(*args, warnings=None)
        assert r.returncode == 0, r.stderr
        assert "Warning" not in r.stderr + r.stdout, r.stderr


@_backends.ranks
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"sparse_ckpt {sc.__version__} (torch ")


@_backends.ranks
def test_export_command(checkpoint: tuple[Path, nn.Module, sc.MultiOptimizer], tmp_path: Path) -> None:
    path, model, opt = checkpoint
    out = tmp_path / "export"
    r = run_cli("export", str(path), str(out), "--key", "optim")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {out}: optimizer 'optim' (packed), leaves ['dense', 'experts', 'idle'], ")
    from sparse_ckpt.export import load_export

    model2, opt2 = build(seed=1)
    model2.load_state_dict(model.state_dict())
    load_export(model2, opt2, out)
    assert_optimizer_equal(opt, opt2, grads=False)
    assert cli.main(["export", str(path), str(out)]) == 2  # not an empty directory
