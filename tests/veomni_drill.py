"""The 2-rank VeOmni drill (tests/integrations/test_veomni.py): one spawned Gloo run, facts for the tests.

Each rank builds a small MoE (dense layer, 4 experts, a "vision tower") ``fully_shard``-ed on an
explicit CPU mesh, VeOmni's own ``MultiOptimizer`` with leaves ``non_extra_parallel`` (dense +
experts) and ``vit`` (the tower), and VeOmni's ``build_lr_scheduler`` (linear, 4 train steps: lr
0.01 -> 0.0025 after 3 steps). Phase 1: 3 steps routing experts 0 and 1 only, the tower unused
(``vit`` never steps, its lr still moves). Then, through VeOmni's ``build_checkpointer("dcp",
"fsdp2")`` -- stock, then after ``install()`` -- save (with ``extra_state`` and ``global_steps``),
restore into fresh objects (another seed), and run 2 phase-2 steps (every expert routed, the tower
used) against the uninterrupted run. Other checks ride along: async save, a single AdamW leaf, the
stock checkpoint refused and migrated, the foreign (stock) loader on a sparse checkpoint, the
ExtraParallel refusal, HF conversion of the sparse checkpoint, every kind loaded again with the DSD hook
active too (both install orders). Rank 0 writes every fact to
``root/facts.pt``; the tests assert on them (so each failure is its own test).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

DIM = 8
N_EXPERTS = 4
ROUTED_BEFORE = (0, 1)
LR = 0.01
TRAIN_STEPS = 4
STEPS_BEFORE = 3
STEPS_AFTER = 2


class TinyVeMoE(nn.Module):
    """A dense layer, ``N_EXPERTS`` experts summed over the routed ones, and a tower used on request."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(N_EXPERTS))
        self.tower = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, routed: tuple[int, ...], tower: bool) -> torch.Tensor:
        if tower:
            x = x + torch.tanh(self.tower(x))
        h = torch.tanh(self.dense(x))
        return sum(self.experts[i](h) for i in routed)


def build(mesh: Any, seed: int, multi: bool = True) -> tuple[TinyVeMoE, Any, Any]:
    """The model, VeOmni's optimizer (its ``MultiOptimizer``, or one AdamW) and its lr scheduler."""
    from veomni.optim import build_lr_scheduler
    from veomni.optim.optimizer import MultiOptimizer

    torch.manual_seed(seed)
    model = TinyVeMoE()
    fully_shard(model, mesh=mesh)
    if multi:
        main = [*model.dense.parameters(), *model.experts.parameters()]
        optimizers = {
            "non_extra_parallel": torch.optim.AdamW(main, lr=LR, foreach=False),
            "vit": torch.optim.AdamW(model.tower.parameters(), lr=LR, foreach=False),
        }
        optimizer: Any = MultiOptimizer(model, optimizers, key_names=list(optimizers))
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    scheduler = build_lr_scheduler(optimizer, train_steps=TRAIN_STEPS, lr=LR, lr_decay_style="linear")
    return model, optimizer, scheduler


def train(model: TinyVeMoE, optimizer: Any, scheduler: Any, steps: int, first: int, after: bool) -> None:
    """``steps`` steps as VeOmni's trainer does them (step, scheduler step, zero_grad); batch ``first + i``."""
    routed = tuple(range(N_EXPERTS)) if after else ROUTED_BEFORE
    for i in range(steps):
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 + first + i))
        model(x, routed, tower=after).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def leaves(optimizer: Any) -> dict[str, torch.optim.Optimizer]:
    sub = getattr(optimizer, "optimizers_dict", None)
    return dict(sub) if sub is not None else {"optim": optimizer}


def full(t: Any) -> Any:
    if isinstance(t, DTensor):
        return t.full_tensor().detach().clone()
    if isinstance(t, torch.Tensor):
        return t.detach().clone()
    return t


def snapshot(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Full copies: params by FQN, state by leaf and FQN, each group's settings and FQNs (collective)."""
    names = {id(p): n for n, p in model.named_parameters()}
    snap: dict[str, Any] = {"params": {n: full(p) for n, p in model.named_parameters()}, "state": {}, "groups": {}}
    for leaf, opt in leaves(optimizer).items():
        by_fqn = {names[id(p)]: st for p, st in opt.state.items()}
        snap["state"][leaf] = {f: {k: full(v) for k, v in by_fqn[f].items()} for f in sorted(by_fqn)}
        snap["groups"][leaf] = [
            ({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in g["params"]])
            for g in opt.param_groups
        ]
    return snap


def same(a: Any, b: Any) -> bool:
    """Exact equality of snapshots (tensors: dtype, shape and bits)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def max_param_delta(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((a["params"][n] - b["params"][n]).abs().max()) for n in a["params"])


def state_summary(snap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``leaf -> fqn -> {key: step value or 'zeros'/'values'}``: what state exists and its step."""
    out: dict[str, dict[str, Any]] = {}
    for leaf, by_fqn in snap["state"].items():
        out[leaf] = {
            fqn: {k: (float(v) if k == "step" else ("zeros" if not v.any() else "values")) for k, v in st.items()}
            for fqn, st in by_fqn.items()
        }
    return out


def lrs(optimizer: Any) -> dict[str, list[float]]:
    return {leaf: [g["lr"] for g in opt.param_groups] for leaf, opt in leaves(optimizer).items()}


def ckpt_state(model: nn.Module, optimizer: Any, scheduler: Any, step: int) -> dict[str, Any]:
    """What VeOmni's CheckpointerCallback saves (the parts this model has)."""
    return {
        "model": model,
        "optimizer": optimizer,
        "extra_state": {"global_step": step, "lr_scheduler": scheduler.state_dict()},
    }


def state_of(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """What VeOmni's ``_load_checkpoint`` passes to ``load``."""
    return {"model": model, "optimizer": optimizer, "extra_state": {}}


def error_of(kind: type[BaseException], fn: Any, *args: Any) -> str | None:
    """``fn(*args)``; the message of the ``kind`` error it raised (prefixed by the class name for
    ``Exception``), ``None`` when it returned."""
    try:
        fn(*args)
    except kind as exc:
        return f"{type(exc).__name__}: {exc}" if kind is Exception else str(exc)
    return None


def restore(checkpointer: Any, path: str, mesh: Any, multi: bool = True) -> tuple[TinyVeMoE, Any, Any, dict]:
    """Fresh objects (another seed) loaded as VeOmni's ``_load_checkpoint`` does."""
    model, optimizer, scheduler = build(mesh, seed=7, multi=multi)
    state = state_of(model, optimizer)
    checkpointer.load(path, state)
    scheduler.load_state_dict(state["extra_state"]["lr_scheduler"])
    return model, optimizer, scheduler, state["extra_state"]


def dcp_items(path: str) -> tuple[int, int]:
    """(DCP items, of which under ``optimizer.``) of a checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = list(FileSystemReader(path).read_metadata().state_dict_metadata)
    return len(keys), sum(1 for k in keys if k.startswith("optimizer."))


def resume_case(checkpointer: Any, root: Path, name: str, mesh: Any, multi: bool = True) -> dict[str, Any]:
    """Train, save through ``checkpointer``, continue (the reference), restore fresh, continue; facts."""
    model, optimizer, scheduler = build(mesh, seed=0, multi=multi)
    train(model, optimizer, scheduler, STEPS_BEFORE, 0, after=False)
    before = snapshot(model, optimizer)
    checkpointer.save(
        str(root / name), ckpt_state(model, optimizer, scheduler, STEPS_BEFORE), global_steps=STEPS_BEFORE
    )
    after_save = snapshot(model, optimizer)
    train(model, optimizer, scheduler, STEPS_AFTER, STEPS_BEFORE, after=True)
    reference = snapshot(model, optimizer)
    path = str(root / name / f"global_step_{STEPS_BEFORE}")
    model2, optimizer2, scheduler2, extra = restore(checkpointer, path, mesh, multi)
    restored = snapshot(model2, optimizer2)
    restored_lrs = lrs(optimizer2)
    train(model2, optimizer2, scheduler2, STEPS_AFTER, STEPS_BEFORE, after=True)
    resumed = snapshot(model2, optimizer2)
    return {
        "class": checkpointer.__name__,
        "lrs_saved": lrs_of(before),
        "lrs_restored": restored_lrs,
        "state_saved": state_summary(before),
        "state_restored": state_summary(restored),
        "restored_equals_saved": same(before, restored),
        "save_left_live_unchanged": same(before, after_save),
        "resumed_equals_reference": same(reference, resumed),
        "max_delta_after_resume": max_param_delta(reference, resumed),
        "extra_global_step": extra["global_step"],
        "items": dcp_items(path),
        "path": path,
    }


def lrs_of(snap: dict[str, Any]) -> dict[str, list[float]]:
    return {leaf: [s["lr"] for s, _f in groups] for leaf, groups in snap["groups"].items()}


def cpu_shim() -> None:
    """VeOmni's synchronous save ends with ``torch.<device>.empty_cache()``; ``torch.cpu`` has none
    (VeOmni targets accelerators). The no-op it would be on CPU, so its own code runs unchanged."""
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None  # type: ignore[attr-defined]


def worker(rank: int, world_size: int, root: str) -> None:
    warnings.simplefilter("ignore")
    cpu_shim()
    from veomni.checkpoint import build_checkpointer
    from veomni.checkpoint.dcp_checkpointer import DistributedCheckpointer
    from veomni.distributed.parallel_state import init_parallel_state

    import sparse_ckpt as sc
    import sparse_ckpt.integrations.veomni as sc_veomni

    base = Path(root)
    init_parallel_state(dp_size=world_size, dp_mode="fsdp2", device_type="cpu")  # what VeOmni's trainer sets up
    mesh = init_device_mesh("cpu", (world_size,))
    facts: dict[str, Any] = {}

    # Stock VeOmni on the seed scenario (pinned, so an upstream fix is noticed).
    stock = build_checkpointer("dcp", "fsdp2")
    facts["stock"] = resume_case(stock, base, "stock", mesh)

    handle = sc_veomni.install()
    facts["installed_twice_same"] = sc_veomni.install() is not None and sc_veomni.installed()
    sparse = build_checkpointer("dcp", "fsdp2")
    facts["ddp_class"] = build_checkpointer("dcp", "ddp").__name__
    facts["sparse"] = resume_case(sparse, base, "sparse", mesh)
    facts["sparse_single"] = resume_case(sparse, base, "single", mesh, multi=False)

    # Async save: the future is VeOmni's (DistributedCheckpointer's), waited on by its own code too.
    model, optimizer, scheduler = build(mesh, seed=0)
    train(model, optimizer, scheduler, STEPS_BEFORE, 0, after=False)
    sparse.save(str(base / "async"), ckpt_state(model, optimizer, scheduler, 3), save_async=True)
    facts["async_future_on_base"] = DistributedCheckpointer.save_future is not None
    sparse.wait_for_pending_save()
    facts["async_future_cleared"] = DistributedCheckpointer.save_future is None
    model2, optimizer2, _s, _e = restore(sparse, str(base / "async"), mesh)
    facts["async_restored_equals_saved"] = same(snapshot(model, optimizer), snapshot(model2, optimizer2))

    # The stock checkpoint under the installed checkpointer: refused without opt-in, migrated with it.
    stock_path = facts["stock"]["path"]
    model, optimizer, scheduler = build(mesh, seed=7)
    before = snapshot(model, optimizer)
    facts["stock_refused"] = error_of(sc.CheckpointMismatchError, sparse.load, stock_path, state_of(model, optimizer))
    facts["stock_refusal_left_unchanged"] = same(before, snapshot(model, optimizer))
    state = state_of(model, optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = sc_veomni.load_stock_checkpoint(stock_path, state)
    facts["migration_report"] = {g.leaf: (g.params, g.no_settings, g.no_state) for g in report.leaves}
    facts["migration_warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, sc_veomni.StockCheckpointWarning)
    ]
    facts["migrated_state"] = state_summary(snapshot(model, optimizer))
    facts["migrated_lrs"] = lrs(optimizer)
    facts["migrated_extra_step"] = state["extra_state"]["global_step"]
    sc_veomni.install(migrate_stock=True)
    migrating = build_checkpointer("dcp", "fsdp2")
    model, optimizer, scheduler = build(mesh, seed=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        migrating.load(stock_path, state_of(model, optimizer))
    facts["trainer_migration_warned"] = sum(issubclass(w.category, sc_veomni.StockCheckpointWarning) for w in caught)
    sc_veomni.install()

    # The foreign-loader hazard: unpatched VeOmni reading a sparse_ckpt checkpoint.
    sparse_path = facts["sparse"]["path"]
    model, optimizer, scheduler = build(mesh, seed=7)
    probe = _stock_load_target_keys(model, optimizer)
    facts["foreign_load_error"] = error_of(BaseException, stock.load, sparse_path, state_of(model, optimizer))
    facts["foreign_state"] = state_summary(snapshot(model, optimizer))
    facts["foreign_lrs"] = lrs(optimizer)
    facts["foreign_target_keys"] = probe
    model, optimizer, scheduler = build(mesh, seed=7, multi=False)
    facts["foreign_single_target_keys"] = _stock_load_target_keys(model, optimizer)
    single_path = facts["sparse_single"]["path"]
    facts["foreign_single_error"] = error_of(BaseException, stock.load, single_path, state_of(model, optimizer))
    facts["foreign_single_state"] = state_summary(snapshot(model, optimizer))
    facts["foreign_single_lrs"] = lrs(optimizer)
    from torch.distributed.checkpoint import FileSystemReader

    facts["sparse_ckpt_keys"] = sorted(
        k for k in FileSystemReader(sparse_path).read_metadata().state_dict_metadata if k.startswith("optimizer.")
    )

    # ExtraParallel models are refused before anything is written.
    model, optimizer, scheduler = build(mesh, seed=0)
    model._fqn2spec_info = {"experts.0.weight": None}
    ep_state = ckpt_state(model, optimizer, scheduler, 3)
    facts["ep_refused"] = error_of(sc.UnsupportedStateDictError, sparse.save, str(base / "ep"), ep_state)
    facts["ep_wrote"] = os.path.exists(base / "ep")

    facts["with_dsd"] = _with_dsd(base, mesh, stock_path)

    handle.remove()
    facts["uninstalled_class"] = build_checkpointer("dcp", "fsdp2").__name__

    if rank == 0:
        from veomni.checkpoint import ckpt_to_state_dict

        hf = ckpt_to_state_dict(sparse_path)
        facts["hf_keys"] = sorted(hf)
        torch.save(facts, base / "facts.pt")
    dist.barrier()


COMPOSED = ("veomni, then dsd", "dsd, then veomni")
"""The orders in which the drill installs the pair VeOmni + the DSD hook (the launcher's default selection)."""


def _with_dsd(base: Path, mesh: Any, stock_path: str) -> dict[str, Any]:
    """Every checkpoint kind VeOmni's integration loads alone, loaded with the DSD hook active too, in
    both install orders: its own (``MultiOptimizer``, one AdamW, an async save) and the stock one
    (``migrate_stock=True``). Facts per order, as ``resume_case`` and the migration give them."""
    from veomni.checkpoint import build_checkpointer

    import sparse_ckpt.integrations.dsd as sc_dsd
    import sparse_ckpt.integrations.veomni as sc_veomni

    out: dict[str, Any] = {}
    for order in COMPOSED:
        sc_veomni.uninstall()
        for name in order.split(", then "):
            sc_dsd.install() if name == "dsd" else sc_veomni.install()
        sparse = build_checkpointer("dcp", "fsdp2")
        tag = order.replace(", then ", "-")
        facts: dict[str, Any] = {
            "sparse": resume_case(sparse, base, f"{tag}-sparse", mesh),
            "sparse_single": resume_case(sparse, base, f"{tag}-single", mesh, multi=False),
        }
        model, optimizer, scheduler = build(mesh, seed=0)
        train(model, optimizer, scheduler, STEPS_BEFORE, 0, after=False)
        sparse.save(str(base / f"{tag}-async"), ckpt_state(model, optimizer, scheduler, 3), save_async=True)
        sparse.wait_for_pending_save()
        model2, optimizer2, _s, _e = restore(sparse, str(base / f"{tag}-async"), mesh)
        facts["async_restored_equals_saved"] = same(snapshot(model, optimizer), snapshot(model2, optimizer2))
        sc_veomni.install(migrate_stock=True)
        model, optimizer, scheduler = build(mesh, seed=7)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build_checkpointer("dcp", "fsdp2").load(stock_path, state_of(model, optimizer))
        facts["migrated_state"] = state_summary(snapshot(model, optimizer))
        facts["migrated_lrs"] = lrs(optimizer)
        sc_dsd.uninstall()
        out[order] = facts
    sc_veomni.install()
    return out


def _stock_load_target_keys(model: nn.Module, optimizer: Any) -> list[str]:
    """The optimizer keys stock VeOmni's load target asks DCP for (DCP's flattening: dicts and lists of
    dicts are walked, other values are items); the state building it invented is dropped again."""
    from veomni.checkpoint.dcp_checkpointer import OptimizerState

    keys: list[str] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        else:
            keys.append(prefix)

    walk("optimizer", OptimizerState(model, optimizer, load=True).state_dict())
    for opt in leaves(optimizer).values():
        opt.state.clear()
    return sorted(keys)
