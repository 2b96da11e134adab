"""Token rows as flat arrays: 5 bytes a token (an int32 id and a distilled flag), written to disk once and
memory-mapped by every process of a run (``datamodule.py`` keeps them in its token cache).

Rows held as Python lists of ints cost about 52 bytes a token in every process that builds them
(``benchmarks/results/token-rows.md``): the paper's 680M training tokens would take 265 GiB on the 8 processes of
an 8-GPU node, and each process would spend the tokenisation again. Here the processes of a node share one copy
through the page cache.

A set of rows is four arrays:

- ``tokens`` and ``distilled``: every row's tokens, end to end, and per token whether it is distilled;
- ``row_starts``: row ``r`` is ``tokens[row_starts[r]:row_starts[r + 1]]``;
- ``sequence_starts``: where each sequence begins; a row's segments (``batches.collate`` restarts the positions
  at each) are cut there.

A row reads as the dict ``batches.collate`` batches: ``input_ids``, ``segments`` (lengths), ``distilled``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ARRAYS = ("tokens", "distilled", "row_starts", "sequence_starts")
# in the token cache's keys: a new layout of the arrays, or new rules for encoding records (``data.py``), makes
# new entries instead of reading old ones
TOKEN_CACHE_FORMAT = 1


def token_cache_dir() -> Path:
    """The token cache: ``$SWIFTKV_TOKENS_DIR``, else ``$SWIFTKV_CACHE_DIR/tokens`` (default
    ``~/.cache/swiftkv/tokens``); a folder per data, tokenizer and row settings. Safe to delete between runs
    (a run's DataLoader workers may map it again): what is missing is made again."""
    from swiftkv_core.default_model import cache_dir

    return Path(os.environ.get("SWIFTKV_TOKENS_DIR") or cache_dir() / "tokens")


# what makes a folder unwritable: permissions, a read-only or full file system, a quota, a file in the way
UNWRITABLE = (
    errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ENOSPC, errno.EDQUOT, errno.EFBIG
)  # fmt: skip


def cache_unwritable(error: OSError) -> bool:
    """Whether ``error`` says that the token cache cannot be written (a data file's error is not the cache's)."""
    named = Path(os.path.abspath(error.filename or "/"))  # as named, relative or not
    return error.errno in UNWRITABLE and named.is_relative_to(token_cache_dir().absolute())


def tokenizer_identity(tokenizer) -> str:
    """A digest of what decides a tokenizer's ids: its class, its rules and vocabulary (the fast tokenizer's whole
    definition), its special tokens (chat templates name them), chat template and end-of-sequence token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    rules = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    parts = [
        str(getattr(tokenizer, "special_tokens_map", None)),
        type(tokenizer).__name__,
        rules,
        str(getattr(tokenizer, "chat_template", None)),
        str(tokenizer.eos_token_id),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


class TokenRows(Sequence):
    """Rows over the four arrays (see the module docstring), optionally a selection of them (``index``). Indexing
    with an int gives a row's dict; with a slice, a list or an array of ints, the selected rows (``subset``)."""

    def __init__(
        self, arrays: dict[str, np.ndarray], index: np.ndarray | None = None, source: Path | None = None
    ):
        self.arrays = arrays
        self.index = (
            np.arange(len(arrays["row_starts"]) - 1) if index is None else np.asarray(index, np.int64)
        )
        # the folder the arrays are mapped from: a copy for another process (a DataLoader worker) maps them again
        self.source = source

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        if not isinstance(i, (int, np.integer)):
            return self.subset(i)
        row = int(self.index[i])
        starts, cuts = self.arrays["row_starts"], self.arrays["sequence_starts"]
        begin, end = int(starts[row]), int(starts[row + 1])
        inside = cuts[np.searchsorted(cuts, begin, "right") : np.searchsorted(cuts, end, "left")]
        bounds = [begin, *inside.tolist(), end]
        return {
            "input_ids": self.arrays["tokens"][begin:end],
            "segments": [b - a for a, b in zip(bounds, bounds[1:], strict=False)],
            "distilled": self.arrays["distilled"][begin:end],
        }

    def subset(self, selection) -> TokenRows:
        """The rows at ``selection`` (a slice, or positions in this selection), sharing the arrays."""
        return TokenRows(self.arrays, self.index[selection], self.source)

    def lengths(self) -> np.ndarray:
        """Tokens per selected row."""
        starts = self.arrays["row_starts"]
        return starts[self.index + 1] - starts[self.index]

    def any_distilled(self) -> bool:
        """Whether any selected row has a token to distil."""
        if len(self.index) == len(self.arrays["row_starts"]) - 1:
            return bool(self.arrays["distilled"].any())
        return any(self[i]["distilled"].any() for i in range(len(self)))

    def summary(self) -> dict:
        """All rows' counts, whatever the selection: rows, tokens, distilled tokens."""
        return {
            "rows": len(self.arrays["row_starts"]) - 1,
            "tokens": len(self.arrays["tokens"]),
            "distilled": int(np.count_nonzero(self.arrays["distilled"])),
        }

    def sha256(self) -> str:
        """A digest of all rows' arrays, whatever the selection: the same for the same rows however they were made
        (by another version of the libraries, from a data file copied or touched), another for any token, flag or
        cut that differs."""
        digest, part = hashlib.sha256(), 1 << 24  # a part at a time: a mapped array is not read whole
        for key in ARRAYS:
            values = self.arrays[key]
            digest.update(f"{key} {values.dtype.str} {len(values)}\n".encode())
            for start in range(0, len(values), part):
                digest.update(values[start : start + part])
        return digest.hexdigest()

    @classmethod
    def load(cls, folder: Path, name: str) -> TokenRows:
        """The set ``name`` of ``folder``, memory-mapped read-only."""
        arrays = {key: np.load(folder / f"{name}.{key}.npy", mmap_mode="r") for key in ARRAYS}
        return cls(arrays, source=folder / name)

    def __reduce__(self):
        if self.source is None:
            return TokenRows, (self.arrays, self.index)
        return _mapped, (str(self.source), self.index)


def _mapped(source: str, index: np.ndarray) -> TokenRows:
    """A ``TokenRows`` mapped again from its folder (a pickled copy carries the path, not the tokens)."""
    path = Path(source)
    return TokenRows.load(path.parent, path.name).subset(index)


class RowWriter:
    """Sequences in, rows out: ``add`` a sequence's ids (and distilled flags, default all), or ``add_many``
    sequences end to end; ``rows`` cuts them into rows of ``max_length`` tokens. Packed, a sequence crossing a
    row's end continues in the next row (its positions restart there) and only the last row may be shorter; else
    one row per sequence, truncated. The tokens are kept in memory (5 bytes a token), or with ``into`` (a path
    ``FOLDER/NAME``) written straight to the files of the set ``NAME`` (``TokenRows.load``): a corpus's tokens are
    then never held in memory, only its sequences' starts (8 bytes a sequence)."""

    def __init__(self, max_length: int, pack: bool = True, into: Path | None = None):
        self.max_length, self.pack, self.into = max_length, pack, into
        # where the tokens and flags go: parts kept in a list, or a file each
        self._sinks = {
            key: _GrowingArray(Path(f"{into}.{key}.npy"), dtype) if into else []
            for key, dtype in _TOKEN_DTYPES
        }
        self._starts: list[np.ndarray] = []
        self.num_tokens = 0

    def add(self, ids: Sequence[int], distilled: Sequence[bool] | None = None) -> None:
        flags = np.ones(len(ids), bool) if distilled is None else np.asarray(distilled, bool)
        self.add_many(np.asarray(ids, np.int32), flags, [len(ids)])

    def add_many(self, ids: np.ndarray, distilled: np.ndarray, lengths: Sequence[int]) -> None:
        """Sequences given end to end: ``ids`` (int32) and ``distilled`` (bool) of all, and each one's length."""
        lengths = np.asarray(lengths, np.int64)
        if not len(ids) == len(distilled) == lengths.sum():
            raise ValueError(
                f"add_many: {len(ids)} ids, {len(distilled)} distilled flags and sequences of {lengths.sum()} tokens "
                "in all: give one flag per id, and lengths that add up to the ids."
            )
        if not self.pack:
            within = np.arange(len(ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            keep = within < self.max_length
            ids, distilled, lengths = ids[keep], distilled[keep], np.minimum(lengths, self.max_length)
        lengths = lengths[lengths > 0]
        self._sinks["tokens"].append(ids)
        self._sinks["distilled"].append(distilled)
        self._starts.append(self.num_tokens + np.cumsum(lengths) - lengths)
        self.num_tokens += len(ids)

    def rows(self) -> TokenRows:
        """The rows: in memory, or (``into``) the set's files completed and mapped."""
        starts = np.concatenate(self._starts or [np.zeros(0, np.int64)]).astype(np.int64)
        row_starts = np.arange(0, self.num_tokens, self.max_length) if self.pack else starts
        index = {
            "row_starts": np.append(row_starts, self.num_tokens).astype(np.int64),
            "sequence_starts": starts,
        }
        if not self.into:
            tokens = {
                key: np.concatenate(self._sinks[key] or [np.zeros(0, dtype)]) for key, dtype in _TOKEN_DTYPES
            }
            return TokenRows({**tokens, **index})
        for file in self._sinks.values():
            file.finish()
        for key, values in index.items():
            with _GrowingArray(Path(f"{self.into}.{key}.npy"), values.dtype) as file:
                file.append(values)
                file.finish()
        return TokenRows.load(self.into.parent, self.into.name)

    def close(self) -> None:
        """Give up the set's files unfinished (after ``rows``, nothing to do): a failed tokenisation's, whose
        staging folder is deleted."""
        if self.into:
            for file in self._sinks.values():
                file.discard()


_TOKEN_DTYPES = (("tokens", np.int32), ("distilled", bool))


class _GrowingArray:
    """A one-dimensional ``.npy`` file written a part at a time: its header is written again with the final
    length by ``finish`` (numpy leaves room in a header for a longer shape); ``discard`` closes it unfinished. A
    write error names the file (a full disk's error names none), as ``cache_unwritable`` needs."""

    def __init__(self, path: Path, dtype):
        self.path, self.dtype, self.length = path, np.dtype(dtype), 0
        self.file = path.open("wb")
        self.file.write(self._header())
        self.header_size = self.file.tell()

    def _header(self) -> bytes:
        header = io.BytesIO()
        fields = {
            "descr": np.lib.format.dtype_to_descr(self.dtype),
            "fortran_order": False,
            "shape": (self.length,),
        }
        np.lib.format.write_array_header_1_0(header, fields)
        return header.getvalue()

    def __enter__(self) -> _GrowingArray:
        return self

    def __exit__(self, *failure) -> None:
        self.discard()

    def append(self, values: np.ndarray) -> None:
        with self._named():
            self.file.write(np.ascontiguousarray(values, self.dtype).data)
        self.length += len(values)

    def finish(self) -> None:
        """Write the final header and close."""
        header = self._header()
        if len(header) != self.header_size:
            raise RuntimeError(f"{self.path}: the header of {self.length} values outgrew the room numpy left")
        with self._named():
            self.file.seek(0)
            self.file.write(header)
            self.file.close()

    def discard(self) -> None:
        """Close, unfinished and whatever the disk says (nothing if already closed)."""
        with contextlib.suppress(OSError):
            self.file.close()

    @contextlib.contextmanager
    def _named(self):
        try:
            yield
        except OSError as error:
            raise OSError(error.errno, error.strerror, str(self.path)) from error


def write_sets(folder: Path, sets: dict[str, TokenRows], about: dict) -> None:
    """Complete ``folder`` with ``sets.json``: each set's summary and ``sha256``, and ``about`` (what the rows were
    made from, for a reader of the cache). ``sets`` (name -> rows) are those ``RowWriter(into=folder / name)`` wrote
    there."""
    if unwritten := [name for name, rows in sets.items() if rows.source != folder / name]:
        raise ValueError(f"write_sets: the sets {unwritten} were not written into {folder} by a RowWriter")
    summary = {name: rows.summary() | {"sha256": rows.sha256()} for name, rows in sets.items()}
    path = folder / "sets.json"
    try:
        path.write_text(json.dumps({"sets": summary, "made_from": about}, indent=1) + "\n")
    except OSError as error:  # named, as ``cache_unwritable`` needs
        raise OSError(error.errno, error.strerror, str(path)) from error


def read_sets(folder: Path) -> dict[str, TokenRows]:
    """The sets ``write_sets`` wrote in ``folder``, memory-mapped."""
    names = json.loads((folder / "sets.json").read_text())["sets"]
    return {name: TokenRows.load(folder, name) for name in names}


def set_sha256(folder: Path, name: str) -> str:
    """The ``sha256`` of the set ``name`` that ``write_sets`` wrote in ``folder`` (computed here for a cache written
    before it recorded one)."""
    recorded = json.loads((folder / "sets.json").read_text())["sets"][name].get("sha256")
    return recorded or TokenRows.load(folder, name).sha256()
