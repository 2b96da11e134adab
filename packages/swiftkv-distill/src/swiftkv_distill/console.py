"""What a distillation tells its user. Lightning's output that no user can act on is silenced wherever a
distillation is built (``swiftkv distill fit``, the main job, the benchmarks): its LitLogger advertisement, the model
summary's caveat that it sizes bf16 weights as fp32, and a torch deprecation raised inside Lightning's own code;
everything else it says (devices, precision, checkpoints, why a fit stopped) stays. A fit that runs out of GPU
memory ends with what to change, in the recipe's own keys, instead of the allocator's traceback."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from swiftkv_core.runtime import device_description

_WARNINGS = (
    r"Precision .* is not supported by the model summary",  # only the summary's "params size (MB)" line is off
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # lightning.pytorch.utilities._pytree on torch 2.13
    # on several processes: the validation metrics are torchmetrics', summed over the processes as they are computed
    r"It is recommended to use `self.log\('val/.*sync_dist=True\)`",
)
# rank_zero_info's loggers (the pytorch one is the one in use once lightning.pytorch is imported)
_INFO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _NoTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip")


def quiet_lightning() -> None:
    """Filter Lightning's unactionable output for the rest of the process (idempotent)."""
    for message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name in _INFO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTips) for f in logger.filters):
            logger.addFilter(_NoTips())


class OutOfMemory(MemoryError):
    """A distillation that did not fit its device's memory; the message says what to change."""


class Phases:
    """A LightningModule's ``phase``: the work before the first step now running, None in training (what
    ``out_of_memory_advice`` names). On a GPU each phase's peak-memory count starts afresh, so the peak the advice
    gives is the phase's own."""

    _phase: str | None = None

    @property
    def phase(self) -> str | None:
        return self._phase

    @phase.setter
    def phase(self, phase: str | None) -> None:
        self._phase = phase
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


@contextmanager
def told_out_of_memory(trainer, module, datamodule) -> Iterator[None]:
    """Around ``trainer.fit``: a CUDA out-of-memory error becomes ``OutOfMemory`` with ``out_of_memory_advice``."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        raise OutOfMemory(out_of_memory_advice(trainer, module, datamodule)) from error


def out_of_memory_advice(trainer, module, datamodule) -> str:
    """Where, when and in what the memory ran out, and the recipe's keys that lower that phase's memory, those not
    in use yet first."""
    hp, data = module.hparams, datamodule.hparams
    device = trainer.strategy.root_device
    where = device_description(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        where += f" ({total:.0f} GiB, {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB of tensors at its peak in this phase)"
    phase, step = running_phase(trainer, module), trainer.global_step
    if phase == "training":
        when = (
            "before the first step ended" if step == 0 else f"in step {step + 1} (the {step} before it fit)"
        )
    else:
        when = f"validating after step {step}" if phase == "validating" else f"before the first step, {phase}"
    changes = []
    if phase == "training" and not hp.activation_checkpointing:  # the phases before it keep no activations
        changes.append("model.activation_checkpointing: 1 (recomputes the layers >= l in the backward pass)")
    if phase != "fitting the least-squares K/V init":  # the fit reads hidden states, no logits
        changes.append(
            f"a smaller model.logits_chunk_size ({hp.logits_chunk_size} positions of full-vocabulary logits now)"
        )
    if hp.model_dtype == "float32" and hp.frozen_dtype in (None, "float32"):
        changes.append(
            "model.frozen_dtype: bfloat16 with trainer.precision: bf16-mixed (fp32 only where weights train)"
        )
    if phase.startswith("evaluating") or phase == "validating":
        rows = data.val_batch_size or data.batch_size
        changes.append(f"a smaller data.val_batch_size ({rows} rows per validation step now)")
    else:
        changes.append(
            f"a smaller data.batch_size or data.max_length ({data.batch_size} x {data.max_length} tokens per step "
            "and process now)"
        )
    if trainer.world_size == 1:
        changes.append(
            "more GPUs: FSDP2 shards every weight over them (llama-3.1-8b-instruct.yaml's strategy)"
        )
    return (
        f"out of memory on {where} {when}. To fit: "
        + "; or ".join(changes)
        + ". Checkpoints written so far are kept: a resume may change model.activation_checkpointing, "
        "model.logits_chunk_size and data.val_batch_size; the other changes train differently and start a new run "
        "(another --trainer.default_root_dir)."
    )


def running_phase(trainer, module) -> str:
    """What the run was doing: Lightning's validation, the work ``SwiftKVDistillation.on_train_start`` runs before
    the first step (its ``phase``: the measurements, the K/V fit), or a training step."""
    if trainer.validating or trainer.sanity_checking:
        return "validating"
    return module.phase or "training"
