"""Damaged checkpoint files: every outcome is an exact load or a sparse_ckpt error, never a raw one.

``python -m bench.damaged_files`` (``--stride N``: every N-th byte offset, 1 = every byte; ``--span``)
saves small checkpoints of a stepped AdamW (formats ``packed`` with state layouts ``per_tensor`` and
``auto``, ``flat``) and damages them one way at a time:

* ``zero``: bytes ``[offset, offset + span)`` of a data file set to 0;
* ``truncate``: a data file cut at ``offset``;
* ``delete``: a data file removed;
* ``record``: one storage record (``storage_data`` entry) dropped from ``.metadata``.

``--flip`` (`flip_sweep`, ``--rate``) instead flips each byte of each optimizer item, one at a time,
for every state layout of the packed format and the flat one.

Each damaged checkpoint is loaded by ``dcp.load`` through `sparse_ckpt.SparseOptimizerState` and
`sparse_ckpt.SparseLoadPlanner` (``surface="stateful"``) and by torch DSD's functions under
``sparse_ckpt.integrations.dsd.install()`` (``surface="dsd"``) into an optimizer that has state of
its own. An outcome is ``exact`` (the saved optimizer, bit for bit), ``refused`` (a
`sparse_ckpt.errors.SparseCheckpointError`, directly or as every failure of DCP's
``CheckpointException``, the target unchanged), ``silent`` (loaded, not equal; counted only when the
zeroed range overlaps a tensor item's raw bytes, which neither DCP nor the load checksums:
see docs/guarantees.md) or ``raw`` (anything else, a silent load from other damage, a refusal that
changed the target, or a message advising ``weights_only=False``). Prints the counts per variant.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import re
import shutil
import struct
import sys
import tempfile
import warnings
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import sparse_ckpt as sc

from .. import provenance

VARIANTS = (("packed", "per_tensor"), ("packed", "auto"), ("flat", "auto"))
SURFACES = ("stateful", "dsd")
BAD_ADVICE = "weights_only=False"


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _stepped(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(0)
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.01}], lr=0.1)
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    model[1].bias.grad = None  # a parameter without state
    opt.step()
    return model, opt


def _snapshot(opt: torch.optim.Optimizer) -> tuple[Any, ...]:
    sd = opt.state_dict()
    state = {
        i: {k: (v.dtype, tuple(v.shape), v.tolist()) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in sd["state"].items()
    }
    return (repr(sd["param_groups"]), repr(state))


def _own_error(exc: BaseException) -> BaseException | None:
    """The library error ``exc`` is (or that every failure of DCP's ``CheckpointException`` is), else None."""
    if isinstance(exc, sc.SparseCheckpointError):
        return exc
    if isinstance(exc, CheckpointException):
        errors = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        if errors and all(isinstance(e, sc.SparseCheckpointError) for e in errors):
            return errors[0]
    return None


def save(root: str, fmt: str, layout: str) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """A checkpoint of the stepped optimizer under ``root``; ``(path, snapshot, model state)``."""
    model, opt = _stepped(0)
    path = os.path.join(root, f"{fmt}-{layout}")
    state = sc.SparseOptimizerState(model, opt, format=fmt, state_layout=layout)  # type: ignore[arg-type]
    dcp.save({"model": model.state_dict(), "optim": state}, checkpoint_id=path)
    return path, _snapshot(opt), {k: v.clone() for k, v in model.state_dict().items()}


def _load_stateful(path: str, fmt: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    state = sc.SparseOptimizerState(model, opt, format=fmt)  # type: ignore[arg-type]
    dcp.load({"optim": state}, checkpoint_id=path, planner=sc.SparseLoadPlanner())


def _load_dsd(path: str, fmt: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=fmt == "flat")
    target = {"optim": get_optimizer_state_dict(model, opt, options=options)}
    dcp.load(target, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, target["optim"], options=options)


def _save_dsd(root: str, fmt: str) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model, opt = _stepped(0)
    path = os.path.join(root, f"dsd-{fmt}")
    options = StateDictOptions(flatten_optimizer_state_dict=fmt == "flat")
    dcp.save({"optim": get_optimizer_state_dict(model, opt, options=options)}, checkpoint_id=path)
    return path, _snapshot(opt), {k: v.clone() for k, v in model.state_dict().items()}


def classify(load: Callable[[], None], opt: torch.optim.Optimizer, saved: tuple[Any, ...]) -> tuple[str, str]:
    """``(outcome, detail)`` of ``load()`` into ``opt`` (see the module doc)."""
    before = _snapshot(opt)
    try:
        load()
    except BaseException as exc:  # classified
        if isinstance(exc, KeyboardInterrupt):
            raise
        own = _own_error(exc)
        text = str(exc)
        if own is None:
            return "raw", f"{type(exc).__name__}: {text.strip().splitlines()[-1][:300] if text.strip() else ''}"
        if BAD_ADVICE in text:
            return "raw", f"advises {BAD_ADVICE}: {str(own)[:300]}"
        if _snapshot(opt) != before:
            return "raw", f"refused but the optimizer changed: {str(own)[:300]}"
        return "refused", f"{type(own).__name__}: {str(own)[:300]}"
    return ("exact", "") if _snapshot(opt) == saved else ("silent", "loaded, not what was saved")


def tensor_data_ranges(path: str) -> dict[str, list[tuple[int, int, str]]]:
    """``file -> [(start, end, key)]``: where the raw bytes of each tensor item (its archive's
    ``data/0`` record) lie in the data files, the only bytes whose damage no check can see."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    out: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in md.storage_data.items():
        if not isinstance(md.state_dict_metadata.get(index.fqn), TensorStorageMetadata):
            continue
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            for zi in z.infolist():
                if "/data/" in zi.filename:
                    name_len, extra_len = struct.unpack_from("<HH", blob, zi.header_offset + 26)
                    start = info.offset + zi.header_offset + 30 + name_len + extra_len
                    out.setdefault(info.relative_path, []).append((start, start + zi.file_size, index.fqn))
    return out


def damages(path: str, stride: int, span: int) -> Iterator[tuple[str, Callable[[str], None]]]:
    """``(name, apply)`` for every damage of the checkpoint at ``path`` (``apply(copy_path)``)."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    for name in files:
        size = os.path.getsize(os.path.join(path, name))
        yield f"delete {name}", lambda p, n=name: os.remove(os.path.join(p, n))
        for offset in range(0, size, stride):
            yield (
                f"zero {name}[{offset}:{offset + span}]",
                lambda p, n=name, o=offset: _zero(os.path.join(p, n), o, span),
            )
            yield f"truncate {name}@{offset}", lambda p, n=name, o=offset: os.truncate(os.path.join(p, n), o)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    for index in list(md.storage_data):
        yield f"record {index.fqn}{list(index.offset or [])}", lambda p, i=index: _drop_record(p, i)


def _in_tensor_data(what: str, span: int, ranges: dict[str, list[tuple[int, int, str]]]) -> str | None:
    """The tensor item whose raw bytes the ``zero`` damage ``what`` overlaps, else None."""
    m = re.fullmatch(r"zero (\S+)\[(\d+):(\d+)\]", what)
    if m is None:
        return None
    file, lo = m.group(1), int(m.group(2))
    for start, end, key in ranges.get(file, ()):
        if lo < end and start < lo + span:  # the rest of the range: padding, a data descriptor, checked headers
            return key
    return None


def _zero(file: str, offset: int, span: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * max(0, min(span, os.path.getsize(file) - offset)))


def _drop_record(path: str, index: Any) -> None:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    del md.storage_data[index]
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def sweep(
    stride: int,
    span: int,
    surfaces: tuple[str, ...] = SURFACES,
    variants: tuple[tuple[str, str], ...] = VARIANTS,
    out: Any = None,
    pick: Callable[[list[tuple[str, Callable[[str], None]]], str], list[tuple[str, Callable[[str], None]]]]
    | None = None,
) -> dict[str, Any]:
    """Every damage of every variant through every surface (or those ``pick(damages, variant)`` keeps);
    counts and the non-exact details."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    counts: Counter[str] = Counter()
    raws: list[str] = []
    silent: list[str] = []
    root = tempfile.mkdtemp(prefix="damaged_files_")
    from sparse_ckpt.integrations import dsd as sc_dsd

    installed = sc_dsd.installed()
    try:
        for surface in surfaces:
            if surface == "dsd":
                sc_dsd.install()
            for fmt, layout in variants:
                if surface == "dsd" and layout != "auto":
                    continue  # DSD's functions choose their layout
                path, saved, model_sd = _save_dsd(root, fmt) if surface == "dsd" else save(root, fmt, layout)
                loader = _load_dsd if surface == "dsd" else _load_stateful
                raw_data = tensor_data_ranges(path)
                cases = list(damages(path, stride, span))
                for what, apply in pick(cases, f"{surface}-{fmt}-{layout}") if pick else cases:
                    copy = path + ".damaged"
                    shutil.rmtree(copy, ignore_errors=True)
                    shutil.copytree(path, copy)
                    apply(copy)
                    model, opt = _stepped(7)  # state of its own: a refusal must keep it
                    model.load_state_dict(model_sd)
                    outcome, detail = classify(
                        lambda m=model, o=opt, ld=loader, c=copy, f=fmt: ld(c, f, m, o), opt, saved
                    )
                    counts[outcome] += 1
                    line = f"{surface} {fmt}/{layout} {what}: {detail}"
                    if outcome == "raw":
                        raws.append(line)
                    elif outcome == "silent":
                        hit = _in_tensor_data(what, span, raw_data)
                        if hit is None:  # damage outside a tensor's raw bytes must never load
                            counts["silent"] -= 1
                            counts["raw"] += 1
                            raws.append(line + " (not inside a tensor's raw bytes)")
                        else:
                            silent.append(f"{line}: inside the raw bytes of tensor item {hit!r}")
            if surface == "dsd" and not installed:
                sc_dsd.uninstall()
    finally:
        if not installed and sc_dsd.installed():
            sc_dsd.uninstall()
        shutil.rmtree(root, ignore_errors=True)
    return _tally(counts, raws, out, "", "trials", " (zeroed tensor bytes)", silent_cases=silent)


OUTCOMES = ("exact", "refused", "silent", "raw")
"""What a load of a damaged checkpoint can do (`classify`)."""


def _counts_line(counts: dict[str, int], noun: str, silent_note: str) -> str:
    """``N trials: a exact, b refused, c silent, d raw``."""
    return (
        f"{sum(counts.get(k, 0) for k in OUTCOMES)} {noun}: {counts.get('exact', 0)} exact, "
        f"{counts.get('refused', 0)} refused, {counts.get('silent', 0)} silent{silent_note}, {counts.get('raw', 0)} raw"
    )


def _tally(
    counts: Counter[str], raws: list[str], out: Any, prefix: str, noun: str, silent_note: str, **extra: Any
) -> dict[str, Any]:
    """A sweep's result: the trials, the count of each outcome, ``extra`` and the raw cases; printed
    to ``out`` (if given) as one summary line and the first 40 raw cases."""
    result = {
        "trials": sum(counts.values()),
        **{k: counts.get(k, 0) for k in OUTCOMES},
        **extra,
        "raw_cases": raws,
    }
    if out is not None:
        print(prefix + _counts_line(result, noun, silent_note), file=out)
        for line in raws[:40]:
            print("  RAW " + line, file=out)
    return result


FLIP_VARIANTS = (("packed", "auto"), ("packed", "per_tensor"), ("packed", "buffers"), ("flat", "auto"))
"""The (format, state layout) pairs of the flip sweep: every layout of the packed format, and the flat one."""


def optimizer_ranges(path: str) -> list[tuple[str, int, int, str]]:
    """``(file, start, end, key)`` of every optimizer item (``optim.*``) of the checkpoint at ``path``."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    return sorted(
        (info.relative_path, info.offset, info.offset + info.length, index.fqn)
        for index, info in md.storage_data.items()
        if index.fqn.startswith("optim.")
    )


def flip_sweep(
    rate: float = 1.0, seed: int = 0, variants: tuple[tuple[str, str], ...] = FLIP_VARIANTS, out: Any = None
) -> dict[str, Any]:
    """Flip (XOR 0xFF) one byte of one optimizer item at a time -- every byte (``rate=1``) or a seeded
    sample of ``rate`` of them -- and load each damaged checkpoint through `SparseOptimizerState`:
    ``exact`` or ``refused``; ``silent`` only inside a per-item tensor's raw bytes (no checksum
    covers them: docs/guarantees.md), anywhere else (a bucket's bytes, a header, a table) it counts as
    ``raw``. Counts per variant and in total."""
    import random

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    rng = random.Random(seed)
    counts: Counter[str] = Counter()
    per_variant: dict[str, dict[str, int]] = {}
    raws: list[str] = []
    root = tempfile.mkdtemp(prefix="flipped_bytes_")
    try:
        for fmt, layout in variants:
            path, saved, model_sd = save(root, fmt, layout)
            exempt = {
                f: [(a, b, k) for a, b, k in r if "__buffers__" not in k] for f, r in tensor_data_ranges(path).items()
            }
            here: Counter[str] = Counter()
            for file, start, end, key in optimizer_ranges(path):
                full = os.path.join(path, file)
                for pos in range(start, end):
                    if rate < 1.0 and rng.random() >= rate:
                        continue
                    with open(full, "r+b") as f:
                        f.seek(pos)
                        byte = f.read(1)
                        f.seek(pos)
                        f.write(bytes([byte[0] ^ 0xFF]))
                    try:
                        model, opt = _stepped(7)  # state of its own: a refusal must keep it
                        model.load_state_dict(model_sd)
                        outcome, detail = classify(
                            lambda m=model, o=opt, p=path, f=fmt: _load_stateful(p, f, m, o), opt, saved
                        )
                    finally:
                        with open(full, "r+b") as f:
                            f.seek(pos)
                            f.write(byte)
                    if outcome == "silent" and not any(a <= pos < b for a, b, _k in exempt.get(file, ())):
                        outcome, detail = "raw", "loaded, not what was saved (outside a per-item tensor's raw bytes)"
                    here[outcome] += 1
                    if outcome == "raw":
                        raws.append(f"{fmt}/{layout} {file}@{pos} ({key}): {detail}")
            c = per_variant[f"{fmt}/{layout}"] = {k: here.get(k, 0) for k in OUTCOMES}
            counts.update(here)
            if out is not None:
                print(
                    f"flip {fmt}/{layout}: " + _counts_line(c, "flips", " (per-item tensor bytes)"),
                    file=out,
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return _tally(counts, raws, out, "flip: ", "flips", "", variants=per_variant)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--stride N --span N --json PATH``, or ``--flip [--rate R]`` (the flip
    sweep); exit status 1 on any raw outcome."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stride", type=int, default=1, help="damage every N-th byte offset (1: all)")
    parser.add_argument("--span", type=int, default=8, help="bytes zeroed at each offset")
    parser.add_argument(
        "--flip", action="store_true", help="flip each byte of each optimizer item instead (flip_sweep)"
    )
    parser.add_argument("--rate", type=float, default=1.0, help="with --flip: the share of bytes flipped (1: all)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = flip_sweep(args.rate, out=sys.stdout) if args.flip else sweep(args.stride, args.span, out=sys.stdout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "provenance": provenance.record()}, f, indent=1)
    return 1 if result["raw"] else 0


if __name__ == "__main__":
    sys.exit(main())
