"""Short distillation runs of the tiny model with a checkpoint at every step, for the tests that interrupt, resume
and export them."""

import lightning as L

from swiftkv_distill import DistillDataModule, SwiftKVDistillation
from swiftkv_distill.checkpointing import ModelCheckpoint
from tests.distill.conftest import quiet_trainer


class Interrupt(L.Callback):
    """Stops the run after ``at`` steps, as a crash would (same config, same LR schedule as the full run)."""

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.at:
            trainer.should_stop = True


def fit(
    model,
    text_file,
    root,
    max_steps,
    ckpt_path=None,
    early_exit=False,
    interrupt_at=None,
    schedule_seconds=None,
    extra_callbacks=(),
    learning_rate=3e-3,
    num_workers=0,
    checkpoint_every_epoch=False,
    **trainer_settings,
) -> tuple[SwiftKVDistillation, L.Trainer]:
    """A seeded run of ``model`` (2 KV layers, batches of 2 rows of 16 tokens) to ``max_steps`` on the CPU, from
    ``ckpt_path`` where given, with the project's checkpoint (``root/ckpt/last.ckpt``) saved at every step, or at
    every epoch's end."""
    L.seed_everything(0)
    module = SwiftKVDistillation(
        str(model),
        num_key_value_layers=2,
        learning_rate=learning_rate,
        warmup_fraction=0.2,
        hidden_loss_weight=0.5,
        early_exit=early_exit,
        evaluate_before_training=False,
        schedule_seconds=schedule_seconds,
    )
    data = DistillDataModule(
        str(model), [str(text_file)], max_length=16, batch_size=2, val_fraction=0.1, num_workers=num_workers
    )
    every = (
        dict(every_n_epochs=1, save_on_train_epoch_end=True)
        if checkpoint_every_epoch
        else {"every_n_train_steps": 1}
    )
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, save_top_k=0, **every)
    callbacks = [*extra_callbacks, checkpoint] + ([Interrupt(interrupt_at)] if interrupt_at else [])
    trainer = quiet_trainer(
        root,
        enable_checkpointing=True,
        max_steps=max_steps,
        callbacks=callbacks,
        limit_val_batches=0,
        enable_model_summary=False,
        **trainer_settings,
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return module, trainer
