"""Every torch internal sparse_ckpt touches (``sparse_ckpt/_torch_internals.py``, its ``ACCESSES``)
still exists in the installed torch: a release that moves one fails here, loudly, naming it,
instead of making a save silently slower or a load silently take another path. Also: no other
module of the package reads a frame or a private torch attribute."""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

import _backends
import pytest
import torch
from torch import nn

from sparse_ckpt import _torch_internals as ti

core_backend = _backends.run_once
"""Interface checks of torch: once, not per backend."""

PACKAGE = Path(__file__).resolve().parents[2] / "sparse_ckpt"


def _optimizer_with_hooks() -> torch.optim.Optimizer:
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    opt.register_state_dict_pre_hook(lambda o: None)
    opt.register_state_dict_post_hook(lambda o, sd: None)
    opt.register_load_state_dict_pre_hook(lambda o, sd: None)
    opt.register_load_state_dict_post_hook(lambda o: None)
    return opt


def _hooks() -> None:
    opt = _optimizer_with_hooks()
    for read in (
        ti.state_dict_pre_hooks,
        ti.state_dict_post_hooks,
        ti.load_state_dict_pre_hooks,
        ti.load_state_dict_post_hooks,
    ):
        assert len(read(opt)) == 1, f"{read.__name__} finds no registered hook: torch renamed the hook dict"


def _version_counter() -> None:
    t = torch.zeros(2)
    before = ti.tensor_version(t)
    t.add_(1)
    assert isinstance(before, int) and ti.tensor_version(t) == before + 1


def _module_dicts() -> None:
    m = nn.Sequential(nn.Linear(2, 2))
    assert isinstance(m._modules, dict) and "0" in m._modules
    assert isinstance(m[0]._parameters, dict) and set(m[0]._parameters) == {"weight", "bias"}


def _make_subclass() -> None:
    class Sub(torch.Tensor):
        pass

    assert type(ti.make_subclass(Sub, torch.ones(1))) is Sub


def _chunk_protocol() -> None:
    from torch.distributed.tensor import DTensor

    assert callable(getattr(DTensor, "__create_chunk_list__", None))
    from torch.distributed.checkpoint import planner_helpers

    assert "__create_chunk_list__" in Path(planner_helpers.__file__).read_text(), "DCP no longer plans through it"


def _dcp_load_frame() -> None:
    assert ti._DCP_LOAD_CODE is not None, "torch.distributed.checkpoint.state_dict_loader.load not found"
    for local in ("process_group", "no_dist"):
        assert local in ti._DCP_LOAD_CODE.co_varnames, f"dcp.load has no local {local!r}"


def _dcp_save_frames() -> None:
    assert len(ti._DCP_SAVE_CODES) == 2, "dcp.save/async_save code objects not found"
    for code in ti._DCP_SAVE_CODES:
        names = set(code.co_varnames)
        # no_dist only where the public function takes it: torch 2.7's async_save has no no_dist
        # parameter (nor local), and the library reads it with a default of False there.
        takes = inspect.signature(getattr(torch.distributed.checkpoint, code.co_name)).parameters
        for local in ("process_group", "no_dist"):
            assert local in names or (local == "no_dist" and local not in takes), (
                f"{code.co_name} has no local {local!r}"
            )
    takes_collectives = [
        code
        for code in ti._DCP_SAVE_CODES
        if "use_collectives" in inspect.signature(getattr(torch.distributed.checkpoint, code.co_name)).parameters
    ]
    assert all("use_collectives" in code.co_varnames for code in takes_collectives)  # none on torch 2.7


def _dcp_async_save_frame() -> None:
    """A Stateful's ``state_dict()`` tells ``dcp.async_save`` (which stages) from ``dcp.save``."""
    import torch.distributed.checkpoint as dcp

    class Seen(Exception):
        pass

    class Probe:
        def state_dict(self) -> Any:
            raise Seen(ti.saved_by_dcp_async(ti.caller_frame(1)))

        def load_state_dict(self, sd: Any) -> None:  # pragma: no cover - never loaded
            raise NotImplementedError

    assert ti._DCP_ASYNC_SAVE_CODE is not None, "dcp.async_save's code object not found"
    seen = {}
    for name in ("save", "async_save"):
        try:
            getattr(dcp, name)({"probe": Probe()}, checkpoint_id="/nonexistent/never-written")
        except Seen as exc:
            seen[name] = exc.args[0]
    assert seen == {"save": False, "async_save": True}, seen


def _dcp_storage_reader_frame() -> None:
    code = ti._DCP_LOAD_STATE_DICT_CODE
    assert code is not None and "storage_reader" in code.co_varnames


def _accelerate_frame() -> None:
    module, name = ti._ACCELERATE_CUSTOM_SAVE
    try:
        mod = importlib.import_module(module)
    except ImportError:
        pytest.skip("accelerate is not installed (pip install --no-deps -r .ci/requirements-accelerate.txt)")
    assert callable(getattr(mod, name, None)), f"{module}.{name} is gone"


def _frames() -> None:
    assert ti.caller_frame(0) is sys._getframe()
    assert isinstance(sys._current_frames(), dict)


def _dsd_helpers() -> None:
    from torch.distributed import _state_dict_utils

    for name in ("_gather_state_dict", "_offload_state_dict_to_cpu"):
        assert callable(getattr(_state_dict_utils, name, None)), f"torch.distributed._state_dict_utils.{name} is gone"
    assert ti.offload_state_dict_to_cpu({"t": torch.ones(2)})["t"].device.type == "cpu"


def _dsd_routable() -> None:
    import torch.distributed.checkpoint.state_dict as dsd

    from sparse_ckpt.integrations._rebind import route_code, unroutable

    for name, params in ti.DSD_SIGNATURES.items():
        fn = getattr(dsd, name)
        assert unroutable(fn) is None, f"torch.distributed.checkpoint.state_dict.{name} {unroutable(fn)}"
        code = route_code(fn, "sparse_ckpt.integrations.dsd.functions", name)
        assert code.co_varnames[: len(params)] == params and not code.co_freevars


def _file_item_location() -> None:
    import tempfile

    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as root:
        t = torch.arange(6.0)
        dcp.save({"t": t}, checkpoint_id=root, no_dist=True)
        reader = dcp.FileSystemReader(root)
        md = reader.read_metadata()
        (index,) = [i for i in md.storage_data if i.fqn == "t"]
        where = ti.file_item_location(reader, md.storage_data[index])
        assert where is not None, "FileSystemReader.path or the _StorageInfo fields are gone"
        path, offset, length = where
        with open(path, "rb") as f:
            f.seek(offset)
            blob = f.read(length)
        import io

        assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), t), "the item's bytes are elsewhere"


def _dcp_flatten_flag() -> None:
    from torch.distributed.checkpoint import _nested_dict, _version

    assert ti.dcp_flatten_flag() is None, "DCP's flatten flag is set outside a load"
    _version._derived_version = "2_3"
    try:
        flat, _ = _nested_dict.flatten_state_dict({"a": {"b": 1}})
        assert list(flat) == ["a"], f"the flag no longer selects torch <= 2.3's flattening: {list(flat)}"
        ti.clear_dcp_flatten_flag()
        assert _version._derived_version is None
    finally:
        _version._derived_version = None


def _dcp_metadata_globals() -> None:
    """Every global a ``.metadata`` of this torch pickles resolves through the restricted unpickler's table."""
    import io
    import pickle
    import tempfile

    import torch.distributed.checkpoint as dcp

    found = ti.dcp_metadata_globals()
    for name in ("_MEM_FORMAT_ENCODING", "TensorProperties", "Metadata", "MetadataIndex"):
        assert ("torch.distributed.checkpoint.metadata", name) in found, (
            f"torch.distributed.checkpoint.metadata.{name} is gone"
        )
    assert ("torch.distributed.checkpoint.filesystem", "_StorageInfo") in found, "filesystem._StorageInfo is gone"
    assert found["torch.serialization", "_get_layout"]("torch.strided") is torch.strided
    with tempfile.TemporaryDirectory() as root:
        dcp.save({"t": torch.arange(6.0), "b": {"x": 1}}, checkpoint_id=root, no_dist=True)
        blob = Path(root, ".metadata").read_bytes()
    named: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            named.add((module, name))
            return super().find_class(module, name)

    assert Recording(io.BytesIO(blob)).load() is not None
    torch_module = {n for m, n in named if m == "torch"}
    others = {(m, n) for m, n in named if m != "torch" and not m.startswith("pathlib")}
    assert others <= set(found), f"the .metadata of this torch names globals the table lacks: {others - set(found)}"
    assert torch_module <= {"Size", "float32", "int64"}, torch_module


def _default_store() -> None:
    import datetime

    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        store = ti.default_store()
        store.set("sparse_ckpt/internals-check", "1")  # what the bounded agreement uses of it
        store.wait(["sparse_ckpt/internals-check"], datetime.timedelta(seconds=1))
        assert store.check(["sparse_ckpt/internals-check"]) and store.get("sparse_ckpt/internals-check") == b"1"
        assert store.delete_key("sparse_ckpt/internals-check") and not store.check(["sparse_ckpt/internals-check"])
    finally:
        if own:
            dist.destroy_process_group()


CHECKS = {
    "torch.optim.Optimizer._optimizer_state_dict_pre_hooks": _hooks,
    "torch.optim.Optimizer._optimizer_state_dict_post_hooks": _hooks,
    "torch.optim.Optimizer._optimizer_load_state_dict_pre_hooks": _hooks,
    "torch.optim.Optimizer._optimizer_load_state_dict_post_hooks": _hooks,
    "torch.Tensor._version": _version_counter,
    "torch.nn.Module._modules": _module_dicts,
    "torch.nn.Module._parameters": _module_dicts,
    "torch.Tensor._make_subclass": _make_subclass,
    "DTensor.__create_chunk_list__ (DCP's tensor protocol)": _chunk_protocol,
    (
        "torch.distributed.checkpoint.state_dict_loader.load (caller frame; locals process_group, no_dist)"
    ): _dcp_load_frame,
    (
        "torch.distributed.checkpoint.state_dict_saver.save/async_save "
        "(caller frame; locals process_group, no_dist, use_collectives)"
    ): _dcp_save_frames,
    (
        "torch.distributed.checkpoint.state_dict_saver.async_save (caller frame: a save that stages)"
    ): _dcp_async_save_frame,
    (
        "torch.distributed.checkpoint.state_dict_loader._load_state_dict (caller frame; local storage_reader)"
    ): _dcp_storage_reader_frame,
    "accelerate.checkpointing.save_custom_state (caller frame)": _accelerate_frame,
    "sys._getframe / sys._current_frames (CPython)": _frames,
    (
        "torch.distributed.checkpoint.state_dict.{get,set}_optimizer_state_dict/{get,set}_state_dict.__code__ "
        "(plain functions without a closure; integrations.dsd routes them)"
    ): _dsd_routable,
    "torch.distributed._state_dict_utils._gather_state_dict (integrations.dsd)": _dsd_helpers,
    "torch.distributed._state_dict_utils._offload_state_dict_to_cpu (integrations.dsd)": _dsd_helpers,
    (
        "FileSystemReader.path and _StorageInfo.relative_path/offset/length/transform_descriptors (item bytes)"
    ): _file_item_location,
    "torch.distributed.checkpoint._version._derived_version (DefaultLoadPlanner's flatten flag)": _dcp_flatten_flag,
    (
        "DCP metadata pickle: metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo, serialization._get_layout"
    ): _dcp_metadata_globals,
    "torch.distributed.distributed_c10d._get_default_store (the bounded agreement)": _default_store,
}


def test_every_access_has_a_check() -> None:
    assert set(CHECKS) == set(ti.ACCESSES)


@pytest.mark.parametrize("access", sorted(CHECKS))
def test_access_still_works(access: str) -> None:
    try:
        CHECKS[access]()
    except AssertionError as exc:
        raise AssertionError(
            f"torch {torch.__version__} moved a torch internal sparse_ckpt uses: {access} "
            f"(checked on {ti.ACCESSES[access]}): {exc}"
        ) from None


FRAME_NAMES = {"_getframe", "_current_frames", "f_back", "f_locals", "f_code", "f_globals"}
"""Attribute names that read frames."""


def test_no_other_module_reads_frames_or_private_torch_attributes() -> None:
    """Frames are read only in ``_torch_internals``; a private attribute of a torch object
    (``torch.X._y``, or ``._y`` of a value that is no sparse_ckpt object) only there and in the
    core (whose ``map_parameters`` is handed its torch entry points by ``_torch_internals``)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "_torch_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in FRAME_NAMES:
                found.append(f"{rel}:{node.lineno}: .{node.attr}")
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Attribute)
                and ast.unparse(node.value).startswith("torch.")
            ):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
