"""``sparse-ckpt-run``'s start-up: the hook every Python process of the command runs, the selection of
integrations, the CLI, and what a process does when an integration's install fails.

Cheap: the processes started here import neither torch nor sparse_ckpt, except the one that checks
a real activation (torch DSD imported under the prefix) and ``--check``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from launcher_env import child_env, run

from sparse_ckpt.errors import LauncherError, SparseCheckpointError
from sparse_ckpt.launcher import activate as activation
from sparse_ckpt.launcher import cli
from sparse_ckpt.launcher._sitecustomize import _sparse_ckpt_run as hook

PROBE = (
    "import json, sys; print(json.dumps({'torch': 'torch' in sys.modules, 'sparse_ckpt': 'sparse_ckpt' in sys.modules, "
    "'hook': type(sys.meta_path[0]).__name__, 'site': getattr(sys.modules.get('sitecustomize'), '__file__', None)}))"
)


def probe(env: dict[str, str], code: str = PROBE, cwd: Path | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False, cwd=cwd
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_process_that_never_imports_torch_imports_neither_torch_nor_sparse_ckpt() -> None:
    """Under the prefix's environment the hook is in place (first on ``sys.meta_path``), and a process
    that imports nothing of torch has imported neither torch nor sparse_ckpt at its end."""
    got = probe(cli.environment(child_env()))
    assert got == {
        "torch": False,
        "sparse_ckpt": False,
        "hook": "_Hook",
        "site": str(Path(cli.SITE_DIR, "sitecustomize.py")),
    }


def test_an_existing_sitecustomize_keeps_running(tmp_path: Path) -> None:
    """A ``sitecustomize`` further down ``PYTHONPATH`` still runs (it becomes ``sys.modules["sitecustomize"]``),
    with the hook in place, also with ``SPARSE_CKPT_RUN=0``; one that raises is reported by ``site``
    as without the prefix, and the hook stays in place."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = '1'\n")
    code = PROBE.replace("}))", ", 'ran': __import__('os').environ.get('USER_SITECUSTOMIZE_RAN')}))")
    env = cli.environment(child_env({"PYTHONPATH": str(mine)}))
    assert probe(env, code) == {
        "torch": False,
        "sparse_ckpt": False,
        "hook": "_Hook",
        "site": str(mine / "sitecustomize.py"),
        "ran": "1",
    }
    off = probe({**env, "SPARSE_CKPT_RUN": "0"}, code)
    assert off["ran"] == "1" and off["hook"] != "_Hook"
    (mine / "sitecustomize.py").write_text("raise ValueError('broken site')\n")
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0 and "Error in sitecustomize" in proc.stderr and "broken site" in proc.stderr
    assert json.loads(proc.stdout)["hook"] == "_Hook"
    assert not (Path(cli.SITE_DIR) / "usercustomize.py").exists()  # usercustomize is never shadowed


def test_spawn_children_and_subprocesses_run_the_hook(tmp_path: Path) -> None:
    """A ``multiprocessing`` spawn child and a ``subprocess`` of a process started with the prefix's
    environment both start with the hook."""
    code = textwrap.dedent(
        """
        import json, multiprocessing as mp, subprocess, sys

        def child(q):
            q.put(type(sys.meta_path[0]).__name__)

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start()
            spawned = q.get(timeout=60)
            p.join()
            sub = subprocess.run([sys.executable, "-c", "import sys; print(type(sys.meta_path[0]).__name__)"],
                                 capture_output=True, text=True).stdout.strip()
            print(json.dumps([spawned, sub]))
        """
    )
    script = tmp_path / "spawner.py"
    script.write_text(code)
    proc = run([sys.executable, str(script)], env=cli.environment(child_env()), timeout=300)
    assert proc.returncode == 0, proc.stdout
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["_Hook", "_Hook"]


@pytest.mark.parametrize(
    ("value", "selected", "problem"),
    [
        ("auto", ["dsd", "torchtune", "veomni"], None),
        ("", [], None),
        ("none", [], None),
        ("auto,-veomni,-torchtune", ["dsd"], None),
        ("accelerate", ["accelerate"], None),
        ("-dsd,auto", ["dsd", "torchtune", "veomni"], None),
        ("auto,accelerate", ["dsd", "torchtune", "veomni"], "'dsd' and 'accelerate' conflict"),
        ("dsd,bogus", ["dsd"], "unknown integration 'bogus'"),
    ],
)
def test_selection(value: str, selected: list[str], problem: str | None) -> None:
    """``SPARSE_CKPT_INTEGRATIONS``: ``auto`` is every default integration, ``-name`` removes, ``none``
    clears; conflicting (accelerate and dsd) or unknown names are problems, never both activated."""
    got, problems = hook.selection(value)
    assert got == selected
    assert (problem is None and not problems) or (problem is not None and len(problems) == 1 and problem in problems[0])


def test_safe_load_option_selects_safe_load_whatever_the_list_says() -> None:
    """``--safe-load`` sets ``SPARSE_CKPT_SAFE_LOAD=1``, which selects ``safe_load`` (opt-in, never in ``auto``)
    with any ``SPARSE_CKPT_INTEGRATIONS``, ``none`` included; ``--check`` shows it."""
    env = cli.environment(child_env(), integrations="none", safe_load=True)
    assert env["SPARSE_CKPT_SAFE_LOAD"] == "1" and "SPARSE_CKPT_SAFE_LOAD" not in cli.environment(child_env())
    assert hook.selection("none", env) == (["safe_load"], [])
    assert hook.selection("auto", env)[0] == ["dsd", "torchtune", "veomni", "safe_load"]
    assert "safe_load" not in hook.selection("auto", {})[0]
    assert any(line.strip().startswith("safe_load  when torch.distributed.checkpoint") for line in cli.plan(env))


def test_cli_refuses_conflicts_and_missing_commands(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI refuses a conflicting selection (exit 2) and a command it cannot find (127) before running anything."""
    assert cli.main(["--integrations", "dsd,accelerate", "true"]) == cli.EXIT_USAGE
    assert "conflict" in capsys.readouterr().err
    assert cli.main(["no-such-command-sparse-ckpt"]) == cli.EXIT_NOT_FOUND
    assert "command not found" in capsys.readouterr().err


def test_environment_keeps_the_users_pythonpath() -> None:
    """The hook's folder leads ``PYTHONPATH``; what was there follows unchanged; options become variables."""
    env = cli.environment({"PYTHONPATH": "/a::/b"}, integrations="dsd", strict=True, log="logging")
    assert env["PYTHONPATH"] == f"{cli.SITE_DIR}{os.pathsep}/a::/b"
    assert (env["SPARSE_CKPT_INTEGRATIONS"], env["SPARSE_CKPT_RUN_STRICT"], env["SPARSE_CKPT_RUN_LOG"]) == (
        "dsd",
        "1",
        "logging",
    )
    assert cli.environment({})["PYTHONPATH"] == cli.SITE_DIR


def test_the_hook_activates_once_after_the_outermost_trigger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer package that imports DSD while it initialises is activated together with DSD, once,
    after the package finished importing; then the finder leaves ``sys.meta_path``; the modules keep
    their own loaders."""
    (tmp_path / "fake_dsd.py").write_text("VALUE = 1\n")
    (tmp_path / "fake_trainer.py").write_text("import fake_dsd\nimport fake_dsd as again\nREADY = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    table = {
        "one": hook.Integration("one", ("fake_dsd",), "m1", "r1"),
        "two": hook.Integration("two", ("fake_trainer",), "m2", "r2"),
    }
    monkeypatch.setattr(hook, "INTEGRATIONS", table)
    calls = []

    def fake_activate(names: list[str], problems: list[str]) -> list[dict]:
        calls.append((names, "fake_trainer" in sys.modules and getattr(sys.modules["fake_trainer"], "READY", False)))
        return [{"integration": n, "status": "routed", "detail": ""} for n in names]

    monkeypatch.setattr(hook, "_activate", fake_activate)
    finder = hook._Hook(["one", "two"], [])
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    for name in ("fake_dsd", "fake_trainer"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.import_module("fake_trainer")
    assert calls == [(["one", "two"], True)]
    assert finder not in sys.meta_path and [o["integration"] for o in finder.outcomes] == ["one", "two"]
    assert type(sys.modules["fake_dsd"].__loader__).__name__ == "SourceFileLoader"


def test_a_refused_install_runs_stock_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``install()`` raising ``RuntimeError`` (a torch whose internals it refuses): the process goes on
    stock with one WARNING line naming the integration and the way to make it an error; with strict,
    `LauncherError` (a SparseCheckpointError) instead. An integration module this sparse_ckpt lacks is
    skipped as ``absent``, without a warning."""
    import sparse_ckpt.integrations.dsd as sc_dsd

    def refuse() -> None:
        raise RuntimeError("this torch differs")

    monkeypatch.setattr(sc_dsd, "install", refuse)
    monkeypatch.setattr(activation.logger, "propagate", False)  # no handler (pytest's capture is on the root)
    monkeypatch.setitem(
        hook.INTEGRATIONS, "ghost", hook.Integration("ghost", ("ghost",), "sparse_ckpt.integrations.ghost_trainer", "r")
    )
    monkeypatch.setattr(activation, "INTEGRATIONS", hook.INTEGRATIONS)
    out = activation.activate(["dsd", "ghost"])
    assert [(o["integration"], o["status"]) for o in out] == [("dsd", "refused"), ("ghost", "absent")]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("WARNING sparse-ckpt-run") and "runs STOCK for dsd" in err[0]
    assert "this torch differs" in err[0] and "SPARSE_CKPT_RUN_STRICT=1" in err[0]
    with pytest.raises(LauncherError, match="this torch differs") as info:
        activation.activate(["dsd"], strict=True)
    assert isinstance(info.value, SparseCheckpointError)
    assert not sc_dsd.installed()


def test_routed_line_goes_through_logging_when_configured(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a handler showing INFO, the routing line is an INFO record of ``sparse_ckpt.launcher`` and
    nothing is written to stderr directly; without one, it is written to stderr (never lost)."""
    import sparse_ckpt.integrations.dsd as sc_dsd

    monkeypatch.setattr(sc_dsd, "install", lambda: None)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("sparse_ckpt.launcher")
    monkeypatch.setattr(logger, "level", logging.INFO)
    handler = Keep()
    logger.addHandler(handler)
    try:
        activation.activate(["dsd"])
    finally:
        logger.removeHandler(handler)
    assert [(r.levelno, r.name) for r in records] == [(logging.INFO, "sparse_ckpt.launcher")]
    assert "routed torch DSD" in records[0].getMessage() and capsys.readouterr().err == ""
    monkeypatch.setattr(logger, "propagate", False)  # no handler at all now (pytest's capture is on the root)
    activation.activate(["dsd"])
    assert capsys.readouterr().err.startswith("INFO sparse-ckpt-run")


@pytest.mark.slow  # two ranks through the launcher
def test_a_prefixed_process_routes_dsd_and_check_reports_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In the prefix's environment, importing torch DSD routes its functions through sparse_ckpt with one
    line on stderr (rank and pid); ``--check`` reports the same from a probe of the command's
    interpreter, without running the command, and exits 0."""
    code = (
        "from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict as f; import torch; "
        "import sparse_ckpt.integrations.dsd as d; m = torch.nn.Linear(2, 2); o = torch.optim.AdamW(m.parameters()); "
        "print(isinstance(f(m, o), d.DsdStateDict) and not o.state, d.installed())"
    )
    proc = run(
        [sys.executable, "-c", code], env=cli.environment(child_env({"RANK": "3"}), integrations="dsd"), timeout=300
    )
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "True True"
    said = [line for line in lines if "sparse-ckpt-run" in line]
    assert (
        len(said) == 1 and said[0].startswith("INFO sparse-ckpt-run (rank 3, pid ") and "routed torch DSD" in said[0]
    ), said
    monkeypatch.setattr(os, "environ", child_env())
    assert cli.main(["--check", "--integrations", "dsd", sys.executable, "-c", "raise SystemExit(3)"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "dsd        routed: torch DSD" in out and out.rstrip().endswith("result: ok"), out


def test_a_trainer_integration_module_is_picked_up_when_present(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The table maps a trainer's package to ``sparse_ckpt.integrations.<name>.install``: when that module
    exists (here a stand-in for torchtune's) its ``install()`` is called and the line names it; when it
    does not, the entry is skipped as ``absent`` and nothing is said about it."""
    import types

    calls = []
    module = types.ModuleType("sparse_ckpt.integrations.torchtune")
    module.install = lambda: calls.append("installed")  # type: ignore[attr-defined]
    monkeypatch.setattr(activation.logger, "propagate", False)
    monkeypatch.delitem(sys.modules, "sparse_ckpt.integrations.torchtune", raising=False)
    if importlib.util.find_spec("sparse_ckpt.integrations.torchtune") is None:
        assert activation.activate(["torchtune"])[0]["status"] == "absent" and capsys.readouterr().err == ""
    monkeypatch.setitem(sys.modules, "sparse_ckpt.integrations.torchtune", module)
    assert activation.activate(["torchtune"])[0]["status"] == "routed" and calls == ["installed"]
    assert "torchtune's optimizer checkpointing -> sparse_ckpt.integrations.torchtune" in capsys.readouterr().err
    assert hook.INTEGRATIONS["torchtune"].triggers == ("torchtune",) and hook.INTEGRATIONS["torchtune"].default
