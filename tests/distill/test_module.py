"""The LightningModule: shared prefix == separate passes, frozen/trainable split, clear errors before compute."""

import json

import lightning as L
import pytest
import torch

from swiftkv_core.convert import swiftkv_parameter_names
from swiftkv_distill import DistillDataModule, SwiftKVDistillation
from swiftkv_distill.data import collate, pack
from swiftkv_distill.loss import distillation_kl


def test_shared_prefix_step_equals_two_full_passes(tiny_model):
    """Prefix once + two suffixes gives exactly the loss of a separate teacher forward and student forward."""
    module = SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, hidden_loss_weight=0.0)
    module.configure_model()
    model = module.swiftkv_model
    with torch.no_grad():  # make the student differ from the teacher
        for name, p in model.named_parameters():
            if "swiftkv" in name:
                p.add_(0.05 * torch.randn_like(p))
    batch = collate(pack([[5, 17, 300, 42, 9, 8], [77, 1000, 3, 4, 5], [12, 13, 14, 15]], max_length=8), 0, 8)
    out = module.step(batch, 1.0 / batch["loss_mask"].sum(), 2.0, 0.0, 1.0, chunk_size=5)

    mask = batch["loss_mask"]
    kwargs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    with torch.no_grad():
        teacher = model.swiftkv(False)(**kwargs).logits[mask]
    student = model.swiftkv(True)(**kwargs).logits[mask]
    log_ps, log_pt = torch.log_softmax(student / 2, -1), torch.log_softmax(teacher / 2, -1)
    expected = (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean() * 4
    torch.testing.assert_close(out["loss"], expected, rtol=1e-4, atol=1e-6)


def test_early_exit_loss_and_hidden_loss_are_added(tiny_model):
    module = SwiftKVDistillation(
        str(tiny_model), num_key_value_layers=2, hidden_loss_weight=0.5, early_exit=True
    )
    module.configure_model()
    batch = collate(pack([[5, 17, 300, 42, 9, 8, 7, 6]], max_length=8), 0, 8)
    out = module.step(batch, 1 / 8, 2.0, 0.5, 1.0, chunk_size=3)
    assert out["loss"].requires_grad
    out["loss"].backward()
    head = module.step.early_exit_head
    assert head.lm_head.weight.grad is not None and head.norm.weight.grad is not None
    assert module.swiftkv_model.lm_head.weight.grad is None


def test_only_swiftkv_parameters_train_and_teacher_is_bit_identical(tiny_model, text_file, tmp_path):
    module = SwiftKVDistillation(
        str(tiny_model), num_key_value_layers=2, learning_rate=1e-2, evaluate_before_training=False
    )
    module.configure_model()
    model = module.swiftkv_model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(swiftkv_parameter_names(model)) and trainable
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    dm = DistillDataModule(str(tiny_model), [str(text_file)], max_length=32, batch_size=2)
    trainer = L.Trainer(
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, dm)
    after = model.state_dict()
    for name, value in before.items():
        if name in trainable:
            assert not torch.equal(value, after[name]), f"{name} did not train"
        else:
            assert torch.equal(value, after[name]), f"frozen {name} changed"


def test_unknown_family_and_bad_l_fail_before_loading(tmp_path, tiny_model):
    config = json.loads((tiny_model / "config.json").read_text())
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2})
    )
    with pytest.raises(ValueError, match="Unknown model family model_type='gpt2'"):
        SwiftKVDistillation(str(gpt2), num_key_value_layers=1)
    for l in (0, config["num_hidden_layers"], 99):
        with pytest.raises(ValueError, match="out of range"):
            SwiftKVDistillation(str(tiny_model), num_key_value_layers=l)
    with pytest.raises(ValueError, match="key_value_group_size=3"):
        SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, key_value_group_size=3)
    with pytest.raises(FileNotFoundError):
        SwiftKVDistillation(str(tmp_path / "nowhere"), num_key_value_layers=2)


def test_chunked_loss_memory_is_bounded():
    """The backward keeps only (N, H) gradients, never (N, V) logits: check the saved tensors."""
    student = torch.randn(64, 16, requires_grad=True)
    loss, _, _ = distillation_kl(student, torch.randn(64, 16), torch.randn(5000, 16), torch.ones(64), 2.0, 8)
    saved = [t for t in loss.grad_fn.saved_tensors if t is not None]
    assert all(t.numel() <= 64 * 16 for t in saved)


def test_bf16_mixed_trains(tiny_model, text_file, tmp_path):
    module = SwiftKVDistillation(
        str(tiny_model), num_key_value_layers=2, learning_rate=1e-2, evaluate_before_training=False
    )
    dm = DistillDataModule(str(tiny_model), [str(text_file)], max_length=32, batch_size=2)
    trainer = L.Trainer(
        max_steps=2,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        use_distributed_sampler=False,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, dm)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert all(p.dtype == torch.float32 for p in module.trainable_parameters())  # fp32 master weights
