"""Gradient accumulation: an optimizer step's gradient is the mean over every distilled position of its window's
batches, as one batch of all their rows gives (``step.AccumulationWindow``)."""

import lightning as L
import pytest
import torch

from swiftkv_distill import DistillDataModule, SwiftKVDistillation
from swiftkv_distill.callbacks import BudgetProgress
from tests.distill.conftest import quiet_trainer


class StepRecord(L.Callback):
    """At each window's end (its optimizer step done): the gradients the step used, the logged loss, and the
    distilled positions of each of the window's batches."""

    def __init__(self):
        self.grads, self.losses, self.positions = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.positions.append(int(batch["loss_mask"].sum()))
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.grads.append(
                {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}
            )
            self.losses.append(float(trainer.callback_metrics["train/loss"]))


@pytest.mark.parametrize("clip", [None, 1e-3])
def test_accumulated_batches_step_as_one_batch_of_all_their_rows(tiny_model, text_file, tmp_path, clip):
    """Windows of 2 batches of 2 rows give each step the gradient and the logged loss of one batch of those 4
    rows: unclipped (the gradients are the window's mean, not its sum: clipping to a norm would hide a factor),
    and clipped alike (the window's mean before the clipping reads them). The rows differ in length (unpacked), so
    a window's batches distil different numbers of positions: before, each batch's own mean weighed the positions
    of the shorter batch more."""
    runs = []
    for batch_size, window in ((4, 1), (2, 2)):
        dm = DistillDataModule(str(tiny_model), [str(text_file)], max_length=32, batch_size=batch_size, pack=False,
                               val_fraction=0.2, max_train_rows=8)  # fmt: skip
        module = SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, learning_rate=3e-3,
                                     evaluate_before_training=False, kv_init="published")  # fmt: skip
        record = StepRecord()
        trainer = quiet_trainer(tmp_path / str(window), max_steps=2, accumulate_grad_batches=window,
                                gradient_clip_val=clip, limit_val_batches=0, num_sanity_val_steps=0,
                                callbacks=[record])  # fmt: skip
        trainer.fit(module, dm)
        assert trainer.global_step == 2
        runs.append(record)
    one, accumulated = runs
    windows = list(zip(accumulated.positions[::2], accumulated.positions[1::2], strict=True))
    assert any(first != second for first, second in windows), windows
    assert [a + b for a, b in windows] == one.positions  # the same rows
    torch.testing.assert_close(torch.tensor(accumulated.losses), torch.tensor(one.losses), rtol=1e-3, atol=0)
    norms = [torch.linalg.vector_norm(torch.stack([g.norm() for g in step.values()])) for step in one.grads]
    if clip is None:  # well above the clipped runs' norm: there, clipping changes every step
        assert all(norm > 10 * 1e-3 for norm in norms), norms
    else:
        assert all(norm == pytest.approx(clip, rel=1e-3) for norm in norms)  # clipped
    for step_one, step_accumulated in zip(one.grads, accumulated.grads, strict=True):
        assert step_one.keys() == step_accumulated.keys() and step_one
        for name, grad in step_one.items():
            scale = float(
                grad.abs().max()
            )  # float32 sums in another order: off by ~1e-6 of the largest entry
            torch.testing.assert_close(step_accumulated[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_a_spent_budget_stops_at_the_end_of_a_window(tiny_model, text_file, tmp_path):
    """The time budget is checked after each batch, but a stop waits for the window's last batch: stopping inside a
    window would drop its gradients, or end the run before its first step (here: a budget spent by the first batch)."""
    dm = DistillDataModule(str(tiny_model), [str(text_file)], max_length=16, batch_size=1, max_train_rows=8)
    module = SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, evaluate_before_training=False,
                                 kv_init="published")  # fmt: skip
    record = StepRecord()
    trainer = quiet_trainer(tmp_path, max_steps=5, accumulate_grad_batches=3, limit_val_batches=0,
                            num_sanity_val_steps=0, callbacks=[BudgetProgress(1e-9), record])  # fmt: skip
    trainer.fit(module, dm)
    assert trainer.global_step == 1 and len(record.positions) == 3  # one window of 3 batches, one step
