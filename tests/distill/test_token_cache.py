"""Token rows as flat arrays (``tokens.py``), made once into the token cache and memory-mapped by every process."""

import errno
import functools
import json
import multiprocessing
import os
import pickle
import random

import numpy as np
import pytest
import torch

from swiftkv_distill.batches import collate, pack, unpacked
from swiftkv_distill.data import DataError
from swiftkv_distill.datamodule import DistillDataModule
from swiftkv_distill.tokens import RowWriter, TokenRows, cache_unwritable, read_sets, set_sha256, write_sets
from tests.distill.conftest import TEXTS, write_jsonl
from tests.processes import children_of, running


def reference_rows(sequences, max_length, distilled, packed):
    """Rows as Python lists, the layout the arrays replace: packed (a sequence crossing a row's end goes on in the
    next row) or one per sequence, truncated."""
    if not packed:
        return [
            {"input_ids": s[:max_length], "segments": [min(len(s), max_length)], "distilled": f[:max_length]}
            for s, f in zip(sequences, distilled, strict=True)
            if s
        ]
    rows, row = [], {"input_ids": [], "segments": [], "distilled": []}
    for sequence, flags in zip(sequences, distilled, strict=True):
        while sequence:
            take = min(len(sequence), max_length - len(row["input_ids"]))
            row["input_ids"] += sequence[:take]
            row["distilled"] += flags[:take]
            row["segments"].append(take)
            sequence, flags = sequence[take:], flags[take:]
            if len(row["input_ids"]) == max_length:
                rows.append(row)
                row = {"input_ids": [], "segments": [], "distilled": []}
    return rows + ([row] if row["input_ids"] else [])


def as_lists(rows):
    return [{k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in row.items()} for row in rows]


def test_rows_as_arrays_are_the_rows_as_lists(tmp_path):
    """Random sequences (empty ones, ones longer than a row, ones ending exactly at a row's end) and flags: the same
    rows, segments and flags packed and unpacked, in memory and written to files as they come, and the same
    batches."""
    rng = random.Random(0)
    for max_length in (1, 7, 16):
        sequences = [
            [rng.randrange(50_000) for _ in range(rng.choice([0, 1, 5, 7, 16, 30]))] for _ in range(40)
        ]
        distilled = [[rng.random() < 0.7 for _ in s] for s in sequences]
        for packed, shape in ((True, pack), (False, unpacked)):
            rows = shape(sequences, max_length, distilled)
            expected = reference_rows(sequences, max_length, distilled, packed)
            assert as_lists(rows) == expected
            assert as_lists(rows[3:9:2]) == expected[3:9:2] and as_lists(rows[[5, 1]]) == [
                expected[5],
                expected[1],
            ]
            for name, tensor in collate(rows, 0, max_length).items():
                torch.testing.assert_close(tensor, collate(expected, 0, max_length)[name])
            # written as they come, in three calls of several sequences each; then mapped as the cache maps them
            writer = RowWriter(max_length, packed, into=tmp_path / f"{max_length}-{packed}")
            for part in (range(13), range(13, 14), range(14, len(sequences))):
                writer.add_many(
                    np.array([t for i in part for t in sequences[i]], np.int32),
                    np.array([f for i in part for f in distilled[i]], bool),
                    [len(sequences[i]) for i in part],
                )
            written = writer.rows()
            assert isinstance(written.arrays["tokens"], np.memmap) and as_lists(written) == expected
            assert as_lists(TokenRows.load(tmp_path, f"{max_length}-{packed}")) == expected
    empty = RowWriter(8, into=tmp_path / "empty").rows()
    assert len(empty) == 0 and len(TokenRows.load(tmp_path, "empty").arrays["tokens"]) == 0


def test_a_sets_digest_is_of_its_rows_alone(tmp_path):
    """The digest a resume compares (``training_rows_sha256``): the same rows in memory, written, or in a cache
    written before digests were recorded give one digest; another token, another flag, or another cut of the same
    tokens gives another. A selection's is its set's."""
    ids, flags = np.arange(40, dtype=np.int32), np.ones(40, bool)

    def digest(ids=ids, flags=flags, lengths=(10, 30), max_length=16, into=None):
        writer = RowWriter(max_length, into=into)
        writer.add_many(ids, flags, lengths)
        return writer.rows().sha256()

    one = digest()
    assert digest(into=tmp_path / "train") == one
    write_sets(tmp_path, {"train": TokenRows.load(tmp_path, "train")}, {})
    assert set_sha256(tmp_path, "train") == one
    sets = json.loads((tmp_path / "sets.json").read_text())
    del sets["sets"]["train"]["sha256"]
    (tmp_path / "sets.json").write_text(json.dumps(sets))
    assert set_sha256(tmp_path, "train") == one
    other_token, other_flag = ids.copy(), flags.copy()
    other_token[5], other_flag[5] = 99, False
    others = {
        digest(ids=other_token),
        digest(flags=other_flag),
        digest(lengths=(20, 20)),
        digest(max_length=8),
    }
    assert len(others) == 4 and one not in others
    assert TokenRows.load(tmp_path, "train")[1:].sha256() == one


def test_the_rows_are_made_once_and_read_after(tiny_model, tmp_path, monkeypatch):
    """A second data module on the same data, tokenizer and row settings reads the rows the first made: it does not
    tokenise. Another file content (also one that keeps the older file's modification time) or another row length
    makes new rows; a cap on the rows does not."""
    made = []
    tokenise = DistillDataModule._tokenise
    monkeypatch.setattr(DistillDataModule, "_tokenise", lambda self, *a: made.append(1) or tokenise(self, *a))
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in TEXTS])

    def rows(file=data, **settings):
        dm = DistillDataModule(
            str(tiny_model), [str(file)], **{"max_length": 32, "val_fraction": 0.2, **settings}
        )
        dm.build()
        return as_lists(dm.train_rows), as_lists(dm.val_rows)

    first = rows()
    assert rows() == first and len(made) == 1
    train, _ = rows(max_train_rows=3)
    assert len(made) == 1 and len(train) == 3 and all(row in first[0] for row in train)
    assert rows(max_length=16) != first and len(made) == 2
    write_jsonl(data, [{"text": t.upper()} for t in TEXTS])
    upper = rows()
    assert upper != first and len(made) == 3
    # a copy that keeps the older file's modification time (cp -p) and size: its own rows, not the older copy's
    # (only the change time tells them apart)
    stat = data.stat()
    write_jsonl(data, [{"text": t.lower()} for t in TEXTS])
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (data.stat().st_size, data.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    fresh = write_jsonl(tmp_path / "fresh.jsonl", [{"text": t.lower()} for t in TEXTS])
    copied = rows()
    assert len(made) == 4 and copied != upper and copied == rows(fresh)


def test_validation_sets_in_another_order_keep_their_own_rows(tiny_model, text_file, chat_file):
    """The sets are kept by position: the same sets named in another order are other rows, not each other's."""
    rows = {}
    for sets in (
        {"text": [str(text_file)], "chat": [str(chat_file)]},
        {"chat": [str(chat_file)], "text": [str(text_file)]},
    ):
        dm = DistillDataModule(str(tiny_model), [str(text_file)], val_files=sets, max_length=32)
        dm.build()
        rows[tuple(sets)] = {name: as_lists(dm.val_set_rows[name]) for name in sets}
    assert (
        rows[("text", "chat")] == rows[("chat", "text")]
        and rows[("text", "chat")]["text"] != rows[("text", "chat")]["chat"]
    )


def test_a_token_cache_that_cannot_be_written_is_refused_clearly(
    tiny_model, text_file, tmp_path, monkeypatch
):
    """A file where the cache or a folder above it should be (tests run as root: permissions would not stop
    them). A data file that cannot be read keeps its own error."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    for folder in (not_a_folder, not_a_folder / "tokens"):
        monkeypatch.setenv("SWIFTKV_TOKENS_DIR", str(folder))
        with pytest.raises(DataError, match="token cache .* cannot be written .* Set SWIFTKV_TOKENS_DIR"):
            DistillDataModule(str(tiny_model), [str(text_file)], max_length=16).build()
    # the same errors, of a file outside the cache (a data file's, the datasets library's), are not the cache's
    monkeypatch.setenv("SWIFTKV_TOKENS_DIR", str(tmp_path / "tokens"))
    for code in (errno.ENOTDIR, errno.EACCES, errno.ENOSPC):
        assert cache_unwritable(
            OSError(code, os.strerror(code), str(tmp_path / "tokens" / "abc" / "tokens.npy"))
        )
        assert not cache_unwritable(OSError(code, os.strerror(code), str(tmp_path / "data" / "chat.jsonl")))
        assert not cache_unwritable(OSError(code, os.strerror(code), str(tmp_path / "tokens-chat.jsonl")))
    assert not cache_unwritable(OSError(errno.EISDIR, "Is a directory", str(tmp_path / "tokens" / "abc")))
    monkeypatch.chdir(tmp_path)  # a relative cache folder, an error naming its absolute path (mkstemp's)
    monkeypatch.setenv("SWIFTKV_TOKENS_DIR", "tokens")
    assert cache_unwritable(
        OSError(errno.ENOSPC, "No space left", str(tmp_path / "tokens" / "abc" / "t.npy"))
    )


FULL_DISK = """
import os, resource, signal, sys
from pathlib import Path
from swiftkv_distill.data import DataError
from swiftkv_distill.datamodule import DistillDataModule
model, data, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    DistillDataModule(model, [data], max_length=64, val_fraction=0.1).build()
except DataError as error:
    print("DataError:", error)
cache = os.environ["SWIFTKV_TOKENS_DIR"]
links = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
print("open:", [link for link in links if link.startswith(cache)])
print("left:", sorted(str(p.relative_to(cache)) for p in Path(cache).rglob("*") if p.is_file() and "lock" not in p.name))
"""


def test_a_token_cache_that_fills_up_is_refused_clearly(tiny_model, tmp_path, monkeypatch):
    """A real process whose writes fail past a size (as on a full disk): while ``datasets`` copies the data, and
    later while the tokens are written. Each time the cache's error, no file left open, nothing left behind."""
    import subprocess
    import sys

    data = write_jsonl(
        tmp_path / "letters.jsonl", [{"text": " ".join("abcdefghij" * 40)}] * 50
    )  # ~20k tokens
    monkeypatch.setenv("SWIFTKV_TOKENS_DIR", str(tmp_path / "tokens"))
    # under the Arrow copy (~40 KB), under the tokens (4 bytes a token)
    for limit, failing in ((4096, "/.arrow-"), (60_000, "/train.tokens.npy")):
        out = subprocess.run(
            [sys.executable, "-c", FULL_DISK, str(tiny_model), str(data), str(limit)],
            capture_output=True, text=True, timeout=300, check=True,
        ).stdout  # fmt: skip
        assert "DataError: The token cache" in out and "cannot be written (File too large" in out, out
        assert failing in out.split("cannot be written")[1].split(")")[0], out
        assert "open: []" in out and "left: []" in out, out


KILLED_MAKER = """
import sys
from swiftkv_distill import data, datamodule
data.CHUNK = 4  # chunks of 4 records, encoded by 2 forked processes
datamodule.encoding_processes = lambda kinds, records: 2
datamodule.DistillDataModule(sys.argv[1], [sys.argv[2]], max_length=16, val_fraction=0.2).build()
"""


def test_what_a_killed_maker_left_is_deleted_by_a_later_one(tiny_model, tmp_path, monkeypatch):
    """A real process SIGKILLed while it writes the rows, its records encoded by forked processes, leaves its
    staging folder and the Arrow copies of its data in the token cache. A maker of other rows leaves them alone while
    that process lives (it holds their locks). Its encoders die with it (they share its locks): a maker of the same
    rows does not wait for it, and one of other rows deletes what it left."""
    import fcntl
    import subprocess
    import sys
    import time

    cache = tmp_path / "tokens"
    monkeypatch.setenv("SWIFTKV_TOKENS_DIR", str(cache))

    def build(data):
        DistillDataModule(str(tiny_model), [str(data)], max_length=16, val_fraction=0.2).build()

    turns = [[{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}] for t in TEXTS]
    killed = write_jsonl(tmp_path / "killed.jsonl", [{"messages": m} for m in turns])
    maker = subprocess.Popen(
        [sys.executable, "-c", KILLED_MAKER, str(tiny_model), str(killed)],
        env={**os.environ, "SWIFTKV_PAUSE_AT": "token-rows"}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        said = ""
        for line in maker.stderr:
            said += line
            if line.startswith("SWIFTKV_PAUSED token-rows"):
                break
        assert maker.poll() is None, said  # paused, not ended
        (staging,), (arrow,) = cache.glob(".*.staging.*"), cache.glob(".arrow-*")
        assert (staging / "train.tokens.npy").is_file() and any(arrow.rglob("*.arrow"))
        encoders = children_of(maker.pid)
        assert len(encoders) == 2
        for folder in (staging, arrow):
            os.utime(folder, (0, 0))  # old enough to be taken for abandoned, were they not locked
        build(write_jsonl(tmp_path / "alive.jsonl", [{"text": t} for t in TEXTS]))
        assert staging.is_dir() and arrow.is_dir()
    finally:
        maker.kill()
        maker.wait()
    deadline = time.monotonic() + 30
    while any(map(running, encoders)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(running, encoders)), "the encoders outlived their maker"
    for lock in cache.glob(".*.lock"):  # a maker of any rows, the killed one's too, takes its turn at once
        with open(lock) as file:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    build(write_jsonl(tmp_path / "dead.jsonl", [{"text": t.upper()} for t in TEXTS]))
    assert not staging.exists() and not arrow.exists()
    entries = [p for p in cache.iterdir() if not p.name.endswith(".lock")]
    assert len(entries) == 2 and all((entry / "sets.json").is_file() for entry in entries)


def build_in_a_process(model: str, data: str, marker: str, queue) -> None:
    """One process of a run: builds the data module, says whether it tokenised and what its rows hold."""
    tokenise = DistillDataModule._tokenise

    def tokenise_and_mark(self, *args):
        open(marker, "w").close()
        return tokenise(self, *args)

    DistillDataModule._tokenise = tokenise_and_mark
    dm = DistillDataModule(model, [data], max_length=16, val_fraction=0.2)
    dm.build()
    rows = dm.train_rows
    queue.put((os.path.exists(marker), [rows[i]["input_ids"].tolist() for i in range(len(rows))]))


def test_processes_of_a_run_tokenise_once(tiny_model, tmp_path):
    """Three real processes start on an empty token cache at once: one tokenises, all read the same rows."""
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in TEXTS * 20])
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [
        context.Process(
            target=build_in_a_process, args=(str(tiny_model), str(data), str(tmp_path / f"made{i}"), queue)
        )
        for i in range(3)
    ]
    for process in processes:
        process.start()
    results = [queue.get(timeout=150) for _ in processes]
    for process in processes:
        process.join(30)
        assert process.exitcode == 0
    assert sum(made for made, _ in results) == 1
    assert results[0][1] == results[1][1] == results[2][1] and results[0][1]


def test_rows_in_worker_processes_map_the_cache_again(tiny_model, text_file):
    """A DataLoader worker started afresh (spawn) gets the rows' folder, not their tokens (``pickle``), and batches
    them as the main process does; so does a forked one (it inherits them)."""
    dm = DistillDataModule(str(tiny_model), [str(text_file)], max_length=16, batch_size=2, val_fraction=0.2)
    dm.build()
    rows = dm.train_rows
    assert len(pickle.dumps(rows)) < 1000 < rows.arrays["tokens"].nbytes
    assert as_lists(pickle.loads(pickle.dumps(rows[1:5]))) == as_lists(rows[1:5])
    assert as_lists(read_sets(rows.source.parent)["train"]) == as_lists(rows)
    batches = [
        list(
            torch.utils.data.DataLoader(
                rows,
                batch_size=2,
                collate_fn=functools.partial(collate, pad_id=dm.pad_id, pad_to=16),
                num_workers=workers,
                multiprocessing_context=start,
            )
        )
        for workers, start in ((0, None), (2, "spawn"), (2, "fork"))
    ]
    assert len(batches[0]) == (len(rows) + 1) // 2

    def same(a, b) -> bool:  # a batch holds tensors and ints (max_seq_len)
        return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

    for alone, spawned, forked in zip(*batches, strict=True):
        assert alone.keys() == spawned.keys() == forked.keys()
        assert all(same(alone[k], spawned[k]) and same(alone[k], forked[k]) for k in alone)


def test_records_encoded_in_forked_processes_are_encoded_as_in_one(tiny_model):
    """Chunks of text, prompt and chat records encoded by two forked processes: the same ids, flags and lengths, in
    the same order, as in this process."""
    from transformers import AutoTokenizer

    from swiftkv_distill.data import CHUNK, tokenise

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    kinds = [
        lambda i: {"text": f"{TEXTS[i % len(TEXTS)]} ({i})"},
        lambda i: {"prompt": f"Question {i}?"},
        lambda i: {"prompt": f"Question {i}?", "response": f"Answer {i}."},
    ]
    records = [kinds[i % 3](i) for i in range(2 * CHUNK + 7)]
    chunks = [records[start : start + CHUNK] for start in range(0, len(records), CHUNK)]
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    alone = list(tokenise(chunks, tokenizer, processes=1))
    forked = list(tokenise(iter(chunks), tokenizer, processes=2))
    assert len(alone) == len(forked) == 3
    for (ids, flags, lengths), (ids2, flags2, lengths2) in zip(alone, forked, strict=True):
        assert np.array_equal(ids, ids2) and np.array_equal(flags, flags2) and lengths == lengths2
    assert sum(len(lengths) for _, _, lengths in forked) == len(records) and not all(forked[0][1])
    assert os.environ.get("TOKENIZERS_PARALLELISM") == parallelism  # as it was


def test_chat_records_encoded_by_a_process_per_core_make_the_rows_of_one(tiny_model, tmp_path, monkeypatch):
    """Through the data module: prompt + answer records over several chunks are encoded in forked processes (one
    per core, no more than the chunks) into the rows one process makes."""
    from swiftkv_distill import data, datamodule

    monkeypatch.setattr(data, "CHUNK", 4)
    cores = len(os.sched_getaffinity(0))
    with monkeypatch.context() as node:  # a node of 64 cores
        node.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
        assert data.encoding_processes({"text"}, 100) == 1
        assert data.encoding_processes({"text", "chat"}, 9) == 3 and data.encoding_processes({"chat"}, 4) == 1
        assert data.encoding_processes({"prompt"}, 1000) == 64
    records = [{"prompt": f"Question {i}?", "response": f"Answer {i}, said at length."} for i in range(11)]
    file = write_jsonl(tmp_path / "chat.jsonl", records)
    chosen = []

    def rows(processes):
        monkeypatch.setattr(
            datamodule,
            "encoding_processes",
            lambda kinds, count: chosen.append(processes(kinds, count)) or chosen[-1],
        )
        monkeypatch.setenv("SWIFTKV_TOKENS_DIR", str(tmp_path / f"tokens{len(chosen)}"))
        dm = DistillDataModule(str(tiny_model), [str(file)], max_length=32, val_fraction=0.2)
        dm.build()
        return as_lists(dm.train_rows), as_lists(dm.val_rows)

    forked = rows(data.encoding_processes)
    assert chosen == [min(cores, 2), 1]  # 8 training records in 2 chunks, 3 held out in 1
    assert rows(lambda kinds, count: 1) == forked and len(forked[0]) > 1
