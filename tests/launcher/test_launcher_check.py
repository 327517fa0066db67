"""``sparse-ckpt-run --check`` tells the truth: it probes the command's interpreter with the command's own
interpreter options (``-I``, ``-E``, ``-S`` keep the hook out) and environment, says "not routed"
(exit 1) wherever the real run would route nothing, and a command that does not exist is an error
(exit 127, as the real run). Under ``--strict`` the messages say what ``--strict`` does.

Cheap: the probes import neither torch nor sparse_ckpt (no integration is selected, or the hook
never loads).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from launcher_env import child_env

from sparse_ckpt.launcher import cli
from sparse_ckpt.launcher._sitecustomize import _sparse_ckpt_run as hook


def check(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *command: str) -> tuple[int, str]:
    monkeypatch.setattr(os, "environ", child_env())
    status = cli.main(["--check", "--integrations", "none", *command])
    return status, capsys.readouterr().out


@pytest.mark.parametrize("option", ["-I", "-E", "-S", "-IB"])
def test_interpreter_options_that_keep_the_hook_out_are_not_routed(
    option: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    status, out = check(monkeypatch, capsys, sys.executable, option, str(script))
    assert status == cli.EXIT_CHECK_FAILED, out
    assert f"options {option}" in out and "the hook did not load" in out, out
    assert out.rstrip().endswith("result: not routed: this command's Python runs stock (the hook did not load)"), out


def test_options_that_leave_the_hook_in_are_routed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out = check(monkeypatch, capsys, sys.executable, "-X", "dev", "-W", "ignore", "-B", "-c", "pass")
    assert status == cli.EXIT_OK and "options -X dev -W ignore -B" in out and out.rstrip().endswith("result: ok"), out


def test_a_scripts_shebang_options_are_probed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train"
    script.write_text(f"#!{sys.executable} -I\nprint('trained')\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    status, out = check(monkeypatch, capsys, str(script))
    assert status == cli.EXIT_CHECK_FAILED and f"the #! line of {script}" in out and "options -I" in out, out
    assert "result: not routed" in out


def test_a_missing_command_is_an_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    status, out = check(monkeypatch, capsys, "no-such-command-sparse-ckpt", "--flag")
    assert status == cli.EXIT_NOT_FOUND, out
    assert (
        "no-such-command-sparse-ckpt: command not found" in out and "result: error" in out and "result: ok" not in out
    )


@pytest.mark.parametrize(
    ("args", "options"),
    [
        (["-I", "train.py", "-E"], ["-I"]),
        (["-X", "dev", "-Wd", "-c", "pass"], ["-X", "dev", "-Wd"]),
        (["-IBc", "pass"], ["-IB"]),
        (["-m", "torch.distributed.run", "-S"], []),
        (["--check-hash-based-pycs", "always", "train.py"], ["--check-hash-based-pycs", "always"]),
        (["-Xfrozen_modules=off", "-", "x"], ["-Xfrozen_modules=off"]),
        (["-u", "--", "train.py"], ["-u"]),
        (["train.py", "-I"], []),
    ],
)
def test_interpreter_options(args: list[str], options: list[str]) -> None:
    assert cli.interpreter_options(args) == options


def test_under_strict_an_unimportable_sparse_ckpt_stops_the_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --strict the process runs stock with a warning saying so; with it, the error says the
    process stops (not that it runs stock)."""
    monkeypatch.setitem(sys.modules, "sparse_ckpt.launcher.activate", None)  # "cannot be imported"
    monkeypatch.delenv("SPARSE_CKPT_RUN_STRICT", raising=False)
    [outcome] = hook._activate(["dsd"], [])
    assert outcome["status"] == "failed" and "this process runs stock, without dsd" in capsys.readouterr().err
    monkeypatch.setenv("SPARSE_CKPT_RUN_STRICT", "1")
    with pytest.raises(ImportError) as exc:
        hook._activate(["dsd"], [])
    message = str(exc.value)
    assert "SPARSE_CKPT_RUN_STRICT=1 (sparse-ckpt-run --strict): this process stops here" in message, message
    assert "runs stock" not in message


@pytest.mark.parametrize("args", [["--help"], ["--version"], [], ["--integrations", "nosuch", "true"], ["true"]])
def test_sparse_ckpt_run_starts_without_torch(args: list[str]) -> None:
    """--help, --version, a usage error and the launcher's own start (before the exec) import no torch."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('@@torch', 'torch' in sys.modules, file=sys.stderr))\n"
        f"sys.argv = ['sparse-ckpt-run', *{args!r}]\n"
        "from sparse_ckpt.launcher import cli\n"
        "cli.os.execvpe = lambda *a: sys.exit(0)  # stop where the command would start\n"
        "cli.console_main()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert "@@torch False" in proc.stderr, proc.stderr
    assert proc.returncode == (0 if args in (["--help"], ["--version"], ["true"]) else cli.EXIT_USAGE), proc.stderr
