"""What the training rows' digest (``TokenRows.sha256``, recorded in the token cache and compared on a resume) costs:
100M random tokens written as the cache writes them (rows of 8192, sequences of 1024), then digested twice, both
times from the page cache (the rows were just written), against the tokenisation's own rate in ``token-rows.md``.

    flock -o /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/results/token-rows-digest.py
"""

import tempfile
import time
from pathlib import Path

import numpy as np

from swiftkv_distill.tokens import RowWriter

TOKENS = 100_000_000
with tempfile.TemporaryDirectory() as folder:
    writer, rng = RowWriter(8192, into=Path(folder) / "train"), np.random.default_rng(0)
    for _ in range(10):
        ids = rng.integers(0, 128_000, TOKENS // 10, dtype=np.int32)
        writer.add_many(ids, np.ones(len(ids), bool), [1024] * (len(ids) // 1024) + [len(ids) % 1024])
    rows = writer.rows()
    for run in ("first", "again"):
        started = time.perf_counter()
        rows.sha256()
        seconds = time.perf_counter() - started
        print(
            f"sha256 of {TOKENS / 1e6:.0f}M tokens' rows ({run}): {seconds:.2f} s, {TOKENS / seconds / 1e6:.0f}M tokens/s"
        )
