"""Token rows into batches: rows packed from token sequences (``pack``, ``unpacked``; ``tokens.RowWriter`` writes
them), and rows collated into the tensors the distillation step reads (``collate``), with what the step needs to
know of their sequences found on the host, so that it need not wait for the device to find it; and the rows'
loaders: each process's share (``SkippingDistributedSampler``, ``EvenSampler``), resumable mid-epoch
(``ResumableDataLoader``), of rows that every process must hold alike (``rows_summary``, ``check_same_rows``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from itertools import accumulate

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .data import DataError
from .launch import where
from .tokens import RowWriter, TokenRows

IGNORE = -100
# the batch's entries that describe all of its rows at once, not each row (``row_wise``)
WHOLE_BATCH = ("loss_index", "cu_seq_lens", "max_seq_len")
# the data and trainer settings that decide the rows and each process's batches and steps, which each node reads
# from its own command (``rows_summary``)
SAME_ON_EVERY_NODE = ("max_length", "pack", "chat_tokens", "val_fraction", "seed", "max_train_rows", "max_val_rows",
                      "batch_size", "val_batch_size")  # fmt: skip
SAME_TRAINER_SETTINGS = ("accumulate_grad_batches", "limit_train_batches", "max_steps", "max_epochs")


def pack(
    sequences: Sequence[list[int]], max_length: int, distilled: Sequence[list[bool]] | None = None
) -> TokenRows:
    """Concatenate sequences into rows of ``max_length`` tokens; a sequence crossing a row end continues in the
    next row (positions restart there). Each row reads as ``{"input_ids", "segments": [lengths...],
    "distilled"}`` (``distilled``: per token, from ``distilled`` or all True); the last row may be shorter (the
    collator pads it)."""
    return _rows(sequences, max_length, distilled, pack=True)


def unpacked(
    sequences: Sequence[list[int]], max_length: int, distilled: Sequence[list[bool]] | None = None
) -> TokenRows:
    """One row per sequence, truncated to ``max_length``."""
    return _rows(sequences, max_length, distilled, pack=False)


def _rows(sequences, max_length: int, distilled, pack: bool) -> TokenRows:
    writer = RowWriter(max_length, pack)
    for index, sequence in enumerate(sequences):
        writer.add(sequence, distilled[index] if distilled is not None else None)
    return writer.rows()


def collate(
    rows: Sequence[dict], pad_id: int = 0, pad_to: int | None = None
) -> dict[str, torch.Tensor | int]:
    """Batch rows into ``input_ids``, ``position_ids`` (restarting per packed sequence), ``token_mask`` (real
    tokens), ``loss_mask`` (the distilled ones: real and flagged in the row's ``distilled``), ``loss_index`` (their
    indices in the flattened rows, found on the host: the step need not wait for the device to count them),
    ``labels`` (the next token of the same sequence, ``-100`` at each sequence's last token), ``cu_seq_lens`` and
    ``max_seq_len`` (where each sequence of the flattened rows starts, and the longest, as an ``int``: flash-attn's
    variable-length arguments, also found on the host); where a row is flagged ``counted``, ``counted`` (per row:
    False for a repeated row, run but not scored).

    Padding is on the right and gets its own positions (a separate "sequence"), so real tokens never see it.
    Code that slices, joins or re-pads a batch's rows must drop ``loss_index``, ``cu_seq_lens`` and ``max_seq_len``
    (``row_wise``): they describe the whole batch.
    """
    length = max(pad_to or 0, max(len(r["input_ids"]) for r in rows))
    batch = {
        "input_ids": torch.full((len(rows), length), pad_id, dtype=torch.long),
        "position_ids": torch.zeros((len(rows), length), dtype=torch.long),
        "token_mask": torch.zeros((len(rows), length), dtype=torch.bool),
        "loss_mask": torch.zeros((len(rows), length), dtype=torch.bool),
        "labels": torch.full((len(rows), length), IGNORE, dtype=torch.long),
    }
    spans = []  # every sequence's length, row by row, a row's padding as one more
    for i, row in enumerate(rows):
        ids, n = torch.tensor(row["input_ids"], dtype=torch.long), len(row["input_ids"])
        batch["input_ids"][i, :n] = ids
        batch["token_mask"][i, :n] = True
        batch["loss_mask"][i, :n] = torch.tensor(row.get("distilled", [True] * n), dtype=torch.bool)
        start = 0
        for seg in row["segments"]:
            batch["position_ids"][i, start : start + seg] = torch.arange(seg)
            batch["labels"][i, start : start + seg - 1] = ids[start + 1 : start + seg]
            start += seg
        batch["position_ids"][i, n:] = torch.arange(length - n)
        spans.extend([*row["segments"], *([length - n] if n < length else [])])
    batch["loss_index"] = batch["loss_mask"].flatten().nonzero().flatten()
    batch["cu_seq_lens"] = torch.tensor([0, *accumulate(spans)], dtype=torch.int32)
    batch["max_seq_len"] = max(spans)
    if any("counted" in row for row in rows):
        batch["counted"] = torch.tensor([row.get("counted", True) for row in rows])
    return batch


def row_wise(batch: dict) -> dict:
    """``batch`` without its whole-batch entries (``WHOLE_BATCH``): what code that slices, joins or re-pads its rows
    may keep. The step then finds what it needs from the rows, on the device."""
    return {k: v for k, v in batch.items() if k not in WHOLE_BATCH}


class RowsDataset(Dataset):
    """The rows; an index past the end names a row repeated to even out the processes' shares (``EvenSampler``),
    flagged ``counted: False``."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        if index < len(self.rows):
            return self.rows[index]
        return self.rows[index % len(self.rows)] | {"counted": False}


class EvenSampler(DistributedSampler):
    """Validation: each process's share of the rows, in order. Every process must run as many batches (under FSDP2
    each forward is a collective), so ``DistributedSampler`` repeats the first rows where the rows are not a multiple
    of the processes; here they are named past the dataset's end (``RowsDataset``), and the validation step leaves
    them out of the figures instead of counting them twice."""

    def __iter__(self):
        return iter(range(self.rank, self.total_size, self.num_replicas))


class SkippingDistributedSampler(DistributedSampler):
    """``DistributedSampler`` (a seeded permutation per epoch) that can start mid-epoch (after ``skip`` indices)."""

    skip = 0

    def __iter__(self):
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])


class ResumableDataLoader(DataLoader):
    """A DataLoader whose position inside an epoch travels in Lightning checkpoints, so resuming from a checkpoint
    continues with exactly the batches an uninterrupted run would have seen.

    ``progress()``: the batches processed so far in the current epoch (Lightning's counter: the loader's own count
    would include the batch Lightning prefetches). ``epoch()``: the epoch Lightning is in or about to start.
    ``batches_per_epoch(n)``: the batches Lightning takes of the ``n`` the loader holds (``limit_train_batches``)."""

    def __init__(self, *args, progress=None, epoch=None, batches_per_epoch=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._progress, self._epoch, self._batches_per_epoch = progress, epoch, batches_per_epoch
        self._resume: tuple[int, int] | None = None

    def state_dict(self) -> dict:
        return {"epoch": self.sampler.epoch, "batches_done": int(self._progress()) if self._progress else 0}

    def load_state_dict(self, state: dict) -> None:
        self._resume = (state["epoch"], state["batches_done"])

    def __iter__(self):
        """Each iterator draws its epoch's permutation: the sampler's epoch is set here, as Lightning iterates the
        loader once before it sets the epoch (``FitLoop.setup_data``), and a worker process draws its indices as
        soon as the loader is iterated. The first iterator after a resume starts where the checkpoint stopped: less
        the batches done, or at the next epoch's start when the checkpoint closed an epoch."""
        done = 0
        if self._resume is not None:
            epoch, done = self._resume
            self._resume = None
            epoch_batches = self._batches_per_epoch(len(self)) if self._batches_per_epoch else len(self)
            if done >= epoch_batches:
                epoch, done = epoch + 1, 0
        elif self._epoch is not None:
            epoch = self._epoch()
        else:
            epoch = self.sampler.epoch
        self.sampler.set_epoch(epoch)
        self.sampler.skip = done * self.batch_size
        return super().__iter__()


def rows_summary(data, trainer=None) -> dict:
    """What ``check_same_rows`` compares between the processes, of a set-up ``DistillDataModule``: the training and
    validation rows' counts (after ``max_train_rows`` / ``max_val_rows``, which pick rows by count alone), a digest
    of every set's count and rows, and the data and trainer settings that decide the rows and each process's batches
    and steps (and the validation sets' names); and where the process runs, to name it."""
    counts = [len(data.train_rows), *map(len, data.val_set_rows.values())]
    sets = json.dumps([counts, data.train_rows_sha256, data.val_rows_sha256])
    settings = {f"data.{key}": data.hparams[key] for key in SAME_ON_EVERY_NODE}
    settings["data.val_files"] = list(data.val_sets)  # names; paths may differ by node
    if trainer is not None:
        settings |= {f"trainer.{key}": getattr(trainer, key) for key in SAME_TRAINER_SETTINGS}
    return {
        "where": where(trainer.node_rank if trainer is not None else 0),
        "training": counts[0],
        "validation": sum(counts[1:]),
        "digest": hashlib.sha256(sets.encode()).hexdigest(),
        "settings": settings,
    }


def check_same_rows(summaries: list[dict]) -> None:
    """Refuse processes that hold other rows or settings (``rows_summary`` of each, in rank order): a node with
    its own token cache tokenises its own copies of the data files, with its own copy of the model's tokenizer and
    its own libraries, and each node reads its settings from its own command. Other tokens would train each node on
    other data, silently; another count of rows, another batch size or another number of steps would give the
    processes other numbers of batches or steps, and they would wait on each other at the end of an epoch, a
    validation or a step until the process group's timeout."""
    groups: dict[str, list[tuple[int, dict]]] = {}
    for rank, summary in enumerate(summaries):
        same = json.dumps({key: value for key, value in summary.items() if key != "where"}, sort_keys=True)
        groups.setdefault(same, []).append((rank, summary))
    if len(groups) == 1:
        return
    settings = dict.fromkeys(key for summary in summaries for key in summary["settings"])
    differ = [key for key in settings if len({json.dumps(s["settings"].get(key)) for s in summaries}) > 1]
    held = []
    for members in groups.values():
        summary, where = members[0][1], list(dict.fromkeys(s["where"] for _, s in members))
        on = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
        held.append(
            f"process{'es' if len(members) > 1 else ''} {_spans([rank for rank, _ in members])} on {on}: "
            f"{summary['training']:,} training and {summary['validation']:,} validation rows (digest "
            f"{summary['digest'][:12]})"
            + "".join(f", {key} {summary['settings'].get(key)!r}" for key in differ)
        )
    rows_differ = len({summary["digest"] for summary in summaries}) > 1
    raise DataError(
        f"The processes hold other {'rows' if rows_differ else 'settings'}"
        f"{' or settings' if rows_differ and differ else ''} ({'; '.join(held)}). "
        + (
            "A node with its own token cache tokenises its own copy of the data files, with its own copy of the "
            "model's tokenizer and its own libraries (transformers, tokenizers, jinja2, torch; a chat template may "
            "write the date): give every node the same data files, model folder, library versions and settings."
            if rows_differ
            else "Each node reads them from its own command: give every node the same settings."
        )
        + " Otherwise each node would train on other data, or the processes would run other numbers of batches or "
        "steps and wait on each other until the process group's timeout."
    )


def _spans(ranks: list[int]) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``"0-3, 5"``."""
    spans = []
    for rank in ranks:
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
