"""An emulated ``npu`` device for tests and the bench: importing this module registers it.

Builds ``emulated_npu.cpp`` beside this file with ``torch.utils.cpp_extension`` (cached in
``$SPARSE_CKPT_EMULATED_NPU_BUILD``, default ``build/emulated_npu`` in the checkout; a rebuild only
when the source or torch changed), renames torch's ``PrivateUse1`` device type to ``npu``
(``torch.utils.rename_privateuse1_backend``), registers a device module as ``torch.npu`` and
generates the ``Tensor.npu()``-style methods. The device is host memory with two device indices, a
pinned host allocator, streams and events that never wait, and every operator without a native
kernel run by torch's boxed CPU fallback (see the C++ file). It emulates the *device type*, not an
Ascend NPU: no numerics, speed or collectives of real hardware. Its process-group backend is
``npu_gloo`` (emulated_npu_pg.py, registered here; ``torch.npu.process_group_backend`` names it): the
collectives on ``npu`` tensors run on a Gloo group through host copies, where Ascend has HCCL.

The bench and the accelerator tests import it when ``SPARSE_CKPT_NPU_MODULE=emulated_npu`` (with
this folder on ``sys.path``), instead of ``torch_npu``. ``python tests/accelerator/emulated_npu.py``
builds it and prints the build time.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import types
from pathlib import Path

import emulated_npu_pg
import torch

NAME = "npu"
_HERE = Path(__file__).resolve().parent
_SOURCE = _HERE / "emulated_npu.cpp"


def _build_dir() -> Path:
    default = _HERE.parent.parent / "build" / "emulated_npu"
    path = Path(os.environ.get("SPARSE_CKPT_EMULATED_NPU_BUILD", str(default)))
    path.mkdir(parents=True, exist_ok=True)
    return path


def build(verbose: bool = False) -> types.ModuleType:
    """Compile (or load the cached build of) the extension; loading it registers the PrivateUse1 kernels."""
    from torch.utils.cpp_extension import load

    return load(
        name="sparse_ckpt_emulated_npu",
        sources=[str(_SOURCE)],
        build_directory=str(_build_dir()),
        extra_cflags=["-O1"],
        verbose=verbose,
    )


def _device_module(ext: types.ModuleType) -> types.ModuleType:
    """The ``torch.npu`` module of the emulated device: what torch and the tests ask a device module."""
    mod = types.ModuleType("emulated_npu.device")
    mod.__doc__ = "torch.npu of the emulated device (tests/accelerator/emulated_npu.py)"

    def _index(device: object = None) -> int:
        if device is None:
            return ext.current_device()
        d = torch.device(device) if not isinstance(device, int) else torch.device(NAME, device)
        return ext.current_device() if d.index is None else d.index

    mod.is_available = lambda: True
    mod.is_initialized = lambda: True
    mod._is_in_bad_fork = lambda: False
    mod.device_count = ext.device_count
    mod.current_device = ext.current_device
    mod.set_device = lambda device: ext.set_device(_index(device))
    mod.synchronize = lambda device=None: None  # every kernel runs synchronously
    # The kernels are the CPU's, so is the generator (torch.manual_seed seeds it, then calls these).
    mod.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    mod.manual_seed_all = mod.manual_seed
    mod.seed = lambda: torch.default_generator.seed()
    mod.seed_all = mod.seed
    mod.initial_seed = lambda: torch.default_generator.initial_seed()
    mod.get_rng_state = lambda device=None: torch.get_rng_state()
    mod.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    mod.memory_allocated = lambda device=None: ext.memory_allocated()
    mod.pinned_allocations = ext.pinned_allocations
    mod.get_device_name = lambda device=None: "emulated npu (host memory, sparse_ckpt tests)"
    mod.Stream = lambda device=None, priority=0: torch.Stream(NAME, priority=priority)
    mod.Event = lambda *args, **kwargs: torch.Event(NAME, *args, **kwargs)
    mod.current_stream = lambda device=None: torch.accelerator.current_stream(device)
    mod.default_stream = lambda device=None: torch.accelerator.current_stream(device)
    mod.stream = lambda stream: contextlib.nullcontext(stream)  # kernels never wait: one stream is as good as any
    mod.emulated = True
    mod.process_group_backend = emulated_npu_pg.NAME  # what a run on this device passes to init_process_group
    return mod


def register() -> types.ModuleType:
    """Build, rename ``PrivateUse1`` to ``npu`` and register ``torch.npu``; idempotent. Returns ``torch.npu``."""
    existing = getattr(torch, NAME, None)
    if existing is not None and getattr(existing, "emulated", False):
        return existing
    current = torch._C._get_privateuse1_backend_name()  # (the test device may use torch's private name query)
    if current not in ("privateuseone", NAME):
        raise RuntimeError(f"emulated npu: PrivateUse1 is already registered as {current!r}; cannot also be 'npu'")
    ext = build()
    emulated_npu_pg.register()
    if current != NAME:
        torch.utils.rename_privateuse1_backend(NAME)
    mod = _device_module(ext)
    torch._register_device_module(NAME, mod)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
    return mod


register()

if __name__ == "__main__":
    t0 = time.perf_counter()
    build(verbose="-v" in sys.argv)
    x = torch.arange(6.0, device="npu:1").view(2, 3).t().contiguous()
    print(f"emulated npu ready in {time.perf_counter() - t0:.1f}s: {x.device} {x.cpu().tolist()}")
