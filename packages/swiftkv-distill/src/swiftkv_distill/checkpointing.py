"""Lightning checkpoints that a killed save never spoils, the one a rerun resumes from, and what they hold: the
trained weights alone (``TrainedWeightsOnly``).

Lightning writes a checkpoint over the previous one. A sharded one (FSDP2 through ``ModelParallelStrategy``: a
folder, each rank writing its own shards) goes into the existing folder for as long as the save takes (minutes at
70B); a one-file one goes through a temporary file in ``$TMPDIR``, moved into place, which is a rename on the same
file system only: elsewhere (a container's /tmp and a mounted output folder, a node-local /tmp) the move copies into
the checkpoint's own file. A process killed then leaves a checkpoint of old and new shards, or a truncated file,
which the next run would resume from. ``ModelCheckpoint`` here stages either beside its target and moves it into
place whole (a rename, flushed to the disk before and after: ``atomic.replace_file``, ``replace_directory``).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from weakref import proxy

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from swiftkv_core.atomic import replace_directory, replace_file, restore_set_aside
from swiftkv_core.faults import pause_point

from .step import is_trained_name


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (same arguments) whose checkpoints replace the previous one whole: every rank
    writes into ``.NAME.staging`` beside the target (a file, or a folder of shards), and once all have, rank 0 moves
    it into place. A process killed during the save leaves the previous checkpoint as it was; killed between the two
    moves of a folder's swap, it leaves that checkpoint set aside, where ``last_checkpoint`` and
    ``ckpt_path="last"`` find it. While a checkpoint is saved, the disk holds it and the previous one: twice a
    checkpoint's size at the peak."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Lightning's, then what killed saves staged removed: it is never read, and one of a name saved again is
        removed then, but one of a name that does not come back (a metric in it) would stay."""
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and trainer.is_global_zero and self.dirpath:
            for staging in Path(self.dirpath).glob(f".*{self.FILE_EXTENSION}.staging"):
                _remove(staging)

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        """Lightning's, but never inside a gradient-accumulation window (a save by time may come at any batch):
        the checkpoint counts the window's batches as done, and a run resumed from it would skip them untrained."""
        if not trainer.fit_loop.epoch_loop._should_accumulate():
            super().on_train_batch_end(trainer, *args, **kwargs)

    def on_train_end(self, trainer, pl_module) -> None:
        """Lightning's last checkpoint of a run that saved none yet, but not inside an accumulation window either: a
        stop may come at any batch (``trainer.max_time``'s Timer). The last checkpoint saved then stays the one a
        rerun resumes from."""
        if not trainer.fit_loop.epoch_loop._should_accumulate():
            super().on_train_end(trainer, pl_module)
        elif self.save_last and not self._last_checkpoint_saved:
            rank_zero_info(
                "The run stopped inside a gradient-accumulation window (trainer.max_time stops at any batch): no "
                "checkpoint at its end, whose window's untrained batches would count as done; a rerun resumes "
                "from an earlier run's last checkpoint, where there is one, or starts over."
            )

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        target = Path(filepath)
        staging = target.with_name(f".{target.name}.staging")
        if trainer.is_global_zero:
            target.parent.mkdir(parents=True, exist_ok=True)
            restore_set_aside(target)  # a folder's swap a killed run left half done
            _remove(staging)  # a save a killed run left half written
        trainer.strategy.barrier("swiftkv-checkpoint-staging")
        trainer.save_checkpoint(str(staging), self.save_weights_only)
        # every rank's shards and rank 0's meta.pt written, or rank 0's file
        trainer.strategy.barrier("swiftkv-checkpoint-staged")
        if trainer.is_global_zero:
            # the new checkpoint whole beside the target, the old one in place
            pause_point("checkpoint-staged")
            if staging.is_dir():
                replace_directory(staging, target)
            else:
                replace_file(staging, target)
        trainer.strategy.barrier("swiftkv-checkpoint-in-place")
        # Lightning's bookkeeping after a save, the loggers told once the checkpoint is where it says
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _find_last_checkpoints(self, trainer) -> set[str]:
        """``ckpt_path="last"``'s candidates: Lightning's, and a last checkpoint a killed swap set aside."""
        found = super()._find_last_checkpoints(trainer)
        if self.dirpath:
            found |= {str(p) for p in Path(self.dirpath).glob(f".{self.CHECKPOINT_NAME_LAST}*.old.*")}
        return found


class TrainedWeightsOnly:
    """A LightningModule mixin: its state dict is its trained weights (``is_trained_name``). The frozen ones are the
    pretrained checkpoint's (``hparams.model``), read again on a resume. Lightning's checkpoints, one file or FSDP2's
    shards (whose saver and loader both ask the module's ``state_dict``), then hold the trained weights alone: the
    frozen ones are most of a model's bytes (``benchmarks/results/checkpoint-size.md``)."""

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        state = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        # in place (the dict's ``_metadata`` stays), and only this module's entries: a module holding this one
        # (Lightning's weight averaging) passes its own dict and prefix
        for name in [n for n in state if n.startswith(prefix) and not is_trained_name(n[len(prefix) :])]:
            del state[name]
        return state

    @property
    def strict_loading(self) -> bool:
        """What Lightning's loaders pass as ``strict``: True (every trained weight: ``load_state_dict``) but under
        FSDP2, whose loaders match the parameters themselves: a one-file checkpoint parameter by parameter, each
        frozen one wanted when strict, and a distributed one through DCP, which refuses a missing trained weight."""
        return self.device_mesh is None

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads what ``state_dict`` gives; ``strict``: every trained weight, and nothing else."""
        keys = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [name for name in keys.missing_keys if is_trained_name(name)]
        if strict and (missing or keys.unexpected_keys):
            raise RuntimeError(
                f"the checkpoint does not hold this run's trained weights: missing {missing[:4]}, unexpected "
                f"{keys.unexpected_keys[:4]}. Was it written by a run of another model, l or early-exit head?"
            )
        return keys._replace(missing_keys=missing)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def last_checkpoint(trainer) -> str | None:
    """The checkpoint ``ckpt_path="last"`` names, found as Lightning finds it before ``fit``: the newest of the
    last checkpoints of ``trainer``'s checkpoint callbacks (a file, or a folder of shards under FSDP2), a swap
    killed half way's set-aside one among them (``ModelCheckpoint._find_last_checkpoints``; put back at the next
    save). None where there is none (a new run), without Lightning's warning for that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*there is no last checkpoint available")
        connector = trainer._checkpoint_connector
        return connector._parse_ckpt_path(TrainerFn.FITTING, "last", True, model_connected=False)


def saved_run(path: str | Path) -> dict:
    """What a checkpoint holds besides its tensors (the settings and state of the run that wrote it), read without
    loading its weights: a file memory-mapped, or a distributed checkpoint's ``meta.pt`` (Lightning's; the shards
    beside it hold the tensors)."""
    path = Path(path)
    if path.is_dir():
        path = path / _METADATA_FILENAME
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
