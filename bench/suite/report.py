"""Turn the bench's results into ``results.json``, ``results.md`` and the figures (:func:`write_all`).

The report has one module per role: :mod:`.verdicts` (the targets, computed as ratios, and their
PASS / MISS / INDICATIVE / N/A status; a report, never an assertion), :mod:`.information` (ratios
without a verdict and the growth table of every figure), :mod:`.report_markdown` (``results.md``)
and :mod:`.plots` (``headline.png``, ``scaling.png``, ``core.png``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from .information import compute_info
from .plots import write_plots
from .report_markdown import render_markdown
from .verdicts import compute_targets, targets_mode


def write_all(results: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Write results.json, results.md and the figures; return ``{"json", "md", "pngs", "plot_message"}``."""
    os.makedirs(out_dir, exist_ok=True)
    results["targets"] = compute_targets(results)
    results["info"] = compute_info(results)
    judged, why = targets_mode(results)
    results["targets_mode"] = {"judged": judged, "why": why}
    json_path = os.path.join(out_dir, "results.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, default=str)
        f.write("\n")
    md_path = os.path.join(out_dir, "results.md")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(render_markdown(results))
    pngs, msg = write_plots(results, out_dir)
    return {"json": json_path, "md": md_path, "pngs": pngs, "plot_message": msg}
