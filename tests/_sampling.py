"""What the README's test commands sample and CI runs in full (tests/README.md).

``SPARSE_CKPT_EXHAUSTIVE_SWEEPS=1``, which .ci/run sets for the full suite, turns every sample into
the whole: the interrupt sweeps interrupt every line event, the launcher drills launch the stock
launcher in each drill, and the multi-rank tests run on both core backends. Each sampling module
says what its default run leaves to CI.
"""

from __future__ import annotations

import os

EXHAUSTIVE = os.environ.get("SPARSE_CKPT_EXHAUSTIVE_SWEEPS") == "1"
"""``SPARSE_CKPT_EXHAUSTIVE_SWEEPS=1`` (.ci/run sets it): run in full what the default run samples."""
