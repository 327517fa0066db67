"""``diff``: compare the optimizer parts of two checkpoints (the report and its text form)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from .._dcp.metadata import OptimizerEntries, find_optimizers
from ._reader import named_groups, open_checkpoint, optimizer_values, select_optimizers, split_optimizer
from .inspect import LIST_LIMIT, fmt_names, fmt_value, state_sig, walk_state

__all__ = ["count_differences", "diff_checkpoints", "format_diff", "same_value"]


class _View:
    """One optimizer of one checkpoint as the diff sees it: leaves, groups, state metadata."""

    def __init__(self, path: str | os.PathLike[str], metadata: Metadata, opt: OptimizerEntries) -> None:
        leaves, flat, state_by_fqn, _unmatched = split_optimizer(optimizer_values(path, metadata, opt))
        self.name = opt.name
        self.leaves = dict(named_groups(leaves, flat))
        self.where: dict[str, tuple[str, int]] = {}
        for leaf, groups in self.leaves.items():
            for gi, g in enumerate(groups):
                for fqn in g.fqns:
                    self.where.setdefault(fqn, (leaf, gi))
        self.state: dict[str, dict[str, tuple[str, tuple[int, ...] | None]]] = {}
        for fqn, state in state_by_fqn.items():
            if state:
                self.state[fqn] = {k: state_sig(md) for k, md in walk_state(state)}

    def settings_of(self, fqn: str) -> Mapping[str, Any]:
        """The settings of the first group listing ``fqn``."""
        leaf, gi = self.where[fqn]
        return self.leaves[leaf][gi].settings

    def state_not_in(self, other: _View, fqns: Iterable[str]) -> list[str]:
        """Those of ``fqns`` with state here that ``other`` lists without state."""
        return [f for f in fqns if f in self.state and f in other.where and f not in other.state]


def same_value(a: Any, b: Any) -> bool:
    """Exact equality of settings values: same types, tensors by dtype/shape/values, NaN == NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and bool(
                torch.equal(a, b)
                or (
                    a.is_floating_point()
                    and torch.equal(a.isnan(), b.isnan())
                    and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
                )
            )
        )
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_value(a[k], b[k]) for k in a)
    return bool(a == b)


def _add_non_empty(out: dict[str, Any], **entries: Any) -> dict[str, Any]:
    """``out`` with every non-empty one of ``entries`` added (in order); returns ``out``."""
    for key, value in entries.items():
        if value:
            out[key] = value
    return out


def _settings_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    return _add_non_empty(
        {},
        changed={k: (a[k], b[k]) for k in a if k in b and not same_value(a[k], b[k])},
        removed={k: a[k] for k in a if k not in b},
        added={k: b[k] for k in b if k not in a},
    )


def _diff_pair(a: _View, b: _View, layout: bool) -> dict[str, Any]:
    """What the two optimizers mean (by FQN: settings, which parameters have state, state dtypes and
    shapes); with ``layout`` also how they are laid out (leaves, groups by index, their parameters)."""
    fqns = [f for f in b.where if f in a.where]
    settings: dict[str, dict[str, Any]] = {}  # one entry per distinct change, with the FQNs it applies to
    for fqn in fqns:
        change = _settings_diff(a.settings_of(fqn), b.settings_of(fqn))
        if change:
            settings.setdefault(repr(change), {"fqns": [], **change})["fqns"].append(fqn)
    changes = []
    for fqn in fqns:
        sa, sb = a.state.get(fqn), b.state.get(fqn)
        if not sa or not sb:
            continue
        for k in list(sa) + [k for k in sb if k not in sa]:
            if sa.get(k) != sb.get(k):
                changes.append({"fqn": fqn, "key": k, "a": _sig_json(sa.get(k)), "b": _sig_json(sb.get(k))})
    return _add_non_empty(
        {"key_a": a.name, "key_b": b.name, "leaves": _layout_diff(a, b) if layout else []},
        params_only_in_a=[f for f in a.where if f not in b.where],
        params_only_in_b=[f for f in b.where if f not in a.where],
        settings=list(settings.values()),
        gained_state=b.state_not_in(a, fqns),
        lost_state=a.state_not_in(b, fqns),
        state_changes=changes,
    )


def _layout_diff(a: _View, b: _View) -> list[dict[str, Any]]:
    """Per leaf: a leaf or group (by index) only one side has, parameters a group gained or lost."""
    leaves: list[dict[str, Any]] = []
    for name in list(a.leaves) + [n for n in b.leaves if n not in a.leaves]:
        ga, gb = a.leaves.get(name), b.leaves.get(name)
        if ga is None or gb is None:
            groups = ga if ga is not None else gb
            assert groups is not None
            leaves.append(
                {
                    "name": name,
                    "only_in": "a" if gb is None else "b",
                    "groups": len(groups),
                    "params": sum(len(g.fqns) for g in groups),
                }
            )
            continue
        group_diffs = []
        for gi in range(max(len(ga), len(gb))):
            if gi >= len(ga) or gi >= len(gb):
                only = "a" if gi < len(ga) else "b"
                g = (ga if only == "a" else gb)[gi]
                group_diffs.append({"index": gi, "only_in": only, "params": len(g.fqns), "settings": g.settings})
                continue
            in_a, in_b = set(ga[gi].fqns), set(gb[gi].fqns)
            entry = _add_non_empty(
                {"index": gi},
                params_added=[f for f in gb[gi].fqns if f not in in_a],
                params_removed=[f for f in ga[gi].fqns if f not in in_b],
            )
            if len(entry) > 1:
                group_diffs.append(entry)
        if group_diffs:
            leaves.append({"name": name, "groups": group_diffs})
    return leaves


def _sig_json(sig: tuple[str, tuple[int, ...] | None] | None) -> dict[str, Any] | None:
    if sig is None:
        return None
    return {"dtype": sig[0], "shape": None if sig[1] is None else list(sig[1])}


def count_differences(report: Mapping[str, Any]) -> int:
    """Number of differences in a `diff_checkpoints` report (0: the optimizers agree)."""
    n = len(report.get("optimizers_only_in_a", [])) + len(report.get("optimizers_only_in_b", []))
    for opt in report.get("optimizers", []):
        n += len(opt.get("params_only_in_a", [])) + len(opt.get("params_only_in_b", []))
        n += sum(len(s.get(k, {})) for s in opt.get("settings", []) for k in ("changed", "removed", "added"))
        n += len(opt.get("gained_state", [])) + len(opt.get("lost_state", [])) + len(opt.get("state_changes", []))
        for leaf in opt["leaves"]:
            if "only_in" in leaf:
                n += 1
                continue
            for g in leaf.get("groups", []):
                n += 1 if "only_in" in g else len(g.get("params_added", [])) + len(g.get("params_removed", []))
    return n


def diff_checkpoints(
    a: str | os.PathLike[str], b: str | os.PathLike[str], key: str | None = None, *, layout: bool = False
) -> dict[str, Any]:
    """Compare the optimizer parts of checkpoints ``a`` and ``b`` (the ``diff --json`` schema).

    Optimizers are paired by key (``key``, or the only one of each, or equal names). They are
    compared by what they mean, parameter by parameter (FQN): parameters only one side has, the
    settings of each parameter's group (``settings``: one entry per distinct change, with the FQNs
    it applies to), parameters that gained or lost state, and state keys whose dtype or shape changed
    (values are not compared: they change every step). So a checkpoint and its lossless
    ``convert --to flat`` copy are equal, though flat keeps no leaves or group boundaries. With
    ``layout``, ``leaves`` also lists how they are laid out: a leaf or group (by index) only one side
    has, and parameters a group gained or lost. Settings values in the report are Python values (see
    `jsonable` for JSON).
    """
    md_a, md_b = open_checkpoint(a), open_checkpoint(b)
    opts_a = select_optimizers(find_optimizers(md_a), key)
    opts_b = select_optimizers(find_optimizers(md_b), key)
    if len(opts_a) == 1 and len(opts_b) == 1:
        pairs = [(opts_a[0], opts_b[0])]
    else:
        by_name = {o.name: o for o in opts_b}
        pairs = [(o, by_name[o.name]) for o in opts_a if o.name in by_name]
    paired_a = {p[0].name for p in pairs}
    paired_b = {p[1].name for p in pairs}
    report: dict[str, Any] = {
        "a": os.fspath(a),
        "b": os.fspath(b),
        "optimizers": [_diff_pair(_View(a, md_a, oa), _View(b, md_b, ob), layout) for oa, ob in pairs],
        "optimizers_only_in_a": [o.name for o in opts_a if o.name not in paired_a],
        "optimizers_only_in_b": [o.name for o in opts_b if o.name not in paired_b],
    }
    report["differences"] = count_differences(report)
    return report


# --------------------------------------------------------------------------- text form


def _sig(s: dict[str, Any] | None) -> str:
    if s is None:
        return "absent"
    return s["dtype"] if s["shape"] is None else f"{s['dtype']} {tuple(s['shape'])}"


def format_diff(report: dict[str, Any]) -> str:
    """The text form of a ``diff`` report."""
    lines = [f"a: {report['a']}", f"b: {report['b']}"]
    for name in report["optimizers_only_in_a"]:
        lines.append(f"optimizer {name or '(top level)'}: only in a")
    for name in report["optimizers_only_in_b"]:
        lines.append(f"optimizer {name or '(top level)'}: only in b")
    for opt in report["optimizers"]:
        ka, kb = opt["key_a"] or "(top level)", opt["key_b"] or "(top level)"
        lines.append(f"optimizer {ka}" + (f" -> {kb}:" if ka != kb else ":"))
        for change in opt.get("settings", []):
            gw = f"  {len(change['fqns'])} param(s) {fmt_names(change['fqns'])}"
            for k, (va, vb) in change.get("changed", {}).items():
                lines.append(f"{gw}: {k} {fmt_value(va)} -> {fmt_value(vb)}")
            for k, v in change.get("removed", {}).items():
                lines.append(f"{gw}: {k} removed (was {fmt_value(v)})")
            for k, v in change.get("added", {}).items():
                lines.append(f"{gw}: {k} added ({fmt_value(v)})")
        if opt.get("gained_state"):
            lines.append(f"  {len(opt['gained_state'])} param(s) gained state: {fmt_names(opt['gained_state'])}")
        if opt.get("lost_state"):
            lines.append(f"  {len(opt['lost_state'])} param(s) lost state: {fmt_names(opt['lost_state'])}")
        changes = opt.get("state_changes", [])
        for c in changes[:LIST_LIMIT]:
            lines.append(f"  state {c['key']} of {c['fqn']!r}: {_sig(c['a'])} -> {_sig(c['b'])}")
        if len(changes) > LIST_LIMIT:
            lines.append(f"  ... {len(changes) - LIST_LIMIT} more state change(s)")
        if opt.get("params_only_in_a"):
            lines.append(f"  {len(opt['params_only_in_a'])} param(s) only in a: {fmt_names(opt['params_only_in_a'])}")
        if opt.get("params_only_in_b"):
            lines.append(f"  {len(opt['params_only_in_b'])} param(s) only in b: {fmt_names(opt['params_only_in_b'])}")
        for leaf in opt["leaves"]:
            where = f"  layout: leaf {leaf['name']!r}"
            if "only_in" in leaf:
                lines.append(f"{where}: only in {leaf['only_in']} ({leaf['groups']} group(s), {leaf['params']} params)")
                continue
            for g in leaf.get("groups", []):
                gw = f"{where} group {g['index']}"
                if "only_in" in g:
                    lines.append(f"{gw}: only in {g['only_in']} ({g['params']} params)")
                    continue
                if g.get("params_added"):
                    lines.append(f"{gw}: +{len(g['params_added'])} param(s): {fmt_names(g['params_added'])}")
                if g.get("params_removed"):
                    lines.append(f"{gw}: -{len(g['params_removed'])} param(s): {fmt_names(g['params_removed'])}")
    n = report["differences"]
    lines.append("no differences" if n == 0 else f"{n} difference(s)")
    return "\n".join(lines)
