"""The Lightning data module of a distillation: local files (or named offline data sets) -> checked, tokenised
and split (``data.py``), packed into rows made once into the token cache (``tokens.py``) -> batches
(``batches.collate``), with a seeded sampler that resumes mid-epoch exactly."""

from __future__ import annotations

import hashlib
import json
import math
from contextlib import closing
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from swiftkv_core.atomic import made_once, scratch_directory
from swiftkv_core.faults import pause_point
from swiftkv_core.runtime import stack_versions

from .batches import (
    EvenSampler,
    ResumableDataLoader,
    RowsDataset,
    SkippingDistributedSampler,
    check_same_rows,
    collate,
    rows_summary,
)
from .corpora import dataset_name, resolve_files
from .data import (
    CHAT_TOKENS,
    DataError,
    RecordSet,
    check_file,
    encoding_processes,
    evenly_spaced,
    file_identity,
    record_sets,
    tokenise,
)
from .parallelize import gathered, on_every_process
from .tokens import (
    TOKEN_CACHE_FORMAT,
    RowWriter,
    TokenRows,
    cache_unwritable,
    read_sets,
    set_sha256,
    token_cache_dir,
    tokenizer_identity,
    write_sets,
)


class DistillDataModule(L.LightningDataModule):
    """Local files -> tokenised, packed, deterministically split distillation batches.

    Args:
        model: the model whose tokenizer and context length apply: a local HF checkpoint or ``"default"``.
        train_files: jsonl / json / parquet / txt files (record formats: ``data.py``), or ``dataset:NAME`` for an
            offline data set (``corpora.py``).
        val_files: held-out files; when empty, ``val_fraction`` of the train records is held out. A mapping of
            names to files validates on each set separately (e.g. ``{text: [...], chat: [...]}``: prose and chat
            side by side); the first set's metrics are logged as ``val/kl``..., the others' as
            ``val/<name>/kl``...
        chat_tokens: which positions of chat / prompt + answer records are distilled: ``answers`` (those that
            predict the assistant's tokens) or ``all`` (see ``data.py``).
        val_fraction: fraction of records held out when ``val_files`` is empty.
        max_length: tokens per row (the packed sequence length); must not exceed the model's context.
        pack: concatenate sequences into full rows (no padding); else one sequence per row, truncated.
        batch_size: rows per step and process.
        val_batch_size: rows per validation step (default: ``batch_size``).
        max_train_rows / max_val_rows: cap on rows (after packing; 0: no cap), for quick runs. Capped rows are
            spread evenly over the data (every file, every genre), not taken from its start.
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
            raise DataError(
                "train_files is empty: give at least one jsonl / json / parquet / txt file (distill fit: "
                "--data.train_files '[FILE, ...]'; the recipes of 7-70B models name none: the data is yours)."
            )
        if max_length < 2:
            raise DataError(f"max_length must be >= 2, got {max_length}.")
        if not 0 <= val_fraction < 1:
            raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}.")
        if chat_tokens not in CHAT_TOKENS:
            raise DataError(f"chat_tokens must be one of {list(CHAT_TOKENS)}, got {chat_tokens!r}.")
        for name, value in {"batch_size": batch_size, "val_batch_size": val_batch_size or 1}.items():
            if value < 1:
                raise DataError(
                    f"{name} must be a positive integer (rows per step and process), got {value}."
                )
        for name, value in {"max_train_rows": max_train_rows, "max_val_rows": max_val_rows}.items():
            if value < 0:
                raise DataError(f"{name} must be >= 0 (0: all rows), got {value}.")
        self.save_hyperparameters()
        self.model_path = model
        self.train_files = list(train_files)
        # named validation sets; "" is the unnamed one (a plain list, or the train split)
        sets = val_files if isinstance(val_files, dict) else {"": list(val_files or [])}
        if any(not files for files in sets.values()) and len(sets) > 1:
            raise DataError(f"val_files: every named set needs at least one file, got {dict(sets)}.")
        self.val_sets = {str(name): list(files) for name, files in sets.items()}
        # every local file there, on each process, before anything is launched or computed (dataset:NAME sets are
        # made when the data is prepared)
        for file in [*self.train_files, *(f for files in self.val_sets.values() for f in files)]:
            if dataset_name(file) is None:
                check_file(Path(file))
        self.train_rows: list[dict] | None = None
        # the digest of the training set's rows, all of them (``TokenRows.sha256``), for a resume to compare
        self.train_rows_sha256: str | None = None
        self.val_rows_sha256: list[str] = []  # each validation set's, whole
        self.val_rows: list[dict] | None = None  # the first set's rows
        self.val_set_rows: dict[str, list[dict]] = {}
        self.tokenizer = None
        self._not_prepared: Exception | None = None  # prepare_data's failure (setup raises it)

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
    def val_set_names(self) -> list[str]:
        """The validation sets' names, in dataloader order (the first set's metrics are logged without one)."""
        return list(self.val_set_rows)

    def build(self) -> None:
        """Read, check, tokenise, split and pack (idempotent): the rows of the token cache (``token_rows_folder``),
        memory-mapped. Called by ``setup``; errors come before compute."""
        if self.train_rows is not None:
            return
        hp = self.hparams
        self.tokenizer = self._load_tokenizer()
        folder = self.token_rows_folder(self.tokenizer)
        sets = read_sets(folder)
        self.train_rows, self.train_rows_sha256 = sets["train"], set_sha256(folder, "train")
        if hp.max_train_rows:  # spread over the data (every file, every genre), as the validation rows
            self.train_rows = self.train_rows.subset(
                evenly_spaced(range(len(self.train_rows)), hp.max_train_rows)
            )
        self.val_rows_sha256 = [set_sha256(folder, f"val{i}") for i in range(len(self.val_sets))]
        for i, name in enumerate(self.val_sets):
            rows = sets[f"val{i}"]
            self.val_set_rows[name] = (
                rows.subset(evenly_spaced(range(len(rows)), hp.max_val_rows)) if hp.max_val_rows else rows
            )
        self.val_rows = next(iter(self.val_set_rows.values()))
        if not self.train_rows:
            raise DataError("No training rows after tokenisation.")
        for name, rows in {"training": self.train_rows, **self.val_set_rows}.items():
            if rows and not rows.any_distilled():
                raise DataError(
                    f"The {name or 'validation'} data has no token to distil: with chat_tokens "
                    f"'{hp.chat_tokens}' only the tokens of assistant answers are, and its records have none "
                    "(chat records without an assistant turn, or answers cut off by max_length without packing). "
                    "Give the prompts as 'prompt' records (every token distilled), have the teacher answer them "
                    "(swiftkv prepare-data answer), set data.chat_tokens all, or give text."
                )

    def token_rows_folder(self, tokenizer) -> Path:
        """The token cache's folder (``tokens.token_cache_dir()``) of this data, tokenizer and row settings, made
        here unless another process made it: one process tokenises (Lightning's ``prepare_data``: one per node),
        the others wait for it or find it made. Every process then maps the same files (the page cache holds one
        copy per node), and a resumed or repeated run reads them again."""
        hp = self.hparams
        train_files = resolve_files(self.train_files, self.model_path)
        val_files = {
            name: resolve_files(files, self.model_path) for name, files in self.val_sets.items() if files
        }
        made_from = {
            "format": TOKEN_CACHE_FORMAT,
            "libraries": stack_versions(("transformers", "tokenizers", "jinja2")),
            "train_files": [file_identity(f) for f in train_files],
            # in the order of the sets: they are kept by position
            "val_files": [[name, [file_identity(f) for f in files]] for name, files in val_files.items()],
            "tokenizer": tokenizer_identity(tokenizer),
            **{key: hp[key] for key in ("max_length", "pack", "chat_tokens")},
            # torch draws the split (``torch.randperm``) and is left out: a torch upgrade keeps the cached rows (a
            # resume goes on, no corpus is tokenised again), and a node whose torch draws another split is refused
            # by ``check_same_rows``
            **({} if val_files else {"val_fraction": hp.val_fraction, "seed": hp.seed}),
        }
        key = hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()[:16]
        try:
            return made_once(
                token_cache_dir() / key,
                lambda folder: (folder / "sets.json").is_file(),
                lambda staging: write_sets(
                    staging, self._tokenise(tokenizer, train_files, val_files, staging), made_from
                ),
                waiting=f"waiting for another process tokenising the data into {token_cache_dir() / key}",
            )
        except OSError as error:
            if not cache_unwritable(error):
                raise
            raise DataError(
                f"The token cache {token_cache_dir()} cannot be written ({error.strerror}: {error.filename}): the "
                "rows need about 5 bytes a token there, and a copy of the data files while they are made. Set "
                "SWIFTKV_TOKENS_DIR (or SWIFTKV_CACHE_DIR) to a writable folder with room."
            ) from None

    def _tokenise(
        self, tokenizer, train_files: list[str], val_files: dict[str, list[str]], folder: Path
    ) -> dict[str, TokenRows]:
        """The rows of each record set (``data.record_sets``: ``train``, ``val0``...), written into ``folder``: the
        files checked, then their records streamed a chunk at a time from Arrow copies made beside ``folder`` (in
        the token cache: where the rows fit, the copies do), removed after."""
        with scratch_directory(folder.parent, ".arrow-") as arrow:
            hp = self.hparams
            sets = record_sets(train_files, list(val_files.values()), hp.val_fraction, hp.seed, Path(arrow))
            return self._write_rows(tokenizer, sets, folder)

    def _write_rows(self, tokenizer, sets: dict[str, RecordSet], folder: Path) -> dict[str, TokenRows]:
        hp = self.hparams
        if any(s.kinds - {"text"} for s in sets.values()) and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"The data holds chat / prompt records but the tokenizer of {self.model_path} has no "
                "chat template. Use a chat (instruct) model, set tokenizer.chat_template, or give text."
            )
        rows = {}
        # a bar from a long tokenisation's tenth second
        with tqdm(total=sum(map(len, sets.values())), desc="tokenising", unit="record", delay=10) as bar:
            for name, records in sets.items():
                processes = encoding_processes(records.kinds, len(records))
                chunks = tokenise(records.chunks(), tokenizer, hp.chat_tokens, processes)
                writer = RowWriter(hp.max_length, hp.pack, into=folder / name)
                with closing(chunks), closing(writer):
                    for ids, distilled, lengths in chunks:
                        writer.add_many(ids, distilled, lengths)
                        bar.set_postfix_str(f"{writer.num_tokens:,} tokens of {name}", refresh=False)
                        bar.update(len(lengths))
                        pause_point("token-rows")  # rows in the staging folder, Arrow copies beside it
                    rows[name] = writer.rows()
        return rows

    def check_batches(self, processes: int) -> None:
        """Refuse training rows too few for one batch on each of ``processes``: every process drops its last,
        incomplete batch, so the fit would run no step and export the untrained model as if distilled."""
        rows, batch_size = len(self.train_rows), self.hparams.batch_size
        if rows < batch_size * processes:
            raise DataError(
                f"{rows} training row(s) of up to {self.hparams.max_length} tokens make no batch of "
                f"batch_size {batch_size} on {processes} process(es): give more training data, or a smaller "
                "data.batch_size."
            )

    def prepare_data(self) -> None:
        """On one process per node, before the others set up (Lightning's call): the named data sets are prepared
        and the data tokenised into the token cache. On several processes a failure is kept for ``setup``, which
        raises it on every process: the other nodes' processes would otherwise wait for this node's at their next
        collective until the process group's timeout."""
        self._not_prepared = None
        try:
            self.token_rows_folder(self._load_tokenizer())
        except Exception as error:
            trainer = getattr(self, "trainer", None)
            if trainer is None or trainer.world_size == 1:
                raise
            self._not_prepared = error

    def setup(self, stage: str | None = None) -> None:
        """The rows (``build``) on every process, checked before the model's weights are read (configure_model):
        the same rows and settings on every process (``check_same_rows``), and a batch for each. A failure on
        one process is raised on all (``on_every_process``), a failed ``prepare_data`` first (so that its node's
        other processes do not make the rows again)."""
        trainer = getattr(self, "trainer", None)

        def prepared() -> None:
            failure, self._not_prepared = self._not_prepared, None
            if failure is not None:
                raise failure

        def rows() -> dict:
            self.build()
            return rows_summary(self, trainer)

        on_every_process(prepared)
        check_same_rows(gathered(on_every_process(rows)))
        if stage == "fit" and trainer is not None:
            self.check_batches(trainer.world_size)

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
        return (SkippingDistributedSampler if shuffle else EvenSampler)(
            dataset,
            num_replicas=replicas,
            rank=rank,
            shuffle=shuffle,
            seed=self.hparams.seed,
            drop_last=shuffle,
        )

    def state_dict(self, trainer=None) -> dict:
        """What Lightning's checkpoints keep of the data (``build.check_same_run`` compares it on a resume): the
        checkpoint's position in an epoch counts each process's batches of a permutation of the training rows, and
        the schedule's length follows the processes and the batches accumulated per step. Another count of either
        on a resume would train rows again (or never) and jump the learning rate; so would data files that now
        make another number of rows (rows added to them). Other rows of the same number (a data file edited, the
        tokenizer changed: ``training_rows_sha256``, of the whole training set, ``max_train_rows`` or not) would
        train the rest of the run on other data than its start.
        ``trainer``: the one to fit, before it is attached."""
        trainer = trainer or getattr(self, "trainer", None)
        if trainer is None:
            return {}
        state = {"world_size": trainer.world_size, "accumulate_grad_batches": trainer.accumulate_grad_batches}
        if self.train_rows is not None:
            state |= {"training_rows": len(self.train_rows), "training_rows_sha256": self.train_rows_sha256}
        return state

    def _batches_done(self) -> int:
        trainer = getattr(self, "trainer", None)
        return trainer.fit_loop.epoch_loop.batch_progress.current.processed if trainer is not None else 0

    def _epoch(self) -> int:
        trainer = getattr(self, "trainer", None)
        return trainer.fit_loop.epoch_progress.current.processed if trainer is not None else 0

    def train_batches_per_epoch(self) -> int:
        """The training batches of one epoch on each process (what Lightning counts, without iterating the loader):
        each process's share of the rows (``DistributedSampler``, ``drop_last``), in whole batches, limited."""
        trainer = getattr(self, "trainer", None)
        world = trainer.world_size if trainer is not None else 1
        return self._batches_per_epoch(len(self.train_rows) // world // self.hparams.batch_size)

    def _batches_per_epoch(self, batches: int) -> int:
        """As Lightning limits an epoch (``Trainer(limit_train_batches=)``: a count, or a fraction)."""
        trainer = getattr(self, "trainer", None)
        limit = trainer.limit_train_batches if trainer is not None else 1.0
        return min(batches, limit) if isinstance(limit, int) else int(batches * limit)

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
            epoch=self._epoch,
            batches_per_epoch=self._batches_per_epoch,
        )

    def kv_init_dataloader(self, num_tokens: int) -> DataLoader:
        """This process's share of ``num_tokens`` training tokens, for the least-squares K/V initialisation: a
        seeded sample of rows (the same rows for any number of processes, their count rounded up to a multiple of
        it, or down where the training rows are fewer), split evenly among the processes: under FSDP2 every
        process must run as many forwards as the others, or their collectives would wait on each other for ever."""
        trainer = getattr(self, "trainer", None)
        world = trainer.world_size if trainer is not None else 1
        rank = trainer.global_rank if trainer is not None else 0
        rows = math.ceil(math.ceil(num_tokens / self.hparams.max_length) / world) * world
        rows = min(rows, len(self.train_rows) // world * world)
        if rows == 0:
            raise DataError(
                f"The K/V fit needs a training row per process: {len(self.train_rows)} training rows for {world} "
                "processes. Give more training data, or set model.kv_init: published (no fit)."
            )
        order = torch.randperm(
            len(self.train_rows), generator=torch.Generator().manual_seed(self.hparams.seed + 1)
        )
        chosen = self.train_rows.subset(order[:rows].numpy())
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
