"""Distillation data at scale: what each process of a run spends on its rows (time, memory), the rows as Python lists
built in every process (the baseline: the layout before the token cache) vs the token cache (made once, then
memory-mapped by every process; ``swiftkv_distill.tokens``).

The corpus is made locally: copies of the Brown prose (text records) and chat records (the chatterbot prompts,
numbered so that no two are the same, answered with Brown paragraphs), packed into rows of ``max_length`` tokens.

- ``lists``: one process encodes every record, one at a time, and packs the rows as lists of ints, as each
  process of a run did before (measured once: each process of a run did the same);
- ``made``: one process makes the rows into an empty token cache (chat records in a process per core);
- ``read``: ``readers`` processes at once build their data module from the made cache, as the other processes of a
  run (and every resumed run) do.

Memory is each process's PSS after its build, less before, with every row's tokens read and (readers) every reader
there: pages shared by the processes (the mapped cache) count 1/n in each of n. The peak is the most private
(anonymous) memory the process held during its build, less before: what the maker needs while it reads and packs,
whatever the page cache keeps of the files (the maker's forked encoders, a tokenizer and a chunk of records each, are
not in it). The tokenizer loaded before the build is outside the figure (the data module's own is inside).

    .venv/bin/python benchmarks/token_rows.py      # 10 Brown copies + 24k chat records, 4 readers
Writes benchmarks/results/NAME.{json,md} (``--name``, default token-rows).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PAPER_TOKENS, PAPER_PROCESSES = 680e6, 8  # the paper's distillation: 680M tokens, 8 GPUs of a node


def make_corpus(folder: Path, text_copies: int, chat_records: int) -> list[str]:
    """The text and chat files of the corpus, in ``folder``: chat records are the chatterbot prompts, numbered,
    answered with Brown paragraphs (what the answers say does not change the work of tokenising them)."""
    from swiftkv_distill.corpora import prepare

    brown = prepare("brown_train").read_text()
    text = folder / "text.jsonl"
    text.write_text(brown * text_copies)
    prompts = [json.loads(line)["prompt"] for line in prepare("chat_prompts").open()]
    paragraphs = [json.loads(line)["text"] for line in brown.splitlines()]
    chat = folder / "chat.jsonl"
    with chat.open("w") as f:
        for i in range(chat_records):
            answer = paragraphs[i % len(paragraphs)]
            f.write(json.dumps({"prompt": f"{prompts[i % len(prompts)]} ({i})", "response": answer}) + "\n")
    return [str(text), str(chat)]


def list_rows(files: list[str], tokenizer, max_length: int) -> list[dict]:
    """The baseline: every record encoded in this process, the rows packed as lists (the layout before)."""
    from swiftkv_distill.data import encode_record, load_records

    rows, row = [], {"input_ids": [], "segments": [], "distilled": []}
    for record in load_records(files):
        ids, flags = encode_record(record, tokenizer)
        while ids:
            take = min(len(ids), max_length - len(row["input_ids"]))
            row["input_ids"] += ids[:take]
            row["distilled"] += flags[:take]
            row["segments"].append(take)
            ids, flags = ids[take:], flags[take:]
            if len(row["input_ids"]) == max_length:
                rows.append(row)
                row = {"input_ids": [], "segments": [], "distilled": []}
    return rows + ([row] if row["input_ids"] else [])


def measure(role: str, files: list[str], max_length: int) -> dict:
    """One process's build (``lists`` or the data module's), its seconds, PSS (every row's tokens read) and peak
    private memory."""
    import numpy as np
    import psutil
    from transformers import AutoTokenizer

    from swiftkv_core.default_model import default_model_path
    from swiftkv_distill.datamodule import DistillDataModule

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    process = psutil.Process()
    before = process.memory_full_info().pss
    peak = PeakPrivate()
    start = time.perf_counter()
    if role == "lists":
        rows = list_rows(files, tokenizer, max_length)
    else:
        data = DistillDataModule("default", files, val_fraction=0.0, max_length=max_length)
        data.build()
        rows = data.train_rows
    seconds = time.perf_counter() - start
    peak_bytes = peak.stop()
    tokens = sum(len(rows[i]["input_ids"]) for i in range(len(rows)))
    checksum = sum(int(np.asarray(rows[i]["input_ids"], np.int64).sum()) for i in range(len(rows)))
    together(os.environ.get("TOKEN_ROWS_TOGETHER"))
    pss = process.memory_full_info().pss - before
    return {
        "role": role,
        "seconds": seconds,
        "tokens": tokens,
        "checksum": checksum,
        "pss_bytes": pss,
        "peak_bytes": peak_bytes,
    }


class PeakPrivate:
    """The most private (anonymous) memory the process held while it built its rows, less what it held before:
    sampled every 10 ms from ``/proc/self/status`` (``RssAnon``). Mapped files' pages are not in it (the page cache
    can drop them)."""

    def __init__(self):
        import threading

        self.start = self.peak = rss_anon()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.01):
            self.peak = max(self.peak, rss_anon())

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.peak, rss_anon()) - self.start


def rss_anon() -> int:
    """The process's private (anonymous) resident bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon: this benchmark needs Linux")


def together(spec: str | None) -> None:
    """Wait until every process of the group (``FOLDER:COUNT``) is here: the readers measure their memory while all
    of them map the cache, each page then shared by all."""
    if not spec:
        return
    folder, count = spec.rsplit(":", 1)
    Path(folder, str(os.getpid())).touch()
    while len(os.listdir(folder)) < int(count):
        time.sleep(0.05)


def run(role: str, files: list[str], max_length: int, processes: int = 1) -> list[dict]:
    """``processes`` processes of ``role`` started at once; their measurements."""
    command = [
        sys.executable,
        __file__,
        "--worker",
        role,
        "--files",
        json.dumps(files),
        "--max_length",
        str(max_length),
    ]
    group = tempfile.mkdtemp()
    env = {**os.environ, "TOKEN_ROWS_TOGETHER": f"{group}:{processes}"}
    started = [
        subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) for _ in range(processes)
    ]
    out = []
    for child in started:
        stdout, _ = child.communicate()
        if child.returncode:
            raise SystemExit(f"{role} process failed with exit code {child.returncode}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main(
    text_copies: int = 10,
    chat_records: int = 24_000,
    readers: int = 4,
    max_length: int = 8192,
    name: str = "token-rows",
    worker: str | None = None,
    files: str = "[]",
) -> None:
    """Args:
    text_copies: copies of the Brown training prose in the corpus.
    chat_records: prompt + response records in the corpus.
    readers: processes reading the made cache at once.
    max_length: tokens per packed row.
    name: the results' file name in benchmarks/results (.json and .md).
    worker / files: internal (one measuring process).
    """
    if worker:
        print(json.dumps(measure(worker, json.loads(files), max_length)), flush=True)
        return
    with tempfile.TemporaryDirectory() as folder:
        os.environ["SWIFTKV_TOKENS_DIR"] = str(Path(folder) / "tokens")
        corpus = make_corpus(Path(folder), text_copies, chat_records)
        (lists,) = run("lists", corpus, max_length)
        print(
            f"lists: {lists['seconds']:.1f} s, {lists['pss_bytes'] / lists['tokens']:.1f} B/token, peak"
            f" {lists['peak_bytes'] / 2**20:.0f} MiB",
            flush=True,
        )
        (made,) = run("made", corpus, max_length)
        print(
            f"made: {made['seconds']:.1f} s, {made['pss_bytes'] / 2**20:.0f} MiB, peak"
            f" {made['peak_bytes'] / 2**20:.0f} MiB",
            flush=True,
        )
        read = run("read", corpus, max_length, readers)
    if (
        len({r["checksum"] for r in [lists, made, *read]}) != 1
        or len({r["tokens"] for r in [lists, made, *read]}) != 1
    ):
        raise SystemExit("the rows differ between the layouts: not comparable")
    tokens = lists["tokens"]
    slowest = max(read, key=lambda r: r["seconds"])
    largest = max(read, key=lambda r: r["pss_bytes"])
    result = {
        "corpus": {
            "text_copies": text_copies,
            "chat_records": chat_records,
            "tokens": tokens,
            "max_length": max_length,
        },
        "cores": len(os.sched_getaffinity(0)),
        "readers": readers,
        **{
            name: {
                "seconds": r["seconds"],
                "mib": r["pss_bytes"] / 2**20,
                "peak_mib": r["peak_bytes"] / 2**20,
                "bytes_per_token": r["pss_bytes"] / tokens,
            }
            for name, r in (("lists", lists), ("made", made))
        },
        "read": {
            "seconds": slowest["seconds"],
            "mib": largest["pss_bytes"] / 2**20,
            "peak_mib": max(r["peak_bytes"] for r in read) / 2**20,
        },
    }
    write(result, name)


def write(result: dict, name: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    c, lists, made, read = result["corpus"], result["lists"], result["made"], result["read"]

    def row(name: str, r: dict) -> str:
        return (
            f"| {name} | {r['seconds']:.2f} | {lists['seconds'] / r['seconds']:.1f}x |"
            f" {r['mib']:,.0f} | {lists['mib'] / r['mib']:.1f}x | {r['peak_mib']:,.0f} |"
        )

    paper_gib = lists["bytes_per_token"] * PAPER_TOKENS * PAPER_PROCESSES / 2**30
    lines = [
        "# Distillation rows: Python lists in every process vs the token cache",
        "",
        "Command: `flock -o /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/token_rows.py"
        f" --text_copies {c['text_copies']} --chat_records {c['chat_records']} --readers {result['readers']}"
        f" --max_length {c['max_length']}" + ("" if name == "token-rows" else f" --name {name}") + "`",
        "",
        f"Corpus: {c['tokens']:,} tokens ({c['text_copies']} copies of the Brown prose, {c['chat_records']:,} chat"
        f" records), rows of {c['max_length']} tokens; {result['cores']} cores. Memory: the process's PSS after its"
        " build, less before, with every row's tokens read (the mapped cache's pages count 1/n in each of n"
        " processes); peak: the most private (anonymous) memory it held while it built them, less before.",
        "",
        "| process | seconds | lists / this | MiB | lists / this | peak MiB |",
        "|---|---|---|---|---|---|",
        row("lists: each process, before", lists),
        row("made: the first process, into an empty cache", made),
        row(f"read: each of {result['readers']} processes at once (the slowest, the largest)", read),
        "",
        f"Lists hold {lists['bytes_per_token']:.0f} bytes a token in every process. Arithmetic, not measured: at the"
        f" paper's {PAPER_TOKENS / 1e6:.0f}M tokens on the {PAPER_PROCESSES} processes of a node that is"
        f" {paper_gib:,.0f} GiB of host memory, and each process tokenises everything. The cache is 5 bytes a token"
        f" on disk and once in the page cache ({PAPER_TOKENS * 5 / 2**30:.1f} GiB), made by one process; a reader's"
        " own memory is its tokenizer and the rows' index, whatever the tokens. The maker streams the records and"
        f" writes the tokens as it goes: its main process's private memory peaked at {made['peak_mib']:,.0f} MiB (the lists"
        f" {lists['peak_mib']:,.0f} MiB).",
        "",
    ]
    (RESULTS / f"{name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main, as_positional=False)
