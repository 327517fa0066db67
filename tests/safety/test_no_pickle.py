"""Security: sparse_ckpt never unpickles or executes code from a checkpoint.

Static: no ``pickle``-family import (but the restricted ``.metadata`` unpickler's, which resolves only
DCP's metadata classes), no ``torch.load`` (unless ``weights_only=True`` is passed literally), no
``eval``/``exec``/``compile`` call and no ``__reduce__`` in ``sparse_ckpt/*.py``;
no pickle/eval/exec/``__reduce__`` in ``csrc/`` (comments stripped). Dynamic: with every
unpickling/evaluating entry point patched to fail, packed tables decode and packed and flat dicts
load; a pickle payload stored as a packed table is rejected without being executed.
"""

from __future__ import annotations

import ast
import io
import pickle
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import _backends
import pytest
import torch
from helpers import deep_equal, table_bytes
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt import _backend
from sparse_ckpt._format.tensor_parts import parts_to_tensor
from sparse_ckpt._save.save import packed_table_key

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "sparse_ckpt"
CSRC = REPO / "csrc"

UNPICKLING_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib", "copyreg"}
EVALUATING_BUILTINS = {"eval", "exec", "compile", "__import__"}
REDUCE_NAMES = {"__reduce__", "__reduce_ex__"}


def _is_torch_load(func: ast.expr) -> bool:
    """``torch.load`` / ``torch.serialization.load`` / ``serialization.load``."""
    if not isinstance(func, ast.Attribute) or func.attr != "load":
        return False
    base = func.value
    if isinstance(base, ast.Name):
        return base.id in {"torch", "serialization"}
    return isinstance(base, ast.Attribute) and base.attr == "serialization"


def python_findings(path: Path) -> list[str]:
    """Every unpickling/evaluating construct in one Python file, as ``file:line: what``."""
    return python_findings_text(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))


# Objects of ours that customise how *they* are pickled (the save side): reducing to a plain
# ``dict`` or refusing outright. Nothing here is called when a checkpoint is read.
ALLOWED_SCOPES = {
    ("sparse_ckpt/_dcp/origin.py", "OriginDict.__reduce_ex__"),  # pickles as a plain OrderedDict (+ origin)
    ("sparse_ckpt/_dcp/origin.py", "OriginDict.__reduce__"),
    ("sparse_ckpt/_dcp/stateful.py", "_PlannerGuard.__reduce_ex__"),  # pickles as a plain uint8 tensor
    ("sparse_ckpt/_dcp/stateful.py", "SparseOptimizerState.__reduce_ex__"),
    ("sparse_ckpt/_dcp/stateful.py", "SparseOptimizerState.__deepcopy__"),
    ("sparse_ckpt/integrations/dsd/target.py", "DsdStateDict.__reduce_ex__"),  # pickles as a plain OrderedDict
    # the restricted .metadata unpickler: its find_class resolves only DCP's metadata classes and refuses any
    # other global before it is called (tests/safety/test_untrusted_metadata.py)
    ("sparse_ckpt/_dcp/safe_reader.py", ""),  # import pickle
    ("sparse_ckpt/_dcp/safe_reader.py", "MetadataUnpickler"),  # class MetadataUnpickler(pickle.Unpickler)
    # compiles a trampoline from a live function's parameter names and a module name of the package
    # (identifiers, checked): install()'s routing of torch DSD's functions, no checkpoint data
    ("sparse_ckpt/integrations/_rebind.py", "route_code"),
}


class _Scanner(ast.NodeVisitor):
    """Collects unsafe constructs with the qualified name of the enclosing scope."""

    def __init__(self, rel: str) -> None:
        self.rel = rel
        self.scope: list[str] = []
        self.found: list[str] = []

    def flag(self, node: ast.AST, what: str, scope: str | None = None) -> None:
        qual = scope if scope is not None else ".".join(self.scope)
        if (self.rel, qual) not in ALLOWED_SCOPES:
            self.found.append(f"{self.rel}:{getattr(node, 'lineno', 0)} ({qual or '<module>'}): {what}")

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        if not isinstance(node, ast.ClassDef) and node.name in REDUCE_NAMES:
            self.flag(node, f"defines {node.name}")
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] in UNPICKLING_MODULES:
                self.flag(node, f"import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if module.split(".")[0] in UNPICKLING_MODULES:
            self.flag(node, f"from {module} import ...")
        for alias in node.names:
            if alias.name in {"load", "_load"} and module.startswith("torch"):
                self.flag(node, f"from {module} import {alias.name}")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in EVALUATING_BUILTINS:
            self.flag(node, f"call to {func.id}()")
        if _is_torch_load(func) and not any(
            kw.arg == "weights_only" and isinstance(kw.value, ast.Constant) and kw.value.value is True
            for kw in node.keywords
        ):
            self.flag(node, "torch.load without weights_only=True")
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name in {"getattr", "import_module", "__import__"} and any(
            isinstance(a, ast.Constant) and a.value in UNPICKLING_MODULES | REDUCE_NAMES for a in node.args
        ):
            self.flag(node, f"dynamic access: {ast.unparse(node)[:60]}")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in REDUCE_NAMES or (
            node.attr in {"loads", "load", "Unpickler"}
            and isinstance(node.value, ast.Name)
            and node.value.id in UNPICKLING_MODULES
        ):
            self.flag(node, f"uses .{node.attr}")
        self.generic_visit(node)


def python_findings_text(source: str, rel: str = "<probe>") -> list[str]:
    """Every unpickling/evaluating construct in Python ``source``, as ``file:line (scope): what``."""
    scanner = _Scanner(rel)
    scanner.visit(ast.parse(source, filename=rel))
    return scanner.found


_CPP_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_CPP_PATTERNS = re.compile(
    r"pickle|torch\.load|\btorch\s*::\s*load\b|(?<![\w.])eval\s*\(|(?<![\w.])exec\s*\(|py::eval|py::exec|__reduce__|marshal"
)


def cpp_findings(path: Path) -> list[str]:
    """Pickle/eval/exec/``__reduce__`` in one C++ file (comments stripped, strings kept)."""
    return cpp_findings_text(path.read_text(encoding="utf-8", errors="replace"), str(path.relative_to(REPO)))


def cpp_findings_text(text: str, rel: str = "<probe>") -> list[str]:
    """Pickle/eval/exec/``__reduce__`` in C++ source ``text``."""
    code = _CPP_COMMENTS.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    found = []
    for lineno, line in enumerate(code.splitlines(), 1):
        for match in _CPP_PATTERNS.finditer(line):
            found.append(f"{rel}:{lineno}: {match.group(0)!r} in {line.strip()[:80]!r}")
    return found


@_backends.only(_backends.DEFAULT)  # a scan of the sources: no core runs
def test_static_python_sources() -> None:
    """No unpickling or code evaluation anywhere in the package."""
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) >= 10
    findings = [f for path in files for f in python_findings(path)]
    assert not findings, "unsafe constructs:\n" + "\n".join(findings)


@_backends.only(_backends.DEFAULT)  # a scan of the sources: no core runs
def test_static_cpp_sources() -> None:
    """No pickle/eval/exec in the C++ core."""
    files = (
        sorted(p for p in CSRC.rglob("*") if p.suffix in {".cpp", ".cc", ".cxx", ".h", ".hpp"}) if CSRC.exists() else []
    )
    if not files:
        pytest.skip("csrc/ has no C++ sources yet")
    findings = [f for path in files for f in cpp_findings(path)]
    assert not findings, "unsafe constructs:\n" + "\n".join(findings)


@_backends.only(_backends.DEFAULT)  # a scan of the sources: no core runs
def test_static_checks_can_fail() -> None:
    """The scanners flag each construct (so an empty result means something)."""
    probes = {
        "import pickle": "import pickle",
        "import marshal as m": "import marshal",
        "from pickle import loads": "from pickle import ...",
        "from torch import load": "from torch import load",
        "x = torch.load(f)": "torch.load without weights_only=True",
        "x = torch.load(f, weights_only=False)": "torch.load without weights_only=True",
        "x = torch.serialization.load(f)": "torch.load without weights_only=True",
        "x = eval('1')": "call to eval()",
        "exec('x=1')": "call to exec()",
        "def __reduce__(self): pass": "defines __reduce__",
        "m = import_module('pickle')": "dynamic access",
        "m = importlib.import_module('pickle')": "dynamic access",
        "class A:\n    def __reduce__(self): pass": "(A.__reduce__): defines __reduce__",
        "x = obj.__reduce_ex__(2)": "uses .__reduce_ex__",
    }
    for source, expected in probes.items():
        found = python_findings_text(source + "\n")
        assert any(expected in f for f in found), (source, found)
    assert not python_findings_text("x = torch.load(f, weights_only=True)\n")
    assert not python_findings_text('"""we never use pickle"""\nmodel.eval()\n# eval(x)\n')
    assert cpp_findings_text('auto m = py::module_::import("pickle");')
    assert cpp_findings_text("py::exec(code);")
    assert cpp_findings_text('obj.attr("__reduce__")();')
    assert not cpp_findings_text("// no pickle here\n/* eval( */ int x = 1;")


# --------------------------------------------------------------------------- dynamic


class Forbidden(AssertionError):
    """Raised by every patched unpickling/evaluating entry point."""


# Code evaluation is watched with an audit hook (``exec``/``compile`` events, and
# ``pickle.find_class``, which every unpickler raises when it resolves a global) rather than by
# patching ``builtins.exec``: the import system itself calls ``exec``. The hook is installed once
# and is inert unless a test arms it.
_AUDITED = frozenset({"exec", "compile", "pickle.find_class", "marshal.loads", "marshal.load"})
_ARMED: list[list[str]] = []
_HOOK: list[bool] = []


def _audit(event: str, _args: tuple[Any, ...]) -> None:
    if _ARMED and event in _AUDITED:
        _ARMED[-1].append(event)
        raise Forbidden(f"audit event {event!r} while handling a checkpoint")


@contextmanager
def armed(calls: list[str]) -> Iterator[None]:
    """Within the block, unpickling and code evaluation are refused and logged in ``calls``.

    ``pickle``/``_pickle`` ``load``/``loads`` and ``torch.load`` are patched to raise; ``exec``,
    ``compile`` and ``pickle.find_class`` are audited. Do the work once unarmed first, so that
    lazy imports happen outside the block (a module imported inside it could capture a patched
    function, or subclass one).
    """
    import _pickle

    if not _HOOK:
        sys.addaudithook(_audit)
        _HOOK.append(True)

    def forbid(name: str) -> Any:
        def refuse(*_args: Any, **_kwargs: Any) -> Any:
            calls.append(name)
            raise Forbidden(f"{name} called while handling a checkpoint")

        return refuse

    with pytest.MonkeyPatch.context() as mp:
        for mod, attr in [
            (pickle, "loads"),
            (pickle, "load"),
            (_pickle, "loads"),
            (_pickle, "load"),
            (torch, "load"),
            (torch.serialization, "load"),
        ]:
            mp.setattr(mod, attr, forbid(f"{mod.__name__}.{attr}"))
        _ARMED.append(calls)
        try:
            yield
        finally:
            _ARMED.pop()


_TRIGGERED: list[str] = []


def _trigger(message: str) -> None:
    """What the payload runs when unpickled (stands in for ``os.system``)."""
    _TRIGGERED.append(message)


class _Payload:
    """An object whose unpickling would run code."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_trigger, ("code ran",))


def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.Adam(
        [
            {"params": model[0].parameters(), "lr": torch.tensor(0.01), "tag": ("a", b"b", [1.5, None])},
            {"params": model[1].parameters()},
        ],
        lr=0.02,
        foreach=False,
    )
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return model, opt


def test_patches_are_effective() -> None:
    """The patches and the audit hook really refuse (the tests below are not vacuous)."""
    import _pickle

    _TRIGGERED.clear()
    buf = io.BytesIO()
    torch.save({"x": 1}, buf)
    payload = pickle.dumps(_Payload())
    calls: list[str] = []
    with armed(calls):
        with pytest.raises(Forbidden):
            torch.load(io.BytesIO(buf.getvalue()))
        with pytest.raises(Forbidden):
            pickle.loads(payload)
        with pytest.raises(Forbidden):
            _pickle.loads(payload)
        with pytest.raises(Forbidden):
            eval("1 + 1")
        with pytest.raises(Forbidden):
            pickle.Unpickler(io.BytesIO(payload)).load()  # not patched: the find_class audit catches it
    assert calls == ["torch.load", "pickle.loads", "_pickle.loads", "compile", "pickle.find_class"], calls
    assert _TRIGGERED == []


def _round_trip(fmt: str) -> tuple[torch.optim.Optimizer, list[bytes]]:
    model, opt = _model_and_optimizer(0)
    target_model, target = _model_and_optimizer(1)
    target_model.load_state_dict(model.state_dict())
    sd = sc.sparse_state_dict(model, opt, format=fmt)
    tables = [table_bytes(sd, k) for k in sd if k.startswith("param_groups.__packed__.")]
    for table in tables:
        _settings, _blobs, groups = _backend.core.decode_table("optim", table, parts_to_tensor)
        assert len(groups) == 2
    sc.load_sparse_state_dict(target_model, target, sd)
    return target, tables


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_save_decode_and_load_never_unpickle(fmt: str) -> None:
    """Round trip with every unpickler patched to fail and code evaluation audited: nothing runs."""
    _round_trip(fmt)  # warm-up: lazy imports happen here, unarmed
    events: list[str] = []
    with armed(events):
        target, tables = _round_trip(fmt)
    assert events == []
    assert bool(tables) == (fmt == "packed")
    assert torch.equal(target.param_groups[0]["lr"], torch.tensor(0.01))
    assert target.param_groups[0]["tag"] == ("a", b"b", [1.5, None])


def test_pickle_payload_as_table_is_not_executed() -> None:
    """A pickle (and a torch.save zip) stored under a packed key is refused as a format error, unexecuted."""
    _TRIGGERED.clear()
    model, opt = _model_and_optimizer(2)
    payloads = [pickle.dumps(_Payload())]
    buf = io.BytesIO()
    torch.save(_Payload(), buf)
    payloads.append(buf.getvalue())
    for payload in payloads:
        sd = {packed_table_key("optim", payload): payload}
        with pytest.raises(sc.CheckpointFormatError, match="magic"):
            sc.load_sparse_state_dict(model, opt, sd)
        with pytest.raises(sc.CheckpointFormatError):
            _backend.core.decode_table("optim", payload, parts_to_tensor)
    assert _TRIGGERED == []
    pickle.loads(payloads[0])  # proves the payload is live
    assert _TRIGGERED == ["code ran"]
    _TRIGGERED.clear()


def test_dcp_packed_item_holding_a_pickle_is_not_executed(tmp_path: Path) -> None:
    """Through DCP: a packed-table item replaced by a code-running object is refused by
    ``SparseLoadPlanner`` (``weights_only=True``) instead of being unpickled by DCP's default
    ``load_bytes`` (``weights_only=False``)."""
    import torch.distributed.checkpoint as dcp

    if not hasattr(sc, "SparseLoadPlanner"):
        pytest.skip("sparse_ckpt.SparseLoadPlanner not available")
    _TRIGGERED.clear()
    model, opt = _model_and_optimizer(3)
    good = dict(sc.SparseOptimizerState(model, opt).state_dict())
    dcp.save({"optim": good}, checkpoint_id=str(tmp_path / "good"), no_dist=True)
    tampered = {k: (_Payload() if k.startswith("param_groups.__packed__.") else v) for k, v in good.items()}
    dcp.save({"optim": tampered}, checkpoint_id=str(tmp_path / "bad"), no_dist=True)

    target_model, target = _model_and_optimizer(4)
    target_model.load_state_dict(model.state_dict())
    state = sc.SparseOptimizerState(target_model, target)
    dcp.load({"optim": state}, checkpoint_id=str(tmp_path / "good"), planner=sc.SparseLoadPlanner(), no_dist=True)
    assert torch.equal(target.param_groups[0]["lr"], torch.tensor(0.01))  # the safe path loads real tables

    victim_model, victim = _model_and_optimizer(5)
    before = victim.state_dict()
    with pytest.raises((sc.CheckpointFormatError, dcp.CheckpointException)) as info:  # DCP wraps rank errors
        dcp.load(
            {"optim": sc.SparseOptimizerState(victim_model, victim)},
            checkpoint_id=str(tmp_path / "bad"),
            planner=sc.SparseLoadPlanner(),
            no_dist=True,
        )
    assert "packed group table" in str(info.value), info.value
    assert _TRIGGERED == []
    assert deep_equal(victim.state_dict(), before, check_order=False, nan_equal="none", mapping=dict)
