"""Distillation data: what a record is, and how records become token sequences (read, tokenised, split).
``tokens.RowWriter`` packs them into rows (``batches.pack`` / ``unpacked`` in memory), ``batches.collate`` batches
the rows; ``datamodule.py`` serves them to Lightning.

A record is one of (detected per record):

- chat: ``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered with the model's chat template;
- prompt-only: ``{"prompt": "..."}`` rendered as one user turn plus the generation prompt (prefill-style
  distillation: SwiftKV changes how prompts are processed, the teacher needs no answer to be matched);
- prompt + answer: ``{"prompt": ..., "response"|"completion": ...}`` rendered as a two-turn chat;
- plain text: ``{"text": "..."}`` (``.txt`` files: one record per line), followed by EOS.

Distillation needs no labels: the student matches the teacher's next-token distribution at every DISTILLED
position. Text and prompt-only records distil every position. Chat and prompt + answer records distil, with
``chat_tokens="answers"`` (the default), only the positions that predict an assistant turn's tokens (from the last
token of the generation prompt to the turn's end-of-turn token): those are the distributions a user samples
answers from. The prompt and template positions still run through both models and give the answer positions
their context (the K/V the student computes for them are trained through the answers' loss); only their own
next-token KL is left out, because a chat user never samples prompt tokens. ``chat_tokens="all"`` distils
every position of every record.
With ``pack=True`` sequences are concatenated into rows of ``max_length`` tokens (the last may be shorter: the
collate pads it); each keeps its own position ids (restarting at 0), and the model's causal mask keeps packed
sequences from attending to each other (transformers derives the block-diagonal mask from the position ids when
no attention mask is given; with flash-attn, ``batches.collate``'s variable-length arguments say where they start).
The train/validation split is by record, from a seeded permutation: the same files and seed give the same split.
Local jsonl / json / parquet / text files are read through ``datasets``, a chunk of records at a time
(``RecordFile``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import multiprocessing
import os
import signal
import sys
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from swiftkv_core.chat import chat_ids, user_turn

from .tokens import UNWRITABLE

CHAT_TOKENS = ("answers", "all")
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}


class DataError(ValueError):
    """A data file or data option that cannot work; raised before any compute is spent."""


CHUNK = 1000  # records read, and encoded by a process, at a time


class RecordFile:
    """The records of a local data file (jsonl / json / parquet / text), checked when opened (``DataError``
    naming the file and the record), then read ``CHUNK`` at a time (``chunks``) from the memory-mapped Arrow copy
    that ``datasets`` makes of it in ``cache_dir``: a corpus is never held in memory whole (``datasets`` parses a
    ``.json`` array file whole once, to make the copy). ``len``: its records (a text file's blank lines left out);
    ``kinds``: theirs (``record_kind``).

    ``cache_dir`` is to be a new folder, removed after: ``datasets`` tells a file's changes apart by its
    modification time alone, so a copy that keeps an older file's (``cp -p``) would be read from an older copy."""

    def __init__(self, file: str | Path, cache_dir: Path):
        import datasets

        self.path = Path(file)
        builder = check_file(self.path)
        if self.path.suffix.lower() == ".jsonl":
            _check_json_lines(self.path)
        try:
            self._dataset = datasets.load_dataset(
                builder, data_files=str(self.path), split="train", cache_dir=str(cache_dir)
            )
        except Exception as error:  # datasets wraps parser errors in several exception types
            if (full := _unwritable_cause(error, Path(cache_dir))) is not None:
                raise full from error
            raise DataError(
                f"Data file {self.path} could not be read as {builder}: {type(error).__name__}: {error}"
            ) from error
        self._text = builder == "text"
        self.kinds: set[str] = set()
        self._count = 0
        for chunk in self.chunks():
            for record in chunk:
                kind = record_kind(record)
                if kind is None:
                    raise DataError(
                        f"Data file {self.path}, record {self._count}: expected a 'messages' list (chat), a "
                        "'prompt' (optionally with 'response'/'completion') or a 'text' field; got fields "
                        f"{sorted(record)}."
                    )
                self.kinds.add(kind)
                self._count += 1
        if not self._count:
            raise DataError(f"Data file {self.path} holds no records.")

    def __len__(self) -> int:
        return self._count

    def chunks(self) -> Iterator[list[dict]]:
        """The records in order, as lists of up to ``CHUNK`` (decoded as ``Dataset.to_list`` decodes them: a field
        whose objects differ in keys, as chat messages may, is kept as JSON text in the Arrow copy)."""
        for batch in self._dataset.iter(batch_size=CHUNK):
            records = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
            if self._text:
                records = [r for r in records if r["text"].strip()]
            if records:
                yield records


def _unwritable_cause(error: BaseException, cache_dir: Path) -> OSError | None:
    """The error in ``error``'s chain that says ``cache_dir`` cannot be written (one of ``tokens.UNWRITABLE``
    naming a file there, or a full disk or quota, which reading a data file never causes), named after
    ``cache_dir``; None if there is none (a data file's own error stays the data's)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in UNWRITABLE:
            named = str(error.filename or "")
            if named.startswith(str(cache_dir)) or (not named and error.errno in _FULL):
                return OSError(error.errno, error.strerror, str(cache_dir))
        error = error.__cause__ or error.__context__
    return None


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def load_records(files: Sequence[str | Path]) -> list[dict]:
    """All records of ``files`` (local jsonl / json / parquet / text), in file order, as a list (for small files;
    a corpus is read a chunk at a time: ``RecordFile``). Clear errors, no hub."""
    with tempfile.TemporaryDirectory(prefix="swiftkv-records-") as arrow:
        return [
            record for file in files for chunk in RecordFile(file, Path(arrow)).chunks() for record in chunk
        ]


@dataclass
class RecordSet:
    """The records a set takes of ``files``: those flagged in ``keep`` (a flag per record of all the files), or
    all (None)."""

    files: list[RecordFile]
    keep: np.ndarray | None = None

    def __len__(self) -> int:
        return sum(map(len, self.files)) if self.keep is None else int(self.keep.sum())

    @property
    def kinds(self) -> set[str]:
        return set().union(*(f.kinds for f in self.files))

    def chunks(self) -> Iterator[list[dict]]:
        """The set's records, the files end to end, in chunks of ``CHUNK`` (the last may be smaller)."""
        seen, records = 0, []
        for file in self.files:
            for chunk in file.chunks():
                if self.keep is not None:
                    flags, seen = self.keep[seen : seen + len(chunk)], seen + len(chunk)
                    chunk = [record for record, kept in zip(chunk, flags, strict=True) if kept]
                records += chunk
                while len(records) >= CHUNK:
                    yield records[:CHUNK]
                    records = records[CHUNK:]
        if records:
            yield records


def record_sets(
    train_files: list[str], val_files: list[list[str]], val_fraction: float, seed: int, cache_dir: Path
) -> dict[str, RecordSet]:
    """The record sets of a distillation, their files checked: ``train`` and ``val0``, ``val1``... (one per list
    of ``val_files``; without any, ``val0`` is ``val_fraction`` of the training records, held out by ``seed``)."""
    train = [RecordFile(f, cache_dir) for f in train_files]
    vals = [[RecordFile(f, cache_dir) for f in files] for files in val_files]
    if not vals:
        validating = held_out(sum(map(len, train)), val_fraction, seed)
        return {"train": RecordSet(train, ~validating), "val0": RecordSet(train, validating)}
    return {"train": RecordSet(train), **{f"val{i}": RecordSet(files) for i, files in enumerate(vals)}}


def check_file(path: Path) -> str:
    """The ``datasets`` builder of a data file; ``DataError`` if it is missing, empty or of an unknown kind."""
    if not path.is_file():
        relative = "" if path.is_absolute() else f" (read from {Path.cwd()})"
        raise DataError(
            f"Data file {path} does not exist{relative}: name jsonl / json / parquet / txt files that are there "
            "(distill fit: --data.train_files '[FILE, ...]'; record formats: swiftkv_distill/data.py)."
        )
    builder = _BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(
            f"Data file {path}: unknown extension {path.suffix!r}; use one of {sorted(_BUILDERS)}."
        )
    if path.stat().st_size == 0:
        raise DataError(f"Data file {path} is empty.")
    return builder


def file_identity(file: str | Path) -> list:
    """What tells a data file's content apart without reading it: its real path, size, modification and change
    times (the token cache's key). ``DataError`` as ``RecordFile`` for a file that cannot be data."""
    path = Path(file)
    check_file(path)
    stat = path.stat()
    # the change time too: a copy that keeps an older file's modification time (cp -p, rsync -t) gets a new one
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _check_json_lines(path: Path) -> None:
    """Raise ``DataError`` naming the first line of a jsonl file that is not a JSON object."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(
                    f"Data file {path} could not be read as jsonl: line {number} is not valid JSON ({error.msg}, "
                    f"column {error.colno}): fix or remove that line."
                ) from None
            if not isinstance(record, dict):
                raise DataError(
                    f"Data file {path}, line {number}: a JSON object per line is expected, got {line[:60]!r}."
                )


def record_kind(record: dict) -> str | None:
    """``'chat'``, ``'prompt'``, ``'prompt_response'``, ``'text'`` or ``None`` (not usable)."""
    if isinstance(record.get("messages"), list) and record["messages"]:
        return "chat"
    if isinstance(record.get("prompt"), str) and record["prompt"].strip():
        answer = record.get("response") or record.get("completion")
        return "prompt_response" if isinstance(answer, str) and answer.strip() else "prompt"
    if isinstance(record.get("text"), str) and record["text"].strip():
        return "text"
    return None


def encode_record(record: dict, tokenizer, chat_tokens: str = "answers") -> tuple[list[int], list[bool]]:
    """Token ids of one record (see the module docstring for the formats) and, per position, whether it is
    distilled (``chat_tokens``: ``"answers"`` or ``"all"``)."""
    kind = record_kind(record)
    if kind == "text":
        return _text(tokenizer(record["text"], add_special_tokens=True)["input_ids"], tokenizer)
    if kind == "prompt":
        ids = chat_ids(tokenizer, user_turn(record["prompt"]), generation_prompt=True)
        return ids, [True] * len(ids)
    if kind == "chat":
        messages = record["messages"]
    else:
        answer = record.get("response") or record.get("completion")
        messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": answer}]
    ids = chat_ids(tokenizer, messages)
    if chat_tokens == "all":
        return ids, [True] * len(ids)
    distilled = [False] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = _common_prefix(ids, chat_ids(tokenizer, messages[:i], generation_prompt=True))
        end = len(chat_ids(tokenizer, messages[: i + 1]))
        # position t predicts token t + 1: the answer's tokens are predicted from start - 1 to end - 2
        for t in range(max(start - 1, 0), end - 1):
            distilled[t] = True
    return ids, distilled


def encode_records(
    records: Sequence[dict], tokenizer, chat_tokens: str = "answers", batch_size: int = 1000
) -> Iterator[tuple[list[int], list[bool]]]:
    """``encode_record`` of each record, in order; text records a batch at a time (the fast tokenizer then
    works on every core)."""
    for start in range(0, len(records), batch_size):
        batch = records[start : start + batch_size]
        texts = [r["text"] for r in batch if record_kind(r) == "text"]
        encoded = iter(tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else ())
        for record in batch:
            if record_kind(record) == "text":
                yield _text(next(encoded), tokenizer)
            else:
                yield encode_record(record, tokenizer, chat_tokens)


def encoding_processes(kinds: set[str], records: int) -> int:
    """The processes worth encoding ``records`` records of ``kinds`` in: one per core where a record is rendered
    through a chat template (in Python, a record at a time: one core would take about an hour for the paper's
    680M tokens), no more than the chunks; else one (text is batched through the tokenizer's own threads)."""
    if kinds <= {"text"}:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, math.ceil(records / CHUNK))


def tokenise(
    chunks: Iterable[list[dict]], tokenizer, chat_tokens: str = "answers", processes: int = 1
) -> Iterator[tuple[np.ndarray, np.ndarray, list[int]]]:
    """``encode_records`` of each chunk of records (lists, as ``RecordSet.chunks`` gives them), in order: the chunk's
    ids (int32) and distilled flags (bool) end to end, and its sequences' lengths. With ``processes`` > 1
    (``encoding_processes``) the chunks are encoded in that many forked processes, at most two chunks each ahead
    of the one given out. Forked, as DataLoader workers are: they inherit the tokenizer, and the launching
    script is not run again."""
    if processes <= 1:
        for chunk in chunks:
            yield _encoded(chunk, tokenizer, chat_tokens)
        return
    global _JOB
    _JOB = (tokenizer, chat_tokens)
    # one tokenizer thread per process; also keeps the tokenizers library from warning about the fork
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    context = multiprocessing.get_context("fork")
    try:
        with ProcessPoolExecutor(processes, context, _die_with_parent, (os.getpid(),)) as pool:
            pending = deque()
            for chunk in chunks:
                pending.append(pool.submit(_encoded_job, chunk))
                if len(pending) >= 2 * processes:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
    finally:
        _JOB = None
        if parallelism is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = parallelism


_JOB: tuple | None = None  # what ``tokenise``'s forked processes encode with: tokenizer, chat_tokens


def _die_with_parent(parent: int) -> None:
    """Each forked encoder is killed with the process that forked it (Linux): they share its open files, the token
    cache's locks among them, and encoders left waiting for work would hold those forever after a SIGKILL."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before that
            os._exit(1)


def _encoded_job(records: list[dict]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    return _encoded(records, *_JOB)


def _encoded(records, tokenizer, chat_tokens: str) -> tuple[np.ndarray, np.ndarray, list[int]]:
    encoded = list(encode_records(records, tokenizer, chat_tokens))
    lengths = [len(ids) for ids, _ in encoded]
    ids = np.fromiter(chain.from_iterable(ids for ids, _ in encoded), np.int32, sum(lengths))
    flags = np.fromiter(chain.from_iterable(flags for _, flags in encoded), bool, sum(lengths))
    return ids, flags, lengths


def _text(ids: list[int], tokenizer) -> tuple[list[int], list[bool]]:
    """A text record's ids followed by EOS, all distilled."""
    ids = ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    return ids, [True] * len(ids)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def held_out(n: int, val_fraction: float, seed: int) -> np.ndarray:
    """Which of ``n`` records are held out for validation (a flag each): the first ``val_fraction`` of a seeded
    permutation; the same ``n`` and seed hold out the same records."""
    flags = np.zeros(n, bool)
    if n:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        flags[order[: min(n - 1, math.ceil(n * val_fraction)) if val_fraction > 0 else 0].numpy()] = True
    return flags


def evenly_spaced(rows: list, count: int) -> list:
    """``count`` rows spread evenly over ``rows`` (all of them if there are no more than ``count``)."""
    if len(rows) <= count:
        return list(rows)
    return [rows[i * len(rows) // count] for i in range(count)]
