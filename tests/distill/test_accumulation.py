"""Gradient accumulation: an optimizer step's gradient is the mean over every distilled position of its window's
batches, as one batch of all their rows gives (``step.AccumulationWindow``)."""

import lightning as L
import torch

from swiftkv_distill import DistillDataModule, SwiftKVDistillation
from tests.distill.conftest import quiet_trainer


class StepGradients(L.Callback):
    """The trained parameters' gradients each optimizer step used (read before the next window clears them)."""

    def __init__(self):
        self.steps = []

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        grads = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}
        if grads:
            self.steps.append(grads)

    def on_train_end(self, trainer, pl_module):  # the last step's: no window after it clears them
        self.on_before_zero_grad(trainer, pl_module, None)


def test_accumulated_batches_step_as_one_batch_of_all_their_rows(tiny_model, text_file, tmp_path):
    """Windows of 2 batches of 2 rows give each step the gradient of one batch of those 4 rows. The rows differ in
    length (unpacked), so the batches distil different numbers of positions: before, each batch's own mean weighed
    the positions of the shorter batch more."""
    runs = []
    for batch_size, window in ((4, 1), (2, 2)):
        dm = DistillDataModule(str(tiny_model), [str(text_file)], max_length=32, batch_size=batch_size, pack=False,
                               val_fraction=0.2, max_train_rows=8)  # fmt: skip
        module = SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, learning_rate=3e-3,
                                     evaluate_before_training=False, kv_init="published")  # fmt: skip
        grads = StepGradients()
        trainer = quiet_trainer(tmp_path / str(window), max_steps=2, accumulate_grad_batches=window,
                                limit_val_batches=0, num_sanity_val_steps=0, callbacks=[grads])  # fmt: skip
        trainer.fit(module, dm)
        assert trainer.global_step == 2
        runs.append(grads.steps)
    lengths = {len(row["input_ids"]) for row in dm.train_rows}
    assert len(lengths) > 1  # the batches distil different numbers of positions
    one, accumulated = runs
    assert len(one) == len(accumulated) == 2
    for step_one, step_accumulated in zip(one, accumulated, strict=True):
        assert step_one.keys() == step_accumulated.keys() and step_one
        for name, grad in step_one.items():
            torch.testing.assert_close(step_accumulated[name], grad, rtol=1e-4, atol=1e-7, msg=name)
