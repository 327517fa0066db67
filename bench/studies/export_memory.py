"""Peak memory of ``export_checkpoint``: its streaming safetensors writer vs ``safetensors.torch.save_file``.

    python -m bench.export_memory                              # 61x256, 64x64 weights (~20 min on 2 cores)
    python -m bench.export_memory --scale 4x16 --hidden 16     # seconds
    python -m bench.export_memory --layouts per_tensor,buffers # also a state_layout="buffers" checkpoint

Builds the bench fixture (DeepSeek-V3 shaped MoE, AdamW with state for the dense parameters and
half the experts, one group per layer), saves it with ``dcp.save`` of a ``SparseOptimizerState``
(once per ``--layouts`` entry: ``per_tensor``, the default, and/or ``buffers``), then exports it
once per variant, each in a fresh interpreter that does nothing else:

* ``stream``: :func:`sparse_ckpt.export.export_checkpoint` as shipped (state read
  ``batch_bytes`` at a time, each batch written and dropped);
* ``save_file``: the same export with the writer replaced by "collect every tensor into a dict,
  then ``safetensors.torch.save_file``" (what using the library directly means).

A ``buffers`` checkpoint is exported with ``stream`` only (the variants differ in the writer,
not in the reading). Per export: the child's peak RSS (``VmHWM`` of ``/proc/self/status``: the high-water mark of
this process image), its RSS just before the export (``VmRSS``), the difference (what the export
added at its peak), the wall time, the buckets read (``buffer_reads``, ``buffer_bytes_read``) and
a digest of ``optimizer.safetensors`` (the ``stream`` exports of every layout must be equal). Not
``resource.getrusage(RUSAGE_SELF).ru_maxrss``: Linux
carries the parent's high-water mark over ``fork``/``exec`` into it, so every child would report
at least the RSS of the process that built the fixture. Not ``tracemalloc``: torch allocates
tensor memory outside Python's allocator. The fixture is built and saved in a child of its own
too. Results as JSON (``--out``); ``--dir`` keeps the checkpoint and reuses it on the next run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from typing import Any

from .. import provenance

VARIANTS = ("stream", "save_file")
LAYOUTS = ("per_tensor", "buffers")
LEAF = "optim"


def _status_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def _save_file_writer(path: str, layout: Any, tensors: Iterable[tuple[str, Any]], metadata: Mapping[str, str]) -> int:
    """Drop-in for the export's streaming writer: every tensor into one dict, then the library."""
    from safetensors.torch import save_file

    save_file(dict(tensors), path, metadata=dict(metadata))
    return os.path.getsize(path)


def child(variant: str, ckpt: str, out: str) -> dict[str, Any]:
    """Export ``ckpt`` to ``out`` with ``variant``'s writer; memory and time of the export."""
    import safetensors.torch  # noqa: F401 - imported before the baseline, like the export's own imports

    from sparse_ckpt.tools import export  # the implementing module: its writer is swapped below

    if variant == "save_file":
        export.write_safetensors = _save_file_writer  # type: ignore[assignment]
    before = _status_bytes("VmRSS")
    t0 = time.perf_counter()
    summary = export.export_checkpoint(ckpt, out, key=LEAF)
    seconds = time.perf_counter() - t0
    peak = _status_bytes("VmHWM")
    digest = hashlib.blake2b(digest_size=16)
    with open(os.path.join(out, export.TENSORS_FILE), "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return {
        "variant": variant,
        "rss_before": before,
        "peak_rss": peak,
        "export_peak": peak - before,
        "seconds": seconds,
        "tensors": summary.tensors,
        "tensor_bytes": summary.tensor_bytes,
        "file_bytes": summary.file_bytes,
        "buffer_reads": summary.buffer_reads,
        "buffer_bytes_read": summary.buffer_bytes_read,
        "tensors_digest": digest.hexdigest(),
    }


def build_checkpoint(scale: str, hidden: int, path: str, layout: str = "per_tensor") -> dict[str, Any]:
    """Save the bench fixture's optimizer at ``scale`` with ``dcp.save`` (``state_layout=layout``); its sizes."""
    import sparse_ckpt as sc

    from ..suite.fixtures import FixtureCache, parse_scales
    from ..suite.measure import dcp_save

    fx = FixtureCache(hidden=hidden).get(parse_scales(scale)[0], "layer")
    dcp_save({LEAF: sc.SparseOptimizerState(fx.model, fx.optimizer, state_layout=layout)}, path)  # type: ignore[arg-type]
    return dict(fx.info)


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.export_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--scale", default="61x256", help="LAYERSxEXPERTS (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=64, help="weights are HIDDENxHIDDEN (default: %(default)s)")
    parser.add_argument("--dir", help="scratch directory (default: a temporary one, removed at the end)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument(
        "--layouts",
        default="per_tensor",
        help="state layouts to save and export, comma-separated: per_tensor, buffers (default: %(default)s)",
    )
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "CKPT", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="per_tensor", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",")
    if not set(layouts) <= set(LAYOUTS):
        parser.error(f"--layouts: choose from {', '.join(LAYOUTS)}")
    if args.child:
        variant, ckpt, out = args.child
        if variant == "build":
            result = build_checkpoint(args.scale, args.hidden, ckpt, args.layout)
        else:
            result = child(variant, ckpt, out)
        print(json.dumps(result))
        return 0
    module = __spec__.name if __spec__ is not None else "bench.export_memory"

    def run_child(variant: str, ckpt: str, out: str, layout: str) -> dict[str, Any]:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                module,
                "--scale",
                args.scale,
                "--hidden",
                str(args.hidden),
                "--layout",
                layout,
                "--child",
                variant,
                ckpt,
                out,
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    scratch = args.dir or tempfile.mkdtemp(prefix="export_memory_")
    try:
        rows = []
        for layout in layouts:
            suffix = "" if layout == "per_tensor" else f"_{layout}"  # a per_tensor checkpoint kept by --dir stays valid
            ckpt = os.path.join(scratch, f"ckpt_{args.scale}_{args.hidden}{suffix}")
            info_path = ckpt + ".json"
            if not os.path.isfile(info_path):
                info = run_child("build", ckpt, "", layout)
                with open(info_path, "w") as f:
                    json.dump(info, f)
            with open(info_path) as f:
                info = json.load(f)
            for variant in VARIANTS if layout == "per_tensor" else VARIANTS[:1]:
                out = os.path.join(scratch, f"export_{variant}")
                shutil.rmtree(out, ignore_errors=True)
                rows.append({"layout": layout, **run_child(variant, ckpt, out, layout)})
                shutil.rmtree(out)
        if len({(r["tensors"], r["tensor_bytes"]) for r in rows}) != 1:
            raise SystemExit(f"the variants exported different contents: {rows}")
        if len({r["tensors_digest"] for r in rows if r["variant"] == "stream"}) != 1:  # save_file orders its own way
            raise SystemExit(f"the layouts exported different safetensors files: {rows}")
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    result = {"scale": args.scale, "hidden": args.hidden, "fixture": info, "variants": rows}
    result["provenance"] = provenance.record()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(
        f"{args.scale}, {args.hidden}x{args.hidden} weights: {rows[0]['tensors']} state tensors, "
        f"{mib(rows[0]['tensor_bytes'])} of state"
    )
    for r in rows:
        reads = f", {r['buffer_reads']} bucket reads ({mib(r['buffer_bytes_read'])})" if r["buffer_reads"] else ""
        print(
            f"  {r['layout']:<10} {r['variant']:<9}  peak RSS {mib(r['peak_rss'])} (before export "
            f"{mib(r['rss_before'])}, export added {mib(r['export_peak'])}), {r['seconds']:.1f} s{reads}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
