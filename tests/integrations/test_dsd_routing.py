"""``integrations.dsd.install()`` reaches every binding of torch DSD's functions.

``install()`` routes torch's own function objects (their code becomes a trampoline into
sparse_ckpt), so a caller reaches sparse_ckpt however it bound DSD's functions, also where a module
global is not what holds them: a function local (a Ray Train function imports DSD at its top, then
calls ``install()``), a closure, a ``functools.partial``, a default argument, an object unpickled with
pickle or cloudpickle, a spawned multiprocessing child. Each binding below is made *before*
``install()`` (the function-local one by the repro's order: import, ``install()``, call) and shows
sparse state: a fresh optimizer's dict holds no state and the optimizer stays without any (stock DSD's
synthetic step gives all 4 parameters state), and a checkpoint in which one expert never stepped
resumes exactly through the same binding (stock: ``Missing key ... expert1.weight.step``). After
``uninstall()`` the same binding runs stock DSD again.
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

import sparse_ckpt.integrations.dsd as sc_dsd
from sparse_ckpt.integrations.dsd import functions

pytestmark = [pytest.mark.usefixtures("forbid_fork"), pytest.mark.filterwarnings("ignore::UserWarning")]

Get = Callable[[nn.Module, torch.optim.Optimizer], Any]
Set = Callable[[nn.Module, torch.optim.Optimizer, Any], None]
PARAMS = 4
"""Parameters of `experts` (two experts' weight and bias); `trained` steps expert0's 2."""


def experts(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.ModuleDict({"expert0": nn.Linear(4, 4), "expert1": nn.Linear(4, 4)})
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt = experts()
    for _ in range(2):
        model["expert0"](torch.randn(2, 4)).sum().backward()  # expert1 gets no tokens
        opt.step()
        opt.zero_grad()
    return model, opt


def sparse_round_trip(get: Get, put: Set, path: str) -> dict[str, Any]:
    """What a binding does: a fresh optimizer's dict, then a checkpoint of a trained one resumed into a
    fresh one (the trainer's sequence: target from ``get``, ``dcp.load``, ``put``)."""
    model, opt = experts(1)
    fresh = get(model, opt)
    facts: dict[str, Any] = {"fresh_dict_state": len(fresh["state"]), "fresh_optimizer_state": len(opt.state)}
    model, opt = trained()
    want = opt.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optim": get(model, opt)}, checkpoint_id=path)
        model2, opt2 = experts(1)
        target = {"optim": get(model2, opt2)}
        try:
            dcp.load(target, checkpoint_id=path)
        except (RuntimeError, dcp.api.CheckpointException) as exc:  # stock DSD: Missing key ... expert1.weight.step
            facts["resume"] = f"{type(exc).__name__}: {exc}"
            return facts
    put(model2, opt2, target["optim"])
    got = opt2.state_dict()
    exact = (
        got["param_groups"] == want["param_groups"]
        and got["state"].keys() == want["state"].keys()
        and all(torch.equal(got["state"][i][k], v) for i, s in want["state"].items() for k, v in s.items())
    )
    facts["resume"] = "exact" if exact else "differs"
    facts["resumed_state"] = len(opt2.state)
    return facts


SPARSE = {"fresh_dict_state": 0, "fresh_optimizer_state": 0, "resume": "exact", "resumed_state": 2}


def assert_stock(facts: dict[str, Any]) -> None:
    assert facts["fresh_optimizer_state"] == PARAMS, facts  # DSD's synthetic step
    assert "Missing key" in facts["resume"] and "expert1" in facts["resume"], facts


# --- bindings made at import, before any install() -------------------------------------------------


def _closure() -> tuple[Get, Set]:
    get, put = get_optimizer_state_dict, set_optimizer_state_dict

    def closed_get(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
        return get(model, opt)

    def closed_put(model: nn.Module, opt: torch.optim.Optimizer, sd: Any) -> None:
        put(model, opt, sd)

    return closed_get, closed_put


def _default_get(model: nn.Module, opt: torch.optim.Optimizer, fn: Any = get_optimizer_state_dict) -> Any:
    return fn(model, opt)


def _default_put(model: nn.Module, opt: torch.optim.Optimizer, sd: Any, fn: Any = set_optimizer_state_dict) -> None:
    fn(model, opt, sd)


@dataclass
class Checkpointer:
    """A trainer object holding DSD's functions as attributes (what gets pickled to a worker)."""

    get: Any = get_optimizer_state_dict
    put: Any = set_optimizer_state_dict


def _cloudpickled() -> tuple[Get, Set]:
    cloudpickle = pytest.importorskip("cloudpickle")
    # lambdas are pickled by value (as Ray ships a driver's train function), DSD's functions by reference
    get = cloudpickle.loads(cloudpickle.dumps(lambda model, opt: get_optimizer_state_dict(model, opt)))
    put = cloudpickle.loads(cloudpickle.dumps(lambda model, opt, sd: set_optimizer_state_dict(model, opt, sd)))
    return get, put


def _pickled() -> tuple[Get, Set]:
    holder = pickle.loads(pickle.dumps(Checkpointer()))
    return holder.get, holder.put


BINDINGS: dict[str, Callable[[], tuple[Get, Set]]] = {
    "module_global": lambda: (get_optimizer_state_dict, set_optimizer_state_dict),
    "closure": _closure,
    "partial": lambda: (functools.partial(get_optimizer_state_dict), functools.partial(set_optimizer_state_dict)),
    "default_arg": lambda: (_default_get, _default_put),
    "pickle": _pickled,
    "cloudpickle": _cloudpickled,
}


@pytest.fixture
def restore() -> Any:
    yield
    sc_dsd.uninstall()


@pytest.mark.parametrize("binding", sorted(BINDINGS))
def test_a_binding_made_before_install_is_routed_and_uninstall_restores_stock(
    binding: str, restore: Any, tmp_path: Path
) -> None:
    get, put = BINDINGS[binding]()  # bound before install()
    assert not sc_dsd.installed()
    sc_dsd.install()
    assert sc_dsd.installed()
    assert sparse_round_trip(get, put, str(tmp_path / "routed")) == SPARSE
    sc_dsd.uninstall()
    assert not sc_dsd.installed()
    assert_stock(sparse_round_trip(get, put, str(tmp_path / "stock")))


def test_function_local_imports_then_install_is_routed(restore: Any, tmp_path: Path) -> None:
    """The repro: inside a function, DSD's imports, then ``install()``, then the calls (a Ray Train function)."""

    def train_function(path: str) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        import sparse_ckpt.integrations.dsd as sc_dsd

        sc_dsd.install()
        return sparse_round_trip(get_optimizer_state_dict, set_optimizer_state_dict, path)

    assert train_function(str(tmp_path / "routed")) == SPARSE
    sc_dsd.uninstall()

    def stock_function(path: str) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        return sparse_round_trip(get_optimizer_state_dict, set_optimizer_state_dict, path)

    assert_stock(stock_function(str(tmp_path / "stock")))


def spawned_child(path: str) -> tuple[bool, dict[str, Any], dict[str, Any]]:
    """A spawned process's function (as a Ray worker or a multiprocessing child runs one): DSD's
    imports at its top, then ``install()``; then, after ``uninstall()``, the same names again."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    import sparse_ckpt.integrations.dsd as sc_dsd

    sc_dsd.install()
    routed = sparse_round_trip(get_optimizer_state_dict, set_optimizer_state_dict, str(Path(path) / "routed"))
    installed = sc_dsd.installed()
    sc_dsd.uninstall()
    return (
        installed,
        routed,
        sparse_round_trip(get_optimizer_state_dict, set_optimizer_state_dict, str(Path(path) / "stock")),
    )


def test_a_spawned_child_that_calls_install_is_routed(tmp_path: Path) -> None:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        installed, routed, stock = pool.apply(spawned_child, (str(tmp_path),))
    assert installed and routed == SPARSE
    assert_stock(stock)


def test_signature_and_code_are_torchs_again_after_uninstall(restore: Any) -> None:
    """Routed, torch's functions keep their identity, signature, defaults and doc; the trampoline names
    itself in a traceback; `functions.torch_dsd` runs torch's original code; uninstall puts back the
    very code objects torch had."""
    import torch.distributed.checkpoint.state_dict as dsd_module

    fns = {n: getattr(dsd_module, n) for n in functions.ROUTED}
    before = {n: (f.__code__, inspect.signature(f), f.__kwdefaults__, f.__doc__) for n, f in fns.items()}
    sc_dsd.install()
    for n, f in fns.items():
        code, sig, kwdefaults, doc = before[n]
        assert f.__code__ is not code and (inspect.signature(f), f.__kwdefaults__, f.__doc__) == (sig, kwdefaults, doc)
        assert f.__code__.co_filename == f"<sparse_ckpt route to sparse_ckpt.integrations.dsd.functions.{n}>"
        assert functions.torch_dsd[n].__code__ is code and inspect.signature(functions.torch_dsd[n]) == sig
    sc_dsd.uninstall()
    assert all(f.__code__ is before[n][0] for n, f in fns.items())


def test_install_refuses_loudly_where_torchs_function_cannot_be_routed(
    restore: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch whose DSD function is wrapped (here: a ``functools.wraps`` wrapper, which has a closure):
    ``install()`` raises naming it and patches nothing, so ``installed()`` never says True while stock runs."""
    from sparse_ckpt.integrations.dsd import patching

    torchs = patching._TORCH["get_optimizer_state_dict"]

    @functools.wraps(torchs)
    def wrapped(*args: Any, **kwargs: Any) -> Any:  # pragma: no cover - never called
        return torchs(*args, **kwargs)

    monkeypatch.setitem(patching._TORCH, "get_optimizer_state_dict", wrapped)
    with pytest.raises(
        RuntimeError, match=r"get_optimizer_state_dict has a closure.*cannot be routed.*Nothing was installed"
    ):
        sc_dsd.install()
    assert not sc_dsd.installed() and not any(patching.routed(f) for f in patching._TORCH.values())
