"""A live progress bar for a distillation budgeted in training time, which also ends the run when it is spent."""

from __future__ import annotations

import lightning as L


class BudgetProgress(L.Callback):
    """One line, updated every step: time spent / budget, step, tokens/s, loss, ETA. Stops the fit at the budget.

    The clock is the module's ``train_seconds`` (from the first step, summed over resumed runs), the same clock as
    the learning-rate schedule under ``schedule_seconds``: a resumed run continues the bar and the schedule alike.
    """

    def __init__(self, budget_seconds: float):
        self.budget = float(budget_seconds)
        self._bar = None

    def on_train_start(self, trainer, pl_module) -> None:
        # after the module's own on_train_start (evaluation before training, K/V fit): Lightning calls callbacks first,
        # so the bar is opened lazily at the first step instead
        self._bar = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.is_global_zero:
            return self._stop_if_spent(trainer, pl_module)
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=round(self.budget), unit="s", desc="   distill", dynamic_ncols=True,
                bar_format="{desc} {percentage:3.0f}%|{bar}| {n:.0f}/{total} s{postfix}",
            )  # fmt: skip
        spent = min(pl_module.train_seconds, self.budget)
        metrics = trainer.callback_metrics
        postfix = {"step": trainer.global_step}
        if "train/tokens_per_s" in metrics:
            postfix["tok/s"] = f"{float(metrics['train/tokens_per_s']):.0f}"
        if "train/loss" in metrics:
            postfix["loss"] = f"{float(metrics['train/loss']):.4f}"
        postfix["ETA"] = f"{(self.budget - spent) / 60:.1f} min"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(round(spent) - self._bar.n)
        self._stop_if_spent(trainer, pl_module)

    def _stop_if_spent(self, trainer, pl_module) -> None:
        if pl_module.train_seconds >= self.budget:
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
