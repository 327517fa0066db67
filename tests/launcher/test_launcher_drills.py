"""The trainer drills through the real launchers, with ``sparse-ckpt-run`` in front and without.

Each drill is a training script with no line of sparse_ckpt (``drills/``; checked below), the MoE of
``dsd_moe`` (40 parameters, 22 with gradients, ``vision`` in its own AdamW group whose lr a LambdaLR
moves), 2 Gloo ranks on CPU with FSDP2, started by the launcher its users type:

- ``accelerate launch`` of a Hugging Face ``Trainer`` script configured by its own command line
  (``TrainingArguments`` from ``HfArgumentParser``: ``--save_steps 3``, ``--resume_from_checkpoint``);
- ``torchrun`` of a Lightning Fabric script (``ModelParallelStrategy``, ``fabric.save``/``fabric.load``);
- ``torchrun`` of an OLMo-core script (``save_model_and_optim_state``/``load_model_and_optim_state``,
  DSD's flat layout).

Three launches per drill: (1) with the prefix, a fresh run of 5 steps that saves after step 3 through
the trainer's own checkpointing (its end state is the uninterrupted reference); (2) the stock
launcher resuming from that checkpoint: it fails (pinned: ``Missing key in checkpoint state_dict:
...layers.0.experts.4.weight.step``, the expert that never got tokens); (3) with the prefix, the
resume: the 2 remaining steps end bit for bit where the uninterrupted run ended, with state for the
22 parameters that stepped and every group's lr the scheduler's. Each prefixed launch logs exactly
one routing line per rank and none from the launcher's own processes.

The stock launch (2) re-proves, through the launcher, the stock failure that each trainer's
in-process drill in ``tests/integrations`` pins (``test_dsd_hf_trainer``, ``test_lightning``,
``test_olmo_core``), and the resumed run's 22 states are something stock DSD never gives (it fails
or invents state). By default it runs in the OLMo-core drill only (`STOCK_LAUNCH_IN`); with
``SPARSE_CKPT_EXHAUSTIVE_SWEEPS=1``, which .ci/run sets, in every drill.
"""

from __future__ import annotations

import ast
import re
import socket
from pathlib import Path

import pytest
import torch
from _sampling import EXHAUSTIVE
from helpers import assert_deep_equal
from launcher_env import BIN, DRILLS, prefix, run

CI_ONLY = pytest.mark.skipif(
    not EXHAUSTIVE,
    reason="one launcher drill (torchrun + OLMo-core) runs by default; CI runs all three "
    "(SPARSE_CKPT_EXHAUSTIVE_SWEEPS=1, tests/_sampling.py)",
)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

PARAMS, STEPPED = 40, 22
STOCK_LAUNCH_IN = "drill_olmo_core.py"
"""The drill whose stock launch runs by default (see the module docstring)."""
UNROUTED = r"layers\.0\.experts\.4\.weight"
ROUTED_LINE = re.compile(
    r"^INFO sparse-ckpt-run \(rank (\d+), pid \d+\): routed torch DSD .* -> sparse_ckpt\.integrations\.dsd$"
)
HF_ARGS = [
    "--max_steps",
    "5",
    "--save_strategy",
    "steps",
    "--save_steps",
    "3",
    "--per_device_train_batch_size",
    "2",
    "--use_cpu",
    "--report_to",
    "none",
    "--seed",
    "0",
    "--remove_unused_columns",
    "False",
    "--disable_tqdm",
    "True",
    "--logging_strategy",
    "no",
    "--dataloader_num_workers",
    "0",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher(name: str, install: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed next to {BIN} ({install})")
    return str(path)


def _routing_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "sparse-ckpt-run" in line]


def drill(fresh: list[str], resume: list[str], reference: Path, resumed: Path, stock_error: str) -> dict:
    """The three launches of the module docstring (the stock one where `STOCK_LAUNCH_IN` or
    `_sampling.EXHAUSTIVE` says); the resumed run's record."""
    first = run([*prefix(), *fresh])
    assert first.returncode == 0, first.stdout[-4000:]
    lines = _routing_lines(first.stdout)
    assert sorted(m.group(1) for m in map(ROUTED_LINE.match, lines) if m) == ["0", "1"] and len(lines) == 2, lines
    if EXHAUSTIVE or STOCK_LAUNCH_IN in {Path(arg).name for arg in resume}:
        stock = run(resume)
        assert stock.returncode != 0, "the stock launcher resumed: the drill no longer shows the failure"
        assert re.search(stock_error, stock.stdout), stock.stdout[-4000:]
        assert not _routing_lines(stock.stdout)
    again = run([*prefix(), *resume])
    assert again.returncode == 0, again.stdout[-4000:]
    lines = _routing_lines(again.stdout)
    assert sorted(m.group(1) for m in map(ROUTED_LINE.match, lines) if m) == ["0", "1"] and len(lines) == 2, lines
    want, got = torch.load(reference, weights_only=False), torch.load(resumed, weights_only=False)
    assert want["with_state"] == got["with_state"] == STEPPED and len(got["params"]) == PARAMS
    assert got["lrs"] == got["scheduler_lrs"] == want["lrs"]
    assert_deep_equal(got, want, "resumed with the prefix vs uninterrupted", nan_equal="none")
    return got


def test_drill_scripts_have_no_sparse_ckpt_line() -> None:
    """The training scripts import nothing of sparse_ckpt and call no ``install``: the prefix alone reaches them."""
    scripts = sorted(DRILLS.glob("*.py"))
    assert len(scripts) == 4
    assert STOCK_LAUNCH_IN in {script.name for script in scripts}  # the default run's stock launch exists
    for script in scripts:
        tree = ast.parse(script.read_text(encoding="utf-8"))
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert imported and not [m for m in imported if m.startswith("sparse_ckpt")], (script.name, imported)
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
        }
        assert "install" not in names and "sparse_ckpt" not in names, script.name


@pytest.mark.slow
@CI_ONLY
def test_accelerate_launch_hf_trainer(tmp_path: Path) -> None:
    """``sparse-ckpt-run accelerate launch train.py --save_steps 3 ...``: Trainer's own save and
    ``--resume_from_checkpoint`` resume exactly; stock ``accelerate launch`` cannot resume."""
    pytest.importorskip(
        "transformers",
        reason="transformers is not installed (pip install --no-deps -r "
        ".ci/requirements-veomni.txt: transformers 5.9.0 and its imports)",
    )
    accelerate = _launcher("accelerate", "pip install --no-deps -r .ci/requirements-accelerate.txt")

    def command(name: str, *more: str) -> list[str]:
        return [
            accelerate,
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(_free_port()),
            str(DRILLS / "drill_hf_trainer.py"),
            "--output_dir",
            str(tmp_path / name),
            *HF_ARGS,
            *more,
        ]

    fresh = command("fresh")
    resume = command("resumed", "--resume_from_checkpoint", str(tmp_path / "fresh" / "checkpoint-3"))
    drill(
        fresh,
        resume,
        tmp_path / "fresh" / "outcome.pt",
        tmp_path / "resumed" / "outcome.pt",
        rf"Missing key in checkpoint state_dict: optimizer\.state\.{UNROUTED}\.step",
    )


def _torchrun_drill(tmp_path: Path, script: str, stock_error: str) -> None:
    torchrun = _launcher("torchrun", "it comes with torch")

    def command(out: str, *more: str) -> list[str]:
        return [
            torchrun,
            "--standalone",
            "--nproc-per-node",
            "2",
            str(DRILLS / script),
            str(tmp_path / "ckpt"),
            str(tmp_path / out),
            *more,
        ]

    drill(
        command("fresh.pt"),
        command("resumed.pt", "--resume"),
        tmp_path / "fresh.pt",
        tmp_path / "resumed.pt",
        stock_error,
    )


@pytest.mark.slow
@CI_ONLY
def test_torchrun_lightning_fabric(tmp_path: Path) -> None:
    """``sparse-ckpt-run torchrun fabric_train.py``: ``fabric.save``/``fabric.load`` (DCP) resume exactly."""
    pytest.importorskip(
        "lightning", reason="lightning is not installed (pip install --no-deps -r .ci/requirements-lightning.txt)"
    )
    _torchrun_drill(
        tmp_path, "drill_fabric.py", rf"Missing key in checkpoint state_dict: optimizer\.state\.{UNROUTED}\.step"
    )


@pytest.mark.slow
def test_torchrun_olmo_core(tmp_path: Path) -> None:
    """``sparse-ckpt-run torchrun olmo_train.py``: OLMo-core's flat save/load resume exactly."""
    pytest.importorskip(
        "olmo_core", reason="ai2-olmo-core is not installed (pip install --no-deps -r .ci/requirements-olmo-core.txt)"
    )
    _torchrun_drill(
        tmp_path, "drill_olmo_core.py", rf"Missing key in checkpoint state_dict: optim\.state\.{UNROUTED}\.step"
    )
