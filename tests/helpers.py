"""Small builders and deep-compare helpers shared by the test suite.

* :func:`make_moe` -- a tiny MoE-like model (router, experts, dense layers), deterministic per seed;
  :func:`moe_with_leaves` -- it with a three-leaf MultiOptimizer; :func:`route_top1` -- its routing;
  :func:`experts_and_dense` -- it with a two-leaf MultiOptimizer (``experts``, ``dense``).
* :class:`TwoLayerNet`, :class:`LayerNet` (+ :func:`layer_params`), :class:`TiedNet` -- small models;
  :func:`randomize` -- seeded values for every parameter of a module.
* :func:`train` -- a few real optimizer steps, optionally with some parameters left without a grad.
* :func:`snapshot_optimizer` / :func:`assert_optimizer_equal` -- exact (``torch.equal``) comparison
  of optimizer state, param groups, grads and parameters, positionally (so two optimizers over two
  copies of a model compare too).
* :class:`IdentitySnapshot` -- a model and its optimizers by value *and* by identity (objects
  replaced, tensors modified in place), for "this call changed nothing".
* :func:`assert_deep_equal` / :func:`deep_equal` / :func:`deep_diff` -- recursive exact equality
  of dicts (key order included unless told), sequences, tensors (dtype, shape, device and values)
  and scalars; options make NaN handling and the dict test stricter where a test needs it.
* :func:`same_bits` -- bit-exact deep comparison (types at every level, dict order, float bit
  patterns, tensor dtype/shape/device/``requires_grad``/bytes) for differential tests of two
  implementations of one function.
* :func:`clone_value` / :func:`clone_state_dict` -- deep copies with tensors cloned (for frozen
  "before" values and for what a storage round trip gives).
* :func:`find_table_key` -- the one packed group-table key of a flat dict (of one leaf).
* :func:`sparse_dcp_load` -- ``dcp.load`` of an optimizer through ``SparseOptimizerState`` and ``SparseLoadPlanner``.
* :func:`small_bench_args` -- the bench's smallest quick run (its command-line arguments).
* :func:`fqn_view` -- ``(fqn -> state, fqn -> settings)`` of optimizers, comparable across models
  (``groups=True``: ``[(settings, fqns)]`` per param group instead of ``fqn -> settings``).

Hand-built packed-table bytes live in ``tests/table_bytes.py``; full (DTensor) copies and
snapshots by FQN across ranks in ``tests/_dist.py``.
"""

from __future__ import annotations

import copy
import math
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt._format.keys import PACKED_PREFIX
from sparse_ckpt._leaves import named_leaves


class Expert(nn.Module):
    """One feed-forward expert: ``down(relu(up(x)))``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the expert."""
        return self.down(torch.relu(self.up(x)))


def damaged(data: Any, blob: bytes) -> bytes:
    """``blob`` with 1 to 4 random damages drawn from hypothesis ``data`` (a byte flipped, the tail cut,
    or a byte inserted), for the readers' fuzz tests."""
    from hypothesis import strategies as st

    out = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(out)))
        action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip" and at < len(out):
            out[at] = data.draw(st.integers(0, 255))
        elif action == "cut":
            del out[at:]
        else:
            out[at:at] = bytes([data.draw(st.integers(0, 255))])
    return bytes(out)


def route_top1(h: torch.Tensor, logits: torch.Tensor, experts: Sequence[nn.Module]) -> torch.Tensor:
    """Each row of ``h`` through its best expert (argmax of ``logits``), gated by its softmax weight;
    rows sum into zeros (a row whose expert was never chosen adds nothing, that expert gets no grad)."""
    choice = logits.argmax(dim=-1)
    gate = torch.softmax(logits, dim=-1).gather(-1, choice[:, None])
    out = torch.zeros_like(h)
    for e, expert in enumerate(experts):
        rows = (choice == e).nonzero(as_tuple=True)[0]
        if rows.numel():
            out = out.index_add(0, rows, gate[rows] * expert(h[rows]))
    return out


class TinyMoE(nn.Module):
    """``embed -> top-1 routed experts -> head``: dense params plus experts that may get no grad."""

    def __init__(self, n_experts: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(n_experts))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, only_experts: Iterable[int] | None = None) -> torch.Tensor:
        """Route each row to its best expert; ``only_experts`` restricts routing (others get no grad)."""
        h = self.embed(x)
        logits = self.router(h)
        if only_experts is not None:
            allowed = torch.full((logits.shape[-1],), float("-inf"))
            allowed[list(only_experts)] = 0.0
            logits = logits + allowed
        return self.head(self.norm(h + route_top1(h, logits, self.experts)))

    def expert_params(self) -> list[nn.Parameter]:
        """Parameters of all experts."""
        return list(self.experts.parameters())

    def dense_params(self) -> list[nn.Parameter]:
        """Every parameter that is not an expert's."""
        expert_ids = {id(p) for p in self.expert_params()}
        return [p for p in self.parameters() if id(p) not in expert_ids]


def make_moe(seed: int = 0, n_experts: int = 4, dim: int = 8) -> TinyMoE:
    """A deterministic :class:`TinyMoE` (same ``seed`` -> bit-identical parameters)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return TinyMoE(n_experts, dim)
    finally:
        torch.random.set_rng_state(gen_state)


def moe_with_leaves(seed: int) -> tuple[TinyMoE, sc.MultiOptimizer]:
    """:func:`make_moe` with a MultiOptimizer (AdamW, lr 0.01) of leaves ``dense``, ``experts``
    (experts 0-2, one group each) and ``idle`` (expert 3: never steps under
    ``train(..., only_experts=range(3))``)."""
    model = make_moe(seed)
    experts = [{"params": list(model.experts[e].parameters())} for e in range(3)]
    opt = sc.MultiOptimizer(
        model,
        {
            "dense": torch.optim.AdamW(model.dense_params(), lr=0.01),
            "experts": torch.optim.AdamW(experts, lr=0.01),
            "idle": torch.optim.AdamW(model.experts[3].parameters(), lr=0.01),
        },
    )
    return model, opt


def experts_and_dense(
    model: TinyMoE,
    experts: Callable[[Any], torch.optim.Optimizer],
    dense: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> sc.MultiOptimizer:
    """A MultiOptimizer of leaves ``experts`` (``experts(model.expert_params())``) and ``dense``
    (``dense(model.dense_params())``; ``dense`` defaults to ``experts``)."""
    make_dense = experts if dense is None else dense
    return sc.MultiOptimizer(
        model, {"experts": experts(model.expert_params()), "dense": make_dense(model.dense_params())}
    )


def randomize(module: nn.Module, seed: int, scale: float = 1.0) -> None:
    """Every parameter of ``module`` from ``randn * scale`` of a generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


class TwoLayerNet(nn.Module):
    """Layers ``a`` (4 -> 3) and ``b`` (3 -> 2), and ``unused``: a parameter that never gets a
    gradient (so it never has state)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)
        self.unused = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``b(tanh(a(x)))``."""
        return self.b(torch.tanh(self.a(x)))


class LayerNet(nn.Module):
    """``n`` linear layers ``dim -> dim``, FQNs ``layers.{i}.weight|bias``, values from ``seed``."""

    def __init__(self, n: int = 4, dim: int = 3, seed: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))
        randomize(self, seed)


def layer_params(model: LayerNet, *idx: int) -> list[nn.Parameter]:
    """The parameters of layers ``idx`` of ``model``, in order."""
    return [p for i in idx for p in model.layers[i].parameters()]


class TiedNet(nn.Module):
    """``enc`` and ``dec`` (3 -> 3, no bias) sharing one weight: FQNs ``enc.weight`` and its alias
    ``dec.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(3, 3, bias=False)
        self.dec = nn.Linear(3, 3, bias=False)
        self.dec.weight = self.enc.weight


def make_batch(seed: int, dim: int = 8, rows: int = 6) -> torch.Tensor:
    """A deterministic input batch."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, dim, generator=gen)


def train(
    model: TinyMoE,
    optimizer: Any,
    steps: int = 2,
    *,
    only_experts: Iterable[int] | None = None,
    seed: int = 0,
) -> None:
    """Run ``steps`` real forward/backward/step iterations (``optimizer`` may be a MultiOptimizer)."""
    only = None if only_experts is None else list(only_experts)
    for i in range(steps):
        optimizer.zero_grad()
        x = make_batch(seed + i, dim=model.embed.in_features)
        loss = model(x, only).pow(2).mean()
        loss.backward()
        optimizer.step()


def clone_value(value: Any, clone_tensor: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:
    """Deep copy of nested dicts/lists/tuples with tensors cloned (detached; by ``clone_tensor``
    when given, e.g. ``_dist.full_copy``'s full value of a DTensor)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone() if clone_tensor is None else clone_tensor(value)
    if isinstance(value, dict):
        return {k: clone_value(v, clone_tensor) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone_value(v, clone_tensor) for v in value)
    return copy.deepcopy(value)


def clone_state_dict(sd: Mapping[str, Any], *, detach: bool = True) -> dict[str, Any]:
    """A flat state dict as a round trip through storage gives it: nothing shared with live objects.

    Top-level tensors are cloned -- ``detach()``-ed first, unless ``detach=False`` (plain
    ``Tensor.clone``, which keeps autograd history); every other value is ``copy.deepcopy``-ed
    whole (unlike :func:`clone_value`, which rebuilds containers and detaches nested tensors).
    """
    return {
        k: ((v.detach().clone() if detach else v.clone()) if isinstance(v, torch.Tensor) else copy.deepcopy(v))
        for k, v in sd.items()
    }


def _positions(optimizer: torch.optim.Optimizer) -> dict[int, tuple[int, int]]:
    pos: dict[int, tuple[int, int]] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            pos.setdefault(id(p), (gi, pi))
    return pos


def snapshot_optimizer(optimizer: Any) -> dict[str, Any]:
    """A positional deep copy of one optimizer (or every leaf of a MultiOptimizer / mapping).

    For each leaf: ``groups`` (settings without params, cloned), ``param_ids`` (identity of each
    group's params, to detect reordering), ``state`` keyed by ``(group, index)``, ``grads`` and
    ``params`` (cloned data, ``None`` for no grad), and ``grad_ids`` (identity of each ``.grad``).
    """
    snap: dict[str, Any] = {}
    for leaf, opt in named_leaves(optimizer):
        pos = _positions(opt)
        params = [p for g in opt.param_groups for p in g["params"]]
        state: dict[Any, Any] = {}
        for key, value in opt.state.items():
            state[pos.get(id(key), ("non-param", repr(key)))] = clone_value(value)
        snap[leaf] = {
            "groups": [clone_value({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups],
            "param_ids": [[id(p) for p in g["params"]] for g in opt.param_groups],
            "state": state,
            "grads": [None if p.grad is None else p.grad.detach().clone() for p in params],
            "grad_ids": [None if p.grad is None else id(p.grad) for p in params],
            "params": [p.detach().clone() for p in params],
        }
    return snap


def assert_optimizer_equal(
    a: Any,
    b: Any,
    *,
    identity: bool = False,
    grads: bool = True,
    state_order: bool = True,
    nan_equal: NanEqual = "all",
    mapping: type = Mapping,
) -> None:
    """Assert two optimizers (or snapshots) hold exactly equal state, groups, grads and params.

    Either argument may be an optimizer-like object or a :func:`snapshot_optimizer` result.
    ``identity=True`` also compares parameter and ``.grad`` object identity (only meaningful
    when both describe the same optimizer, e.g. a snapshot before and after an operation).
    ``grads=False`` skips ``.grad`` (e.g. right after loading into a fresh copy of the model).
    ``state_order=False``: the parameters may come in another order in ``optimizer.state``
    (each parameter's own state keys are still compared in order).
    ``nan_equal`` and ``mapping`` are passed to :func:`assert_deep_equal`.
    """
    sa = a if _is_snapshot(a) else snapshot_optimizer(a)
    sb = b if _is_snapshot(b) else snapshot_optimizer(b)
    assert list(sa) == list(sb), f"leaves differ: {list(sa)} vs {list(sb)}"
    options: dict[str, Any] = {"nan_equal": nan_equal, "mapping": mapping}
    for leaf in sa:
        la, lb = sa[leaf], sb[leaf]
        for part in ("groups", "state", "grads", "params") if grads else ("groups", "state", "params"):
            if part == "state" and not state_order:
                keys_a, keys_b = sorted(la[part], key=repr), sorted(lb[part], key=repr)
                assert set(keys_a) == set(keys_b), f"leaf {leaf!r} state: params {keys_a} vs {keys_b}"
                for pos in keys_a:
                    assert_deep_equal(la[part][pos], lb[part][pos], f"leaf {leaf!r} state[{pos!r}]", **options)
                continue
            assert_deep_equal(la[part], lb[part], f"leaf {leaf!r} {part}", **options)
        assert [len(g) for g in la["param_ids"]] == [len(g) for g in lb["param_ids"]], f"leaf {leaf!r} group sizes"
        if identity:
            assert la["param_ids"] == lb["param_ids"], f"leaf {leaf!r}: param identity/order changed"
            assert la["grad_ids"] == lb["grad_ids"], f"leaf {leaf!r}: a .grad object was replaced"


def _tensor_version(t: torch.Tensor) -> int:
    """In-place modification counter of ``t`` (isolated use of torch's private ``_version``)."""
    return t._version


def _objects(value: Any, out: list[tuple[int, int | None]]) -> None:
    """Identity (and tensor version) of every container and tensor reachable from ``value``."""
    out.append((id(value), _tensor_version(value) if isinstance(value, torch.Tensor) else None))
    if isinstance(value, dict):
        for v in value.values():
            _objects(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _objects(v, out)


class IdentitySnapshot:
    """Everything observable about a model and its optimizers, by value and by identity: for
    "this call changed nothing" (a save, a failed load).

    :meth:`assert_unchanged` fails naming the first difference: a parameter or ``.grad``
    replaced, modified in place (version counter) or of other values; ``optimizer.state``,
    ``param_groups``, any group dict or any object inside them replaced or a tensor in them
    modified in place; state, settings or ``defaults`` of other values (:func:`deep_equal`, key
    order included, dicts required to be dicts, NaN as ``nan_equal`` says).
    """

    def __init__(
        self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], *, nan_equal: NanEqual = "floats"
    ) -> None:
        self.same: dict[str, Any] = {"nan_equal": nan_equal, "mapping": dict}
        self.params = [(n, p, p.detach().clone(), _tensor_version(p)) for n, p in model.named_parameters()]
        self.grads = [
            (p.grad, None if p.grad is None else p.grad.clone(), None if p.grad is None else _tensor_version(p.grad))
            for _n, p in model.named_parameters()
        ]
        self.opts = []
        for opt in optimizers:
            state_items = list(opt.state.items())
            ids: list[tuple[int, int | None]] = []
            _objects(opt.param_groups, ids)
            for _k, v in state_items:
                _objects(v, ids)
            self.opts.append(
                {
                    "opt": opt,
                    "state_obj": opt.state,
                    "state_keys": [k for k, _ in state_items],
                    "state_vals": [clone_value(v) for _k, v in state_items],
                    "groups_obj": opt.param_groups,
                    "groups": [
                        ({k: clone_value(v) for k, v in g.items() if k != "params"}, list(g["params"]))
                        for g in opt.param_groups
                    ],
                    "defaults": clone_value(opt.defaults),
                    "ids": ids,
                }
            )

    def assert_unchanged(self, model: nn.Module) -> None:
        """Fail naming the first thing that differs from the snapshot."""
        now = list(model.named_parameters())
        assert [n for n, _ in now] == [n for n, *_ in self.params]
        for (name, p, value, version), (_n, p_now) in zip(self.params, now):
            assert p_now is p, f"parameter {name} replaced"
            assert _tensor_version(p) == version, f"parameter {name} modified in place"
            assert torch.equal(p.detach(), value), f"parameter {name} changed"
        for (name, _p), (grad, value, version) in zip(now, self.grads):
            assert _p.grad is grad, f".grad of {name} replaced"
            if grad is not None:
                assert _tensor_version(grad) == version, f".grad of {name} modified in place"
                assert torch.equal(grad, value), f".grad of {name} changed"
        for snap in self.opts:
            opt = snap["opt"]
            assert opt.state is snap["state_obj"], "optimizer.state replaced"
            assert list(opt.state.keys()) == snap["state_keys"], "optimizer.state gained or lost entries"
            for key, frozen in zip(snap["state_keys"], snap["state_vals"]):
                assert deep_equal(opt.state[key], frozen, **self.same), (
                    f"state of a {tuple(key.shape)} parameter changed"
                )
            assert opt.param_groups is snap["groups_obj"], "optimizer.param_groups replaced"
            assert len(opt.param_groups) == len(snap["groups"])
            for gi, (group, (settings, params)) in enumerate(zip(opt.param_groups, snap["groups"])):
                assert all(a is b for a, b in zip(group["params"], params)) and len(group["params"]) == len(params), (
                    f"group {gi} params changed"
                )
                now_settings = {k: v for k, v in group.items() if k != "params"}
                assert deep_equal(now_settings, settings, **self.same), f"group {gi} settings changed"
            assert deep_equal(opt.defaults, snap["defaults"], **self.same), "optimizer.defaults changed"
            ids: list[tuple[int, int | None]] = []
            _objects(opt.param_groups, ids)
            for v in opt.state.values():
                _objects(v, ids)
            assert ids == snap["ids"], "an object inside state/param_groups was replaced or modified in place"


def _is_snapshot(x: Any) -> bool:
    return isinstance(x, dict) and all(isinstance(v, dict) and "param_ids" in v for v in x.values()) and bool(x)


NanEqual = Literal["all", "floats", "none"]


def deep_diff(
    a: Any,
    b: Any,
    where: str = "value",
    *,
    check_order: bool = True,
    nan_equal: NanEqual = "all",
    mapping: type = Mapping,
) -> str | None:
    """The first difference between ``a`` and ``b`` as a message, or ``None`` when they are equal.

    Recursive exact comparison:

    * tensors: both tensors, same dtype, shape and device, ``torch.equal`` values;
    * mappings (instances of ``mapping``): same keys -- in the same order unless
      ``check_order=False`` -- and equal values.  ``mapping=dict`` is the stricter
      ``isinstance(x, dict)`` test: the other side must be a dict too, and a non-dict mapping is
      compared as a plain value;
    * lists and tuples: same type and length, equal items;
    * anything else: same type and ``==``.

    ``nan_equal`` says where NaN equals NaN: ``"all"`` (Python floats, and floating tensors with
    NaNs in the same places), ``"floats"`` (Python floats only; tensors follow ``torch.equal``),
    ``"none"`` (nowhere: plain ``==`` and ``torch.equal``).
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _tensor_diff(a, b, where, nan_equal)
    options: dict[str, Any] = {"check_order": check_order, "nan_equal": nan_equal, "mapping": mapping}
    if isinstance(a, mapping):
        return _mapping_diff(a, b, where, options)
    if isinstance(a, (list, tuple)):
        return _sequence_diff(a, b, where, options)
    return _plain_diff(a, b, where, nan_equal)


def _tensor_diff(a: Any, b: Any, where: str, nan_equal: NanEqual) -> str | None:
    """`deep_diff` where ``a`` or ``b`` is a tensor."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return f"{where}: {type(a)} vs {type(b)}"
    if a.dtype != b.dtype:
        return f"{where}: dtype {a.dtype} vs {b.dtype}"
    if a.shape != b.shape:
        return f"{where}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.device != b.device:
        return f"{where}: device {a.device} vs {b.device}"
    if not (torch.equal(a, b) or (nan_equal == "all" and _both_nan_equal(a, b))):
        return f"{where}: tensors differ\n{a}\n{b}"
    return None


def _mapping_diff(a: Any, b: Any, where: str, options: dict[str, Any]) -> str | None:
    """`deep_diff` where ``a`` is a mapping (an instance of ``options["mapping"]``)."""
    mapping = options["mapping"]
    if not isinstance(b, mapping):
        return f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if options["check_order"]:
        if list(a.keys()) != list(b.keys()):
            return f"{where}: keys {list(a.keys())} vs {list(b.keys())}"
    elif set(a.keys()) != set(b.keys()):
        return f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
    for k in a:
        diff = deep_diff(a[k], b[k], f"{where}[{k!r}]", **options)
        if diff is not None:
            return diff
    return None


def _sequence_diff(a: list | tuple, b: Any, where: str, options: dict[str, Any]) -> str | None:
    """`deep_diff` where ``a`` is a list or tuple."""
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if len(a) != len(b):
        return f"{where}: length {len(a)} vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        diff = deep_diff(x, y, f"{where}[{i}]", **options)
        if diff is not None:
            return diff
    return None


def _plain_diff(a: Any, b: Any, where: str, nan_equal: NanEqual) -> str | None:
    """`deep_diff` of anything else: same type and ``==`` (NaN as ``nan_equal`` says)."""
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} {a!r} vs {type(b).__name__} {b!r}"
    if nan_equal != "none" and isinstance(a, float) and math.isnan(a):
        return None if math.isnan(b) else f"{where}: nan vs {b!r}"
    if a == b:  # ``==`` (not ``!=``), exactly as an ``assert a == b``
        return None
    return f"{where}: {a!r} vs {b!r}"


def assert_deep_equal(a: Any, b: Any, where: str = "value", **options: Any) -> None:
    """Assert recursive exact equality; ``options`` (``check_order``, ``nan_equal``, ``mapping``)
    and the rules are :func:`deep_diff`'s."""
    diff = deep_diff(a, b, where, **options)
    assert diff is None, diff


def deep_equal(a: Any, b: Any, **options: Any) -> bool:
    """Whether ``a`` and ``b`` are recursively, exactly equal; ``options`` are :func:`deep_diff`'s."""
    return deep_diff(a, b, **options) is None


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)  # (the values, bits applied)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def same_bits(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same to the bit (for comparing two implementations' results).

    Stricter than :func:`deep_equal` at every level:

    * the same type (``type(a) is type(b)``: ``bool`` is not ``int``, a ``Parameter`` is not a
      ``Tensor``, an ``OrderedDict`` is not a ``dict``);
    * tensors: the same dtype, shape, device, ``requires_grad`` and conj/neg bits, and the same bytes of
      their values (``-0.0``
      differs from ``0.0``; NaNs compare by their bit patterns);
    * floats: the same IEEE-754 bit pattern (``struct.pack("<d")``);
    * dicts: the same length, and pairwise in order the same keys and values (both by ``same_bits``);
    * lists and tuples: the same length and pairwise ``same_bits`` items;
    * ``str``, ``bytes``, ``int``, ``None``, ``torch.device`` (a value, built anew by each decode):
      ``==``; any other object: the very same object (``is``), e.g. a ``torch.dtype``, an exception
      class or a callback.

    The same rules as ``same()`` in ``tests/core/test_core_differential.py``, which can use this one.
    """
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.shape, a.device, a.requires_grad, a.is_conj(), a.is_neg(), _tensor_bytes(a)) == (
            b.dtype,
            b.shape,
            b.device,
            b.requires_grad,
            b.is_conj(),
            b.is_neg(),
            _tensor_bytes(b),
        )
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            same_bits(ka, kb) and same_bits(va, vb) for (ka, va), (kb, vb) in zip(a.items(), b.items())
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    if a is None or isinstance(a, (str, bytes, int, torch.device)):
        return a == b
    return a is b


def _both_nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(
        a.is_floating_point()
        and torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
        and torch.equal(a.isnan(), b.isnan())
    )


def fqn_view(
    model: nn.Module, optimizers: Iterable[torch.optim.Optimizer], *, groups: bool = False
) -> tuple[dict[str, Any], Any]:
    """``(fqn -> state, fqn -> settings)`` over several optimizers, comparable across models.

    Names come from ``model.named_parameters()``; the state follows ``optimizer.state``'s order;
    a parameter's settings are its group's entries other than ``params``. ``groups=True``: the
    second item is instead ``[(settings, [fqn, ...]), ...]``, every param group in order
    (optimizer by optimizer) -- for comparing the group layout too, not only each parameter's
    settings (where ``params`` sits among a group's keys is not part of it). The values are the
    live objects, not copies.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    state: dict[str, Any] = {}
    settings: dict[str, dict[str, Any]] = {}
    layout: list[tuple[dict[str, Any], list[str]]] = []
    for opt in optimizers:
        for p, s in opt.state.items():
            state[names[id(p)]] = s
        for g in opt.param_groups:
            if groups:
                layout.append(({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in g["params"]]))
                continue
            for p in g["params"]:
                settings[names[id(p)]] = {k: v for k, v in g.items() if k != "params"}
    return state, (layout if groups else settings)


def dcp_loaded_adamw(path: Any, model: nn.Module) -> torch.optim.Optimizer:
    """A fresh AdamW (lr 0.5, so a load that kept it would show) of a copy of ``model``, loaded from
    ``path`` by :func:`sparse_dcp_load`."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    sparse_dcp_load(path, model, opt)
    return opt


def param_fqns(model: nn.Module) -> dict[int, str]:
    """``id(param) -> first name`` from ``named_parameters`` (no wrapper stripping)."""
    out: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), name)
    return out


def expected_fqn_settings(optimizer: torch.optim.Optimizer, fqn_of: Mapping[int, str]) -> dict[str, dict[str, Any]]:
    """``fqn -> settings`` computed from the live groups (no hooks), for comparison."""
    out: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            out[fqn_of[id(p)]] = settings
    return out


def flat_settings(sd: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``param_groups.{fqn}.{key}`` entries of a flat dict as ``fqn -> {key: value}``."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in sd.items():
        if key.startswith("param_groups.") and "__packed__" not in key:
            fqn, _, name = key[len("param_groups.") :].rpartition(".")
            out.setdefault(fqn, {})[name] = value
    return out


def find_table_key(sd: Mapping[Any, Any], leaf: str | None = None) -> str:
    """The key of the one packed group table (``param_groups.__packed__.{leaf}.{digest}``,
    :data:`sparse_ckpt._format.keys.PACKED_PREFIX`) in a flat dict -- of leaf ``leaf`` when given
    (exactly that leaf: not one whose name merely starts with it). Asserts there is exactly one;
    keys that are not strings are passed over."""
    keys = [
        k
        for k in sd
        if isinstance(k, str)
        and k.startswith(PACKED_PREFIX)
        and (leaf is None or k[len(PACKED_PREFIX) :].rpartition(".")[0] == leaf)
    ]
    assert len(keys) == 1, f"packed group tables{'' if leaf is None else f' of leaf {leaf!r}'}: {keys}"
    return keys[0]


def table_bytes(sd: Mapping[str, Any], key: str) -> bytes:
    """The table a packed group or scalar table item ``key`` of ``sd`` holds (checked, and unsealed
    when its key is rank-tagged: see *Table keys* in :mod:`sparse_ckpt._format.keys`)."""
    from sparse_ckpt._format.keys import PACKED_PREFIX as GROUPS
    from sparse_ckpt._format.keys import SCALARS_PREFIX, check_table

    prefix = SCALARS_PREFIX if key.startswith(SCALARS_PREFIX) else GROUPS
    return check_table(prefix, key[len(prefix) :], sd[key])[1]


def state_keys(sd: Mapping[str, Any]) -> list[str]:
    """The ``state.*`` keys of a sparse/flat dict."""
    return [k for k in sd if k.startswith("state.")]


def count_calls(fn: Callable[..., Any]) -> tuple[Callable[..., Any], list[int]]:
    """Wrap ``fn``; returns ``(wrapper, counter)`` where ``counter[0]`` counts calls."""
    counter = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counter[0] += 1
        return fn(*args, **kwargs)

    return wrapper, counter


def decoded_settings(model: nn.Module, sd: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``fqn -> settings`` decoded from a packed (or flat) dict via the library's decoder."""
    from sparse_ckpt._fqn import build_fqn_map
    from sparse_ckpt._load.decode import decode_checkpoint

    return dict(decode_checkpoint(sd, build_fqn_map(model)).settings_of)


def all_equal(items: Sequence[torch.Tensor]) -> bool:
    """Whether all tensors in ``items`` are exactly equal."""
    return all(torch.equal(items[0], t) for t in items[1:])


def small_bench_args(budget: str) -> list[str]:
    """The bench's arguments for its smallest quick run (scale 1x2, layout ``param``, one repeat, ``budget``
    seconds a figure): what the bench tests and the installed wheel's bench test run."""
    return ["--quick", "--scales", "1x2", "--layouts", "param", "--repeats", "1", "--budget", budget]


def sparse_dcp_load(
    path: Any, model: nn.Module, optimizer: Any, key: str = "optim", *, state: dict[str, Any] | None = None, **kw: Any
) -> None:
    """``dcp.load`` of ``{**state, key: sc.SparseOptimizerState(model, optimizer)}`` from ``path`` with
    ``sc.SparseLoadPlanner()`` (``kw``: more of ``dcp.load``'s arguments, e.g. ``no_dist=True``)."""
    import torch.distributed.checkpoint as dcp

    items = {**(state or {}), key: sc.SparseOptimizerState(model, optimizer)}
    dcp.load(items, checkpoint_id=path, planner=sc.SparseLoadPlanner(), **kw)
