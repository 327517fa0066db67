"""``MultiOptimizer``: several named optimizers (leaves) that step and checkpoint together."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ._fqn import Model, validate_model
from ._host_memory import HostPool
from ._layouts import DEFAULT_STATE_LAYOUT, StateLayout, check_state_layout
from ._leaves import container_leaves, named_leaves, refuse_state_dict
from ._save.fill_plan import FillPlans
from ._torch_internals import caller_frame


class _MultiHandle:
    """Removes a hook registered on every leaf."""

    def __init__(self, handles: list[RemovableHandle]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def __enter__(self) -> _MultiHandle:  # noqa: PYI034 - py3.9 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class MultiOptimizer:
    """Named optimizer leaves over one model, e.g. ``{"experts": AdamW(...), "dense": AdamW(...)}``.

    ``model`` is an ``nn.Module`` or a list of pipeline-parallel parts. ``optimizers`` is a mapping
    of leaf name to optimizer (thin wrappers such as Accelerate's ``AcceleratedOptimizer`` are
    unwrapped), or a trainer's container (VeOmni ``MultiOptimizer``, torchtitan
    ``OptimizersContainer``), whose leaves it takes (docs/semantics.md, *What you pass*); this
    object then steps those leaves itself, not through the container.

    ``step``/``zero_grad`` fan out to every leaf; ``state_dict``/``load_state_dict`` use the
    sparse, exact format of `sparse_ckpt.sparse_state_dict`. Leaves keep insertion order.

    It is a DCP ``Stateful`` that behaves exactly like ``SparseOptimizerState(model, self)``: put
    it straight into ``dcp.save({"optim": mo})`` / ``dcp.async_save`` and load it with
    ``dcp.load({"optim": mo}, planner=sparse_ckpt.SparseLoadPlanner())``. ``state_layout`` is
    `sparse_ckpt.SparseOptimizerState`'s (how its checkpoints hold the state tensors).
    """

    def __init__(
        self,
        model: Model,
        optimizers: Any,
        *,
        state_layout: StateLayout = DEFAULT_STATE_LAYOUT,
    ) -> None:
        self.state_layout: StateLayout = check_state_layout(state_layout)
        validate_model(model)
        refuse_state_dict(
            optimizers,
            advice="pass the optimizers, as a mapping {name: optimizer} (`{'experts': opt}`, "
            "not `opt.state_dict()`) or a trainer's optimizer container",
        )
        if isinstance(optimizers, Mapping):
            pairs = named_leaves(optimizers)
        else:
            pairs = container_leaves(optimizers)
            if pairs is None:
                raise TypeError(
                    f"optimizers must be a mapping of leaf name to optimizer (e.g. {{'experts': opt}}) or a trainer's "
                    f"optimizer container (VeOmni MultiOptimizer, torchtitan OptimizersContainer), "
                    f"got {type(optimizers).__name__}"
                )
        if not pairs:
            raise ValueError("MultiOptimizer needs at least one optimizer")
        seen: dict[int, str] = {}
        for name, opt in pairs:
            if not isinstance(name, str) or not name:
                raise ValueError(f"leaf name {name!r} is not a non-empty string")
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"leaf {name!r} is a {type(opt).__name__}, not a torch.optim.Optimizer")
            for group in opt.param_groups:
                for p in group["params"]:
                    other = seen.setdefault(id(p), name)
                    if other != name:
                        raise ValueError(
                            f"a parameter of shape {tuple(p.shape)} is in leaf {other!r} and leaf {name!r}"
                        )
        self.model = model
        self._optimizers = dict(pairs)
        self._host_pool = HostPool()  # dcp.async_save's staging buffers, reused from save to save
        self._fill_plans = FillPlans()  # and the previous capture's bucket fills

    # ----------------------------------------------------------------- container protocol
    def leaves(self) -> list[tuple[str, torch.optim.Optimizer]]:
        """``[(name, optimizer), ...]`` in order."""
        return list(self._optimizers.items())

    def __len__(self) -> int:
        return len(self._optimizers)

    def __getitem__(self, name: str) -> torch.optim.Optimizer:
        return self._optimizers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._optimizers)

    def __contains__(self, name: object) -> bool:
        return name in self._optimizers

    def keys(self) -> list[str]:
        """Leaf names in order."""
        return list(self._optimizers)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k!r}: {type(v).__name__}" for k, v in self._optimizers.items())
        return f"MultiOptimizer({{{inner}}})"

    # ----------------------------------------------------------------- optimizer protocol
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """All leaves' param groups, in leaf order (the group dicts themselves, not copies)."""
        return [g for opt in self._optimizers.values() for g in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        """A merged view (new dict) of every leaf's ``state``."""
        merged: dict[Any, Any] = {}
        for opt in self._optimizers.values():
            merged.update(opt.state)
        return merged

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step every leaf; a closure is evaluated once, by the first leaf."""
        loss = None
        pending = closure
        for opt in self._optimizers.values():
            if pending is not None:  # not `loss is None`: a closure may return None
                loss = opt.step(pending)
                pending = None
            else:
                opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``zero_grad`` on every leaf."""
        for opt in self._optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> _MultiHandle:
        """Register ``hook`` as a step pre-hook on every leaf; one handle removes them all."""
        return _MultiHandle([opt.register_step_pre_hook(hook) for opt in self._optimizers.values()])

    def register_step_post_hook(self, hook: Callable[..., Any]) -> _MultiHandle:
        """Register ``hook`` as a step post-hook on every leaf; one handle removes them all."""
        return _MultiHandle([opt.register_step_post_hook(hook) for opt in self._optimizers.values()])

    def state_dict(self) -> dict[str, Any]:
        """The sparse, packed state dict of all leaves, as `SparseOptimizerState.state_dict` returns it.

        A DCP load target as well: load it with ``planner=sparse_ckpt.SparseLoadPlanner()``.
        """
        from ._dcp.stateful import SparseOptimizerState

        state = SparseOptimizerState(self.model, self, state_layout=self.state_layout)
        state.host_pool = self._host_pool
        state.fill_plans = self._fill_plans
        return state._state_dict_for(caller_frame(1))  # dcp.load's target is not captured (as for the state)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Restore from a sparse (packed or flat) state dict, as `SparseOptimizerState.load_state_dict`."""
        from ._dcp.stateful import SparseOptimizerState

        SparseOptimizerState(self.model, self, strict=strict, state_layout=self.state_layout).load_state_dict(
            state_dict
        )
