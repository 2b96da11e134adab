"""Lightning checkpoints: resume == uninterrupted; HF export round trip (full and serving) with the early head."""

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM

from swiftkv_core.early_exit import EarlyExitHead, generate_with_early_exit
from swiftkv_distill import DistillDataModule, SwiftKVDistillation, export


class Interrupt(L.Callback):
    """Stops the run after ``at`` steps, as a crash would (same config, same LR schedule as the full run)."""

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.at:
            trainer.should_stop = True


def _run(tiny_model, text_file, root, max_steps, ckpt_path=None, early_exit=False, interrupt_at=None):
    L.seed_everything(0)
    module = SwiftKVDistillation(
        str(tiny_model),
        num_key_value_layers=2,
        learning_rate=3e-3,
        warmup_fraction=0.2,
        hidden_loss_weight=0.5,
        early_exit=early_exit,
        evaluate_before_training=False,
    )
    dm = DistillDataModule(str(tiny_model), [str(text_file)], max_length=16, batch_size=2, val_fraction=0.1)
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    callbacks = [checkpoint] + ([Interrupt(interrupt_at)] if interrupt_at else [])
    trainer = L.Trainer(
        max_steps=max_steps,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        default_root_dir=root,
        enable_model_summary=False,
    )
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return module, trainer


def _trained(module):
    return {k: v.clone() for k, v in module.step.state_dict().items() if "swiftkv" in k or "early_exit" in k}


def test_resume_mid_epoch_equals_uninterrupted(tiny_model, text_file, tmp_path):
    # 14 rows of 16 tokens, batch 2 -> 7 steps per epoch: interrupt mid-epoch (step 4), finish in epoch 2 (step 9)
    full, _ = _run(tiny_model, text_file, tmp_path / "full", max_steps=9)
    _, interrupted = _run(tiny_model, text_file, tmp_path / "part", max_steps=9, interrupt_at=4)
    assert interrupted.global_step == 4
    ckpt = tmp_path / "part" / "ckpt" / "last.ckpt"
    state = torch.load(ckpt, weights_only=False)
    assert all("swiftkv" in k for k in state["state_dict"])  # only trained weights, not the frozen base
    resumed, trainer = _run(tiny_model, text_file, tmp_path / "part", max_steps=9, ckpt_path=ckpt)
    assert trainer.global_step == 9
    expected, got = _trained(full), _trained(resumed)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


def test_export_round_trip(tiny_model, text_file, tmp_path):
    module, _ = _run(tiny_model, text_file, tmp_path / "run", max_steps=3, early_exit=True)
    model = module.swiftkv_model.eval()
    ids = torch.tensor([[5, 17, 300, 42, 9, 8, 99, 1000]])
    with torch.no_grad():
        expected_student = model.swiftkv(True)(ids, use_cache=False).logits
        expected_teacher = model.swiftkv(False)(ids, use_cache=False).logits
    model.swiftkv(True)
    full = export(module, tmp_path / "hf")
    serving = export(module, tmp_path / "hf-serving", serving=True)
    loaded = AutoModelForCausalLM.from_pretrained(full).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, use_cache=False).logits, expected_student)
        torch.testing.assert_close(loaded.swiftkv(False)(ids, use_cache=False).logits, expected_teacher)
    small = AutoModelForCausalLM.from_pretrained(serving).eval()
    with torch.no_grad():
        torch.testing.assert_close(small(ids, use_cache=False).logits, expected_student)
    assert (serving / "model.safetensors").stat().st_size < (full / "model.safetensors").stat().st_size
    # the early-exit head travels with the checkpoint and drives early-exit decoding
    head = EarlyExitHead.load(full)
    torch.testing.assert_close(head.lm_head.weight, module.step.early_exit_head.lm_head.weight)
    always, exited = generate_with_early_exit(
        loaded.swiftkv(True), head, ids, max_new_tokens=5, threshold=0.0
    )
    assert exited == 4 and always.shape == (1, 13)
    never, exited = generate_with_early_exit(loaded, head, ids, max_new_tokens=5, threshold=1.01)
    greedy = loaded.generate(ids, max_new_tokens=5, do_sample=False)
    assert exited == 0 and torch.equal(never, greedy)
    # a second export over the first replaces it atomically (no staging folders left behind)
    export(module, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
