"""Group setting values round-trip like torch's own ``state_dict()``/``load_state_dict()`` -- the
same type and value back -- or are refused at save, before anything is written, naming leaf,
group, key and type; never saved-then-unloadable, never a silent type change. The table codec
writes exact ``int``, ``float``, ``str``, ``bytes``, ``tuple`` and ``list`` values; a value of a
subclass of one of them (``numpy.float64``, an ``IntEnum`` or ``str`` ``Enum`` member, a
``namedtuple``, a user's subclass) would decode as the base type, so every format refuses it at
save (docs/formats.md, *Table codec*); an ``Enum`` member of no such base was refused already."""

from __future__ import annotations

import copy
import enum
from collections import namedtuple
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_deep_equal
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

import sparse_ckpt as sc
from sparse_ckpt.integrations import dsd

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Mode(enum.IntEnum):
    FAST = 1


class Kind(str, enum.Enum):
    ADAM = "adam"


class Color(enum.Enum):
    RED = 1


class MyFloat(float):
    pass


class MyInt(int):
    pass


class MyStr(str):
    pass


class MyTuple(tuple):
    pass


Betas = namedtuple("Betas", ["beta1", "beta2"])

VALUES: dict[str, tuple[str, Any, str]] = {  # case -> (setting key, value, type name in the message)
    "numpy.float64": ("lr", np.float64(0.01), "numpy.float64"),
    "IntEnum": ("mode", Mode.FAST, "Mode"),
    "str-Enum": ("kind", Kind.ADAM, "Kind"),
    "Enum": ("color", Color.RED, "Color"),
    "namedtuple": ("betas", Betas(0.9, 0.999), "Betas"),
    "float-subclass": ("lr", MyFloat(0.01), "MyFloat"),
    "int-subclass": ("period", MyInt(3), "MyInt"),
    "str-subclass": ("tag", MyStr("x"), "MyStr"),
    "tuple-subclass": ("betas", MyTuple((0.9, 0.999)), "MyTuple"),
    "nested in a tuple": ("betas", (0.9, np.float64(0.999)), "numpy.float64"),
}
SAVES = ("sparse_state_dict-packed", "sparse_state_dict-flat", "dcp-packed", "dcp-flat")
"""The library's own formats; `integrations.dsd` hands such values to torch's DSD instead (below)."""


def _save(how: str, model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    if how.startswith("sparse_state_dict-"):
        sc.sparse_state_dict(model, opt, format=how.split("-")[1])  # type: ignore[arg-type]
    elif how.startswith("dcp-"):
        dcp.save({"optim": sc.SparseOptimizerState(model, opt, format=how.split("-")[1])}, checkpoint_id=path)  # type: ignore[arg-type]
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", SAVES)
@pytest.mark.parametrize("case", list(VALUES))
def test_a_subclass_value_is_refused_at_save_before_anything_is_written(case: str, how: str, tmp_path: Path) -> None:
    key, value, type_name = VALUES[case]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.param_groups[0][key] = value
    before = copy.deepcopy(opt.state_dict())  # (the test helpers' snapshot cannot clone a namedtuple)
    path = tmp_path / "ckpt"
    with pytest.raises(sc.CheckpointFormatError, match=rf"leaf 'optim' group 0 key '{key}'.*{type_name}"):
        _save(how, model, opt, path)
    assert not path.exists() or not any(path.iterdir())  # nothing written
    assert_deep_equal(opt.state_dict(), before)
    assert type(opt.param_groups[0][key]) is type(value)


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_plain_values_come_back_with_their_type(fmt: str, tmp_path: Path) -> None:
    """The control: the exact types the codec writes load back as themselves, through DCP."""
    model = nn.Sequential(nn.Linear(2, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    opt.param_groups[0].update(period=3, tag="x", blob=b"\x00", sizes=[1, 2], flag=True, none=None)
    dcp.save({"optim": sc.SparseOptimizerState(model, opt, format=fmt)}, checkpoint_id=tmp_path)  # type: ignore[arg-type]
    opt2 = torch.optim.AdamW(model.parameters(), lr=0.5)
    dcp.load({"optim": sc.SparseOptimizerState(model, opt2, format=fmt)}, checkpoint_id=tmp_path,  # type: ignore[arg-type]
             planner=sc.SparseLoadPlanner())
    for k, v in opt.param_groups[0].items():
        if k != "params":
            assert type(opt2.param_groups[0][k]) is type(v) and opt2.param_groups[0][k] == v, k


@pytest.mark.parametrize("layout", ["flat", "nested"])
@pytest.mark.parametrize("case", list(VALUES))
def test_the_dsd_drop_in_hands_a_subclass_value_to_torch_dsd_as_stock_does(case: str, layout: str, tmp_path: Path) -> None:
    """A call that works with stock DSD keeps working: `integrations.dsd`'s get and set go to torch's
    DSD (one warning each) for an optimizer whose settings sparse_ckpt's formats cannot give back
    with their type, so the value round-trips through DCP with its type and value, as stock."""
    key, value, _type_name = VALUES[case]
    options = StateDictOptions(flatten_optimizer_state_dict=layout == "flat")

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, opt = build()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.param_groups[0][key] = value
    dsd.install()  # as a trainer runs it: its dcp.load plans the marked target from the checkpoint
    try:
        with pytest.warns(UserWarning, match="goes to torch's DSD"):
            dcp.save({"optim": dsd.get_optimizer_state_dict(model, opt, options=options)}, checkpoint_id=tmp_path)
        model2, opt2 = build()
        # a key AdamW does not have is set by the trainer's own code, again on resume (DSD's flat
        # layout loads only the keys the target's groups have, stock as here)
        opt2.param_groups[0].setdefault(key, value)
        target = {"optim": dsd.get_optimizer_state_dict(model2, opt2, options=options)}
        dcp.load(target, checkpoint_id=tmp_path)
        with pytest.warns(UserWarning, match="goes to torch's DSD"):
            dsd.set_optimizer_state_dict(model2, opt2, target["optim"], options=options)
    finally:
        dsd.uninstall()
    got = opt2.param_groups[0][key]
    assert type(got) is type(value) and got == value
    assert len(opt2.state) == len(opt.state)
