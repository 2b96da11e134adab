"""Distillation data: local jsonl / json / parquet / text files through ``datasets``, tokenised and packed.

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
With ``pack=True`` sequences are concatenated into rows of exactly ``max_length`` tokens; each keeps its own
position ids (restarting at 0), and the model's causal mask keeps packed sequences from attending to each
other (transformers derives the block-diagonal mask from the position ids when no attention mask is given).
The train/validation split is by record, from a seeded permutation: the same files and seed give the same split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

IGNORE = -100
CHAT_TOKENS = ("answers", "all")
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}


class DataError(ValueError):
    """A data file or data option that cannot work; raised before any compute is spent."""


def load_records(files: Sequence[str | Path]) -> list[dict]:
    """All records of ``files`` (local jsonl / json / parquet / text), in file order. Clear errors, no hub."""
    import datasets

    records: list[dict] = []
    for file in files:
        path = Path(file)
        if not path.is_file():
            raise DataError(f"Data file {path} does not exist.")
        builder = _BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(
                f"Data file {path}: unknown extension {path.suffix!r}; use one of {sorted(_BUILDERS)}."
            )
        if path.stat().st_size == 0:
            raise DataError(f"Data file {path} is empty.")
        try:
            dataset = datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as error:  # datasets wraps parser errors in several exception types
            raise DataError(
                f"Data file {path} could not be read as {builder}: {type(error).__name__}: {error}"
            ) from error
        rows = dataset.to_list()
        if builder == "text":
            rows = [row for row in rows if row["text"].strip()]
        if not rows:
            raise DataError(f"Data file {path} holds no records.")
        for i, row in enumerate(rows):
            if record_kind(row) is None:
                raise DataError(
                    f"Data file {path}, record {i}: expected a 'messages' list (chat), a 'prompt' (optionally with "
                    f"'response'/'completion') or a 'text' field; got fields {sorted(row)}."
                )
        records.extend(rows)
    return records


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
        ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"]
        ids = ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        return ids, [True] * len(ids)
    if kind == "prompt":
        ids = _chat_ids(tokenizer, [{"role": "user", "content": record["prompt"]}], generation_prompt=True)
        return ids, [True] * len(ids)
    if kind == "chat":
        messages = record["messages"]
    else:
        answer = record.get("response") or record.get("completion")
        messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": answer}]
    ids = _chat_ids(tokenizer, messages)
    if chat_tokens == "all":
        return ids, [True] * len(ids)
    distilled = [False] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = _common_prefix(ids, _chat_ids(tokenizer, messages[:i], generation_prompt=True))
        end = len(_chat_ids(tokenizer, messages[: i + 1]))
        # position t predicts token t + 1: the answer's tokens are predicted from start - 1 to end - 2
        for t in range(max(start - 1, 0), end - 1):
            distilled[t] = True
    return ids, distilled


def chat_prompt_batch(tokenizer, prompts: list[str]) -> dict:
    """``prompts`` as one user turn each plus the generation prompt, left-padded into one batch: the inputs of
    ``generate`` (answers start right after every prompt)."""
    tokenizer.padding_side = "left"
    return tokenizer.apply_chat_template(
        [[{"role": "user", "content": p}] for p in prompts],
        add_generation_prompt=True,
        padding=True,
        return_tensors="pt",
        return_dict=True,
    )


def _chat_ids(tokenizer, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    if not messages:
        return []
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic ``(train, validation)`` record indices: a seeded permutation, the first part validates."""
    if n == 0:
        return [], []
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = min(n - 1, math.ceil(n * val_fraction)) if val_fraction > 0 else 0
    return sorted(order[n_val:]), sorted(order[:n_val])


def pack(
    sequences: Sequence[list[int]], max_length: int, distilled: Sequence[list[bool]] | None = None
) -> list[dict]:
    """Concatenate sequences into rows of ``max_length`` tokens; a sequence crossing a row end continues in the
    next row (positions restart there). Returns ``{"input_ids", "segments": [lengths...], "distilled"}`` per row
    (``distilled``: per token, from ``distilled`` or all True); the last row may be shorter (the collator pads
    it)."""
    rows: list[dict] = []
    ids: list[int] = []
    flags: list[bool] = []
    segments: list[int] = []
    for index, sequence in enumerate(sequences):
        rest = list(sequence)
        rest_flags = list(distilled[index]) if distilled is not None else [True] * len(rest)
        while rest:
            take = min(len(rest), max_length - len(ids))
            ids.extend(rest[:take])
            flags.extend(rest_flags[:take])
            segments.append(take)
            rest, rest_flags = rest[take:], rest_flags[take:]
            if len(ids) == max_length:
                rows.append({"input_ids": ids, "segments": segments, "distilled": flags})
                ids, segments, flags = [], [], []
    if ids:
        rows.append({"input_ids": ids, "segments": segments, "distilled": flags})
    return rows


def unpacked(
    sequences: Sequence[list[int]], max_length: int, distilled: Sequence[list[bool]] | None = None
) -> list[dict]:
    """One row per sequence, truncated to ``max_length``."""
    rows = []
    for index, s in enumerate(sequences):
        if s:
            flags = list(distilled[index]) if distilled is not None else [True] * len(s)
            n = min(len(s), max_length)
            rows.append({"input_ids": list(s[:n]), "segments": [n], "distilled": flags[:n]})
    return rows


def collate(rows: Sequence[dict], pad_id: int = 0, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Batch rows into ``input_ids``, ``position_ids`` (restarting per packed sequence), ``token_mask`` (real
    tokens), ``loss_mask`` (the distilled ones: real and flagged in the row's ``distilled``) and ``labels`` (the
    next token of the same sequence, ``-100`` at each sequence's last token).

    Padding is on the right and gets its own positions (a separate "sequence"), so real tokens never see it.
    """
    length = max(pad_to or 0, max(len(r["input_ids"]) for r in rows))
    batch = {
        "input_ids": torch.full((len(rows), length), pad_id, dtype=torch.long),
        "position_ids": torch.zeros((len(rows), length), dtype=torch.long),
        "token_mask": torch.zeros((len(rows), length), dtype=torch.bool),
        "loss_mask": torch.zeros((len(rows), length), dtype=torch.bool),
        "labels": torch.full((len(rows), length), IGNORE, dtype=torch.long),
    }
    for i, row in enumerate(rows):
        ids = torch.tensor(row["input_ids"], dtype=torch.long)
        n = len(ids)
        batch["input_ids"][i, :n] = ids
        batch["token_mask"][i, :n] = True
        batch["loss_mask"][i, :n] = torch.tensor(row.get("distilled", [True] * n), dtype=torch.bool)
        start = 0
        for seg in row["segments"]:
            batch["position_ids"][i, start : start + seg] = torch.arange(seg)
            batch["labels"][i, start : start + seg - 1] = ids[start + 1 : start + seg]
            start += seg
        batch["position_ids"][i, n:] = torch.arange(length - n)
    return batch


def evenly_spaced(rows: list, count: int) -> list:
    """``count`` rows spread evenly over ``rows`` (all of them if there are no more than ``count``)."""
    if len(rows) <= count:
        return list(rows)
    return [rows[i * len(rows) // count] for i in range(count)]


class RowsDataset(Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


class SkippingDistributedSampler(DistributedSampler):
    """``DistributedSampler`` (a seeded permutation per epoch) that can start mid-epoch (after ``skip`` indices)."""

    skip = 0

    def __iter__(self):
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])


class ResumableDataLoader(DataLoader):
    """A DataLoader whose position inside an epoch travels in Lightning checkpoints, so resuming from a mid-epoch
    checkpoint continues with exactly the batches an uninterrupted run would have seen.

    ``progress()`` returns the batches processed so far in the current epoch (Lightning's counter: the loader's own
    count would include the batch Lightning prefetches)."""

    def __init__(self, *args, progress=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._progress = progress
        self._resume: tuple[int, int] | None = None

    def state_dict(self) -> dict:
        return {"epoch": self.sampler.epoch, "batches_done": int(self._progress()) if self._progress else 0}

    def load_state_dict(self, state: dict) -> None:
        self._resume = (state["epoch"], state["batches_done"])

    def __iter__(self):
        if self._resume is not None:
            epoch, done = self._resume
            self._resume = None
            if epoch == self.sampler.epoch:
                self.sampler.skip = done * self.batch_size
        return super().__iter__()


class DistillDataModule(L.LightningDataModule):
    """Local files -> tokenised, packed, deterministically split distillation batches.

    Args:
        model: the model whose tokenizer and context length apply: a local HF checkpoint or ``"default"``.
        train_files: jsonl / json / parquet / txt files (see the module docstring for record formats).
        val_files: held-out files; when empty, ``val_fraction`` of the train records is held out. A mapping of
            names to files validates on each set separately (e.g. ``{text: [...], chat: [...]}``: prose and chat
            side by side); the first set's metrics are logged as ``val/kl``..., the others' as
            ``val/<name>/kl``...
        chat_tokens: which positions of chat / prompt + answer records are distilled: ``answers`` (those that
            predict the assistant's tokens) or ``all`` (see the module docstring).
        val_fraction: fraction of records held out when ``val_files`` is empty.
        max_length: tokens per row (the packed sequence length); must not exceed the model's context.
        pack: concatenate sequences into full rows (no padding); else one sequence per row, truncated.
        batch_size: rows per step and process.
        val_batch_size: rows per validation step (default: ``batch_size``).
        max_train_rows / max_val_rows: cap on rows (after packing; 0: no cap), for quick runs. Capped validation
            rows are spread evenly over the held-out data (every file, every genre), not taken from its start.
        seed: seed of the split and of the shuffling (one permutation per epoch).
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        model: str = "default",
        train_files: list[str] | None = None,
        val_files: list[str] | dict[str, list[str]] | None = None,
        val_fraction: float = 0.05,
        max_length: int = 512,
        pack: bool = True,
        batch_size: int = 4,
        val_batch_size: int | None = None,
        max_train_rows: int = 0,
        max_val_rows: int = 0,
        seed: int = 0,
        num_workers: int = 0,
        chat_tokens: str = "answers",
    ):
        super().__init__()
        if not train_files:
            raise DataError("train_files is empty: give at least one jsonl / json / parquet / txt file.")
        if max_length < 2:
            raise DataError(f"max_length must be >= 2, got {max_length}.")
        if not 0 <= val_fraction < 1:
            raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}.")
        if chat_tokens not in CHAT_TOKENS:
            raise DataError(f"chat_tokens must be one of {list(CHAT_TOKENS)}, got {chat_tokens!r}.")
        self.save_hyperparameters()
        self.model_path = model
        self.train_files = list(train_files)
        # named validation sets; "" is the unnamed one (a plain list, or the train split)
        sets = val_files if isinstance(val_files, dict) else {"": list(val_files or [])}
        if any(not files for files in sets.values()) and len(sets) > 1:
            raise DataError(f"val_files: every named set needs at least one file, got {dict(sets)}.")
        self.val_sets = {str(name): list(files) for name, files in sets.items()}
        self.train_rows: list[dict] | None = None
        self.val_rows: list[dict] | None = None  # the first set's rows
        self.val_set_rows: dict[str, list[dict]] = {}
        self.tokenizer = None

    def _load_tokenizer(self):
        from transformers import AutoConfig, AutoTokenizer

        from swiftkv_core.default_model import resolve_model_path

        path = resolve_model_path(self.model_path)
        config = AutoConfig.from_pretrained(path)
        limit = getattr(config, "max_position_embeddings", None)
        if limit is not None and self.hparams.max_length > limit:
            raise DataError(
                f"max_length={self.hparams.max_length} exceeds the model's context "
                f"(max_position_embeddings={limit}) in {path}."
            )
        return AutoTokenizer.from_pretrained(path)

    @property
    def val_files(self) -> list[str]:
        return [f for files in self.val_sets.values() for f in files]

    @property
    def val_set_names(self) -> list[str]:
        """The validation sets' names, in dataloader order (the first set's metrics are logged without one)."""
        return list(self.val_set_rows)

    def build(self) -> None:
        """Read, check, tokenise, split and pack (idempotent). Called by ``setup``; errors come before compute."""
        if self.train_rows is not None:
            return
        hp = self.hparams
        from .corpora import resolve_files

        self.tokenizer = tokenizer = self._load_tokenizer()
        train_records = load_records(resolve_files(self.train_files, self.model_path))
        val_records = {
            name: load_records(resolve_files(files, self.model_path))
            for name, files in self.val_sets.items()
            if files
        }
        every = train_records + [r for records in val_records.values() for r in records]
        if any(record_kind(r) != "text" for r in every) and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"The data holds chat / prompt records but the tokenizer of {self.model_path} has no "
                "chat template. Use a chat (instruct) model, set tokenizer.chat_template, or give text."
            )
        if not val_records:
            train_idx, val_idx = split_indices(len(train_records), hp.val_fraction, hp.seed)
            val_records = {"": [train_records[i] for i in val_idx]}
            train_records = [train_records[i] for i in train_idx]
        self.train_rows = self._rows(train_records)
        if hp.max_train_rows:
            self.train_rows = self.train_rows[: hp.max_train_rows]
        for name, records in val_records.items():
            rows = self._rows(records)
            self.val_set_rows[name] = evenly_spaced(rows, hp.max_val_rows) if hp.max_val_rows else rows
        self.val_rows = next(iter(self.val_set_rows.values()))
        if not self.train_rows:
            raise DataError("No training rows after tokenisation.")

    def _rows(self, records: list[dict]) -> list[dict]:
        encoded = [encode_record(r, self.tokenizer, self.hparams.chat_tokens) for r in records]
        shape = pack if self.hparams.pack else unpacked
        return shape([ids for ids, _ in encoded], self.hparams.max_length, [d for _, d in encoded])

    def prepare_data(self) -> None:
        from .corpora import resolve_files

        resolve_files(
            self.train_files + self.val_files, self.model_path
        )  # recipe files, once, on one process

    def setup(self, stage: str | None = None) -> None:
        self.build()

    @property
    def pad_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    def _collate(self, rows):
        return collate(rows, self.pad_id, self.hparams.max_length if self.hparams.pack else None)

    def _sampler(self, dataset, shuffle: bool):
        trainer = getattr(self, "trainer", None)
        replicas = trainer.world_size if trainer is not None else 1
        rank = trainer.global_rank if trainer is not None else 0
        # Explicit DistributedSampler (also for one process): a seeded permutation per epoch, which Lightning
        # keeps as is and advances with set_epoch, so a resumed run sees the same batches.
        return SkippingDistributedSampler(
            dataset,
            num_replicas=replicas,
            rank=rank,
            shuffle=shuffle,
            seed=self.hparams.seed,
            drop_last=shuffle,
        )

    def _batches_done(self) -> int:
        trainer = getattr(self, "trainer", None)
        return trainer.fit_loop.epoch_loop.batch_progress.current.processed if trainer is not None else 0

    def train_dataloader(self) -> DataLoader:
        dataset = RowsDataset(self.train_rows)
        return ResumableDataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            sampler=self._sampler(dataset, True),
            collate_fn=self._collate,
            num_workers=self.hparams.num_workers,
            drop_last=True,
            progress=self._batches_done,
        )

    def kv_init_dataloader(self, num_tokens: int) -> DataLoader:
        """This process's share of ``num_tokens`` training tokens, for the least-squares K/V initialisation: a
        seeded sample of rows (the same rows for any number of processes, their count rounded up to a multiple of
        it), split among the processes."""
        trainer = getattr(self, "trainer", None)
        world = trainer.world_size if trainer is not None else 1
        rank = trainer.global_rank if trainer is not None else 0
        rows = math.ceil(num_tokens / self.hparams.max_length)
        rows = min(len(self.train_rows), math.ceil(rows / world) * world)
        order = torch.randperm(
            len(self.train_rows), generator=torch.Generator().manual_seed(self.hparams.seed + 1)
        )
        chosen = [self.train_rows[i] for i in order[:rows].tolist()]
        return DataLoader(
            RowsDataset(chosen[rank::world]),
            batch_size=self.hparams.batch_size,
            collate_fn=self._collate,
        )

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """One loader per validation set (a single loader when there is one set)."""
        loaders = [self._val_loader(rows) for rows in self.val_set_rows.values()]
        return loaders[0] if len(loaders) == 1 else loaders

    def _val_loader(self, rows: list[dict]) -> DataLoader:
        dataset = RowsDataset(rows)
        return DataLoader(
            dataset,
            batch_size=self.hparams.val_batch_size or self.hparams.batch_size,
            sampler=self._sampler(dataset, False),
            collate_fn=self._collate,
            num_workers=self.hparams.num_workers,
        )
