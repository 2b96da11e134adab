"""The token cache maker's peak private memory (RssAnon, sampled every 10 ms, less before) by phase: ``convert``
(datasets makes the Arrow copies and every record is checked), ``tokenise`` (records streamed, tokens written),
``rows`` (the sets' files finished). The corpus is benchmarks/token_rows.py's: COPIES copies of the Brown prose and
COPIES x 2,400 chat records.

    flock -o /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/results/token-rows-maker-phases.py COPIES

Printed on 2026-11-30 at 2e8b431 (MiB): 10 -> convert 140, tokenise 113; 20 (two runs) -> convert 145 / 158,
tokenise 113 / 132. The peak is flat in the corpus within the runs' spread; datasets' conversion is its top.
"""

import os
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(copies: int) -> None:
    import token_rows
    from transformers import AutoTokenizer

    from swiftkv_core.default_model import default_model_path
    from swiftkv_distill import datamodule
    from swiftkv_distill.datamodule import DistillDataModule

    folder = Path(tempfile.mkdtemp())
    os.environ["SWIFTKV_TOKENS_DIR"] = str(folder / "tokens")
    files = token_rows.make_corpus(folder, copies, copies * 2400)
    phase, peaks, done = ["start"], {}, threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peaks[phase[0]] = max(peaks.get(phase[0], 0), token_rows.rss_anon() // 2**20)

    record_sets, rows = datamodule.record_sets, datamodule.RowWriter.rows

    def converting(*args, **kwargs):
        phase[0] = "convert"
        sets = record_sets(*args, **kwargs)
        phase[0] = "tokenise"
        return sets

    def finishing(writer):
        phase[0] = "rows"
        return rows(writer)

    datamodule.record_sets, datamodule.RowWriter.rows = converting, finishing
    AutoTokenizer.from_pretrained(default_model_path())  # outside the figure, as in token_rows.py
    base = token_rows.rss_anon() // 2**20
    threading.Thread(target=sample, daemon=True).start()
    DistillDataModule("default", files, val_fraction=0.0, max_length=8192).build()
    done.set()
    print(copies, {name: peak - base for name, peak in peaks.items()})


if __name__ == "__main__":
    main(int(sys.argv[1]))
