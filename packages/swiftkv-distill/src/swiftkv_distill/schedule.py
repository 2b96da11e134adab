"""The learning-rate schedule: linear warm-up then cosine decay, over steps or over a wall-time budget."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from lightning.fabric.utilities import rank_zero_warn

FIRST_STEP_FLOOR = 0.01  # the smallest warm-up factor: never a zero learning rate at the first step


def check_optimizer_settings(
    learning_rate: float,
    weight_decay: float,
    betas: tuple[float, float],
    warmup_fraction: float,
    min_lr_ratio: float,
    schedule_seconds: float | None,
) -> None:
    """Refuse, before any weight is loaded, optimizer and schedule settings that AdamW or the schedule cannot use
    (or would use silently wrong: a negative ``min_lr_ratio`` ends the cosine at a negative learning rate)."""
    problems = [
        f"learning_rate must be >= 0, got {learning_rate}" if not learning_rate >= 0 else "",
        f"weight_decay must be >= 0, got {weight_decay}" if not weight_decay >= 0 else "",
        f"betas must be two numbers in [0, 1), got {betas}"
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas)
        else "",
        f"warmup_fraction must be in [0, 1], got {warmup_fraction}" if not 0 <= warmup_fraction <= 1 else "",
        f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}" if not 0 <= min_lr_ratio <= 1 else "",
        f"schedule_seconds must be > 0, got {schedule_seconds}"
        if schedule_seconds is not None and not schedule_seconds > 0
        else "",
    ]
    if problems := [p for p in problems if p]:
        raise ValueError("model." + "; model.".join(problems) + ".")


def warmup_cosine(progress: float, warmup_fraction: float, min_lr_ratio: float) -> float:
    """Learning-rate factor at ``progress`` (0..1) through the run: linear warm-up, then cosine to ``min_lr_ratio``."""
    progress = min(progress, 1.0)
    if progress < warmup_fraction:
        return progress / warmup_fraction
    decay = (progress - warmup_fraction) / max(1e-9, 1 - warmup_fraction)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * decay))


def run_progress(
    step: int,
    total_steps: int | None,
    elapsed_seconds: float | None = None,
    schedule_seconds: float | None = None,
) -> float:
    """How far through the run (0..1 and beyond): by steps, or by wall time when ``schedule_seconds`` is set,
    whichever is further."""
    progress = step / total_steps if total_steps else 0.0
    if schedule_seconds and elapsed_seconds is not None:
        progress = max(progress, elapsed_seconds / schedule_seconds)
    return progress


def lr_factor(
    progress: float, warmup_fraction: float, min_lr_ratio: float, floor: float = FIRST_STEP_FLOOR
) -> float:
    """``warmup_cosine``, at least ``floor`` during the warm-up (the first step already moves the weights)."""
    value = warmup_cosine(progress, warmup_fraction, min_lr_ratio)
    return max(value, floor) if progress < warmup_fraction else value


def total_steps(trainer) -> float:
    """The run's optimizer steps, for the schedule: Lightning's ``estimated_stepping_batches``, but for a run bound
    by epochs counted from the data module's rows. Lightning's estimate would build and iterate the training loader
    while the optimizers are configured, before a resumed run's loop state is restored, and the loader would never
    be told where the checkpoint stopped: the resumed epoch would start over from its first batch."""
    datamodule = trainer.datamodule
    if trainer.max_epochs in (-1, None) or not hasattr(datamodule, "train_batches_per_epoch"):
        return trainer.estimated_stepping_batches
    per_epoch = math.ceil(datamodule.train_batches_per_epoch() / trainer.accumulate_grad_batches)
    steps = per_epoch * trainer.max_epochs
    return steps if trainer.max_steps == -1 else min(steps, trainer.max_steps)


def check_run_length(trainer) -> None:
    """Refuse a run with no end in steps or epochs (``trainer.max_epochs`` -1, or unset beside ``max_time``, which
    Lightning reads as -1: it trains until the time is up): the learning-rate schedule needs a number of steps."""
    from lightning.pytorch.callbacks import Timer

    timed = any(isinstance(callback, Timer) for callback in trainer.callbacks)
    if trainer.max_steps == -1 and (trainer.max_epochs == -1 or (trainer.max_epochs is None and timed)):
        raise ValueError(
            "trainer.max_steps is -1 and trainer.max_epochs is not set: the run has no end in steps or epochs (at "
            "most trainer.max_time), and the learning-rate schedule no length. Set --trainer.max_steps (an upper "
            "bound will do: with --model.schedule_seconds the schedule follows the training time, whichever is "
            "further)."
        )


class StepSchedule(torch.optim.lr_scheduler.LambdaLR):
    """The run's learning rate per optimizer step: ``lr_factor`` of its progress through ``total_steps`` (or through
    ``schedule_seconds`` of training, ``elapsed()`` of them spent, whichever is further), the warm-up's first step
    at least ``1 / (total_steps + 1)``. Its checkpoint keeps the length: a run resumed with another one
    (``trainer.max_steps`` or ``max_epochs`` changed, to train for longer) goes on with the new length, and is told
    where the learning rate jumps."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_fraction: float,
        min_lr_ratio: float,
        schedule_seconds: float | None = None,
        elapsed: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.total_steps = total_steps
        floor = max(1.0 / (total_steps + 1), FIRST_STEP_FLOOR)

        def factor(step: int) -> float:
            progress = run_progress(step, total_steps, elapsed(), schedule_seconds)
            return lr_factor(progress, warmup_fraction, min_lr_ratio, floor)

        super().__init__(optimizer, factor)

    def load_state_dict(self, state_dict: dict) -> None:
        total = self.total_steps
        super().load_state_dict(state_dict)
        saved, self.total_steps = self.total_steps, total
        if saved != total:
            now = self.base_lrs[0] * self.lr_lambdas[0](self.last_epoch)
            rank_zero_warn(
                f"the run resumed at step {self.last_epoch} now spans {total} optimizer steps, the checkpoint's "
                f"{saved}: the learning-rate schedule follows the new length, and the learning rate goes "
                f"from {self._last_lr[0]:.3g} to {now:.3g}. Resume with the checkpoint's trainer.max_steps / "
                "max_epochs to keep its schedule."
            )
