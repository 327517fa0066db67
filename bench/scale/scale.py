"""Scale figures: the state layouts (every one of ``sparse_ckpt._layouts.STATE_LAYOUTS``)
against each other and the raw-bytes floor, in whole-optimizer ``dcp.save``/``dcp.load``, DCP's
``.metadata`` at N ranks, ``dcp.async_save``'s blocked time, and the chunk size from which one item
per tensor beats buffers.

* ``metadata`` (:mod:`.scale_metadata`): the ``.metadata`` DCP's coordinator would write for an
  FSDP2 job of N ranks -- from synthetic local save plans planned by DCP's own
  ``DefaultSavePlanner.create_global_plan``, with the storage records ``FileSystemWriter.finish``
  adds; records, pickled bytes, pickle/unpickle time, the ratio to ``per_tensor``. No process is
  started. Above ``--max-records`` every k-th per-item state tensor is planned and records, bytes and
  times are multiplied by k (rows marked ``scaled x k``; ``--check`` compares with a full row).
* ``dcp`` (:mod:`.scale_dcp`): in one process, ``dcp.save``/``dcp.load`` of the whole optimizer
  (``SparseOptimizerState`` + ``SparseLoadPlanner``) per layout, and the floor: ``torch.save`` /
  ``torch.load(weights_only=True)`` of the same state as one tensor per dtype (concatenated
  beforehand, untimed); medians, items, bytes on disk, ratios to the floor and to the faster of
  ``per_tensor`` / ``buffers``.
  ``--spread``: the same twice, with ``SPARSE_CKPT_HUGE_PAGES=1`` (the default) and ``=0``, and the
  min / median / max of each layout's samples (how bimodal its saves are, with and without huge pages).
* ``threshold`` (:mod:`.scale_dcp`): per state-chunk size, ``dcp.save`` + ``dcp.load`` of a fixture
  of equal-size state tensors (about ``--total`` bytes each point) per-item vs buffers; the crossover.
* ``async`` (:mod:`.scale_async`): the time ``dcp.async_save`` blocks the caller and the total until
  its future completes, per layout and for stock DCP (torch DSD's optimizer state dict).
* ``report`` (:mod:`.scale_report`): the markdown tables of bench/README.md and the SVG plot from the
  JSON files the other modes wrote.

Fixtures are ``LxE[:hHIDDEN][:eVOCABxDIM]`` (``bench.fixtures.FixtureSpec``). The commands of the
committed figures are in bench/README.md ("Scale"), e.g.::

    python -m bench.scale dcp --fixtures 24x128:h0,24x128:h64,4x16:h512,8x64:h64:e32768x64 --repeats 3 \\
        --out bench/results/scale_dcp.json
    python -m bench.scale report bench/results/scale_dcp.json bench/results/scale_metadata.json \\
        --svg bench/results/scale.svg
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

try:  # a checkout (python -m bench.scale) or the wheel (python -m sparse_ckpt.bench.scale)
    from .. import provenance
    from ..suite.fixtures import parse_fixture_specs, parse_scales
    from .scale_async import run_async, run_async_threshold
    from .scale_dcp import PAIR, parse_size, run_dcp, run_spread, run_threshold
    from .scale_metadata import run_metadata
    from .scale_report import report
except ImportError:  # pragma: no cover - run as a script
    sys.exit("run bench.scale as a module: python -m bench.scale (or python -m sparse_ckpt.bench.scale)")

import sparse_ckpt as sc
from sparse_ckpt._layouts import STATE_LAYOUTS

DCP_FIXTURES = "24x128:h0,24x128:h64,4x16:h512,8x64:h64:e32768x64"
"""The ``dcp`` mode's fixtures: tiny tensors, 64x64 and 512x512 (1 MiB) weights, and the mixed one
(16 KiB expert state next to 8 MiB embedding state)."""
ASYNC_FIXTURES = "24x128:h64,4x16:h512,8x64:h64:e32768x64"
METADATA_FIXTURE = "61x256:h0:e32768x64"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _sizes(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",") if x.strip()]


def _layouts(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in STATE_LAYOUTS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"layouts must be among {STATE_LAYOUTS}, got {text!r}")
    return out


def _fixtures(args: argparse.Namespace, default: str) -> list[Any]:
    if args.fixtures:
        return parse_fixture_specs(args.fixtures)
    if args.scale is None:
        return parse_fixture_specs(default)
    (scale,) = parse_scales(args.scale)  # the earlier interface: --scale LxE --hidden a,b
    return parse_fixture_specs(",".join(f"{scale.label}:h{h}" for h in args.hidden))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("metadata", help="simulated .metadata of N ranks per layout (no processes)")
    m.add_argument("--fixture", "--scale", dest="fixture", default=METADATA_FIXTURE, help="LxE[:hH][:eVxD]")
    m.add_argument("--ranks", type=_ints, default=_ints("8,16,32,64,128,256,512,1024"))
    m.add_argument("--max-records", type=int, default=1_500_000, help="plan every k-th state tensor above this")
    m.add_argument("--check", type=_ints, default=[], help="ranks at which to compare a scaled row with a full one")
    m.add_argument("--check-sample", type=int, default=8)
    d = sub.add_parser("dcp", help="dcp.save/dcp.load of the whole optimizer per layout, and the floor")
    a = sub.add_parser("async", help="dcp.async_save: blocked and total time per layout vs stock DCP (DSD)")
    for sp, default in ((d, DCP_FIXTURES), (a, ASYNC_FIXTURES)):
        sp.add_argument("--fixtures", default=None, help=f"LxE[:hH][:eVxD],... (default {default})")
        sp.add_argument(
            "--scale", default=None, help="with --hidden: the fixtures LxE:hH for each H (earlier interface)"
        )
        sp.add_argument(
            "--hidden", type=_ints, default=[0, 64], help="with --scale: 0 tiny (2,) tensors, N (N, N) weights"
        )
    d.add_argument("--device", default="cpu")
    d.add_argument(
        "--spread",
        action="store_true",
        help="run twice, SPARSE_CKPT_HUGE_PAGES=1 and =0, and print min/median/max of the samples per layout",
    )
    t = sub.add_parser("threshold", help="dcp.save + dcp.load of equal-size state chunks: per-item vs buffers")
    t.add_argument(
        "--sizes", type=_sizes, default=_sizes("4K,16K,64K,256K,1M,4M,16M"), help="chunk sizes (bytes, K, M)"
    )
    t.add_argument("--total", type=parse_size, default=parse_size("64M"), help="state bytes per point, about")
    t.add_argument("--max-params", type=int, default=16_384, help="at most this many parameters per point")
    t.add_argument("--layouts", type=_layouts, default=list(PAIR))
    t.add_argument(
        "--async",
        dest="asynchronous",
        action="store_true",
        help="time how long dcp.async_save blocks (per_tensor vs buffers) instead of dcp.save/dcp.load",
    )
    for sp in (m, d, a):
        sp.add_argument("--layouts", type=_layouts, default=list(STATE_LAYOUTS), help=f"among {STATE_LAYOUTS}")
    for sp in (m, d, a, t):
        sp.add_argument(
            "--group-layout", default="layer", choices=("layer", "param"), help="one group per layer / param"
        )
        sp.add_argument("--repeats", type=int, default=3)
        sp.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
        sp.add_argument("--out", default=None, help="write the figures as JSON here")
    r = sub.add_parser("report", help="markdown tables and an SVG plot from the modes' JSON files")
    r.add_argument("inputs", nargs="+")
    r.add_argument("--svg", default=None, help="write the plot here")
    r.add_argument("--out", default=None, help="write the markdown here (else stdout)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The figures of ``args.mode``."""
    if args.mode == "metadata":
        (spec,) = parse_fixture_specs(args.fixture)
        return run_metadata(
            spec,
            args.group_layout,
            args.ranks,
            args.max_records,
            args.repeats,
            args.check,
            args.check_sample,
            tuple(args.layouts),
        )
    if args.mode == "dcp" and args.spread:
        return {
            "runs": run_spread(
                _fixtures(args, DCP_FIXTURES), args.group_layout, args.repeats, args.device, args.layouts
            ),
            "device": args.device,
            "spread": True,
        }
    if args.mode == "dcp":
        return {
            "runs": run_dcp(_fixtures(args, DCP_FIXTURES), args.group_layout, args.repeats, args.device, args.layouts),
            "device": args.device,
        }
    if args.mode == "async":
        return {"runs": run_async(_fixtures(args, ASYNC_FIXTURES), args.group_layout, args.repeats, args.layouts)}
    if args.asynchronous:
        return run_async_threshold(args.sizes, args.total, args.max_params, args.repeats)
    return run_threshold(args.sizes, args.total, args.max_params, args.repeats, args.layouts)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode == "report":
        text = report(args.inputs, args.svg)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
            print(f"wrote {args.out}")
        else:
            print(text)
        return 0
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    result = {"mode": args.mode, **run(args)}
    result.update(
        {
            "command": " ".join(["python -m bench.scale", *(argv if argv is not None else sys.argv[1:])]),
            "layouts": list(args.layouts),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "backend": sc.backend(),
            "cpu_count": os.cpu_count(),
            "repeats": args.repeats,
            "torch_threads": torch.get_num_threads(),
            "total_s": time.perf_counter() - t0,
            "provenance": provenance.record(),
        }
    )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
