"""Frozen weights in bf16 beside fp32 trained ones (``model.frozen_dtype``): held so, read so from a bf16
checkpoint, and refused without a mixed precision. Under FSDP2: test_distributed.py."""

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from swiftkv_core.checkpoints import stored_dtype
from swiftkv_distill import DistillDataModule, SwiftKVDistillation
from swiftkv_distill.build import distillation_step
from swiftkv_distill.export import export
from tests.distill.conftest import quiet_trainer


def test_frozen_weights_in_bf16_beside_fp32_master_weights(tiny_model, text_file, tmp_path, monkeypatch):
    """frozen_dtype bfloat16: the teacher's weights are held (and stay) in bf16, the trained ones in fp32 (the
    early-exit head too, though it starts from the frozen LM head); the K/V init, validation and the steps run, and
    its checkpoint loads without a Trainer and exports. Without a mixed precision: a clear error before any step."""
    monkeypatch.setattr("swiftkv_distill.build.cpu_has_fast_bf16", lambda: False)
    dm = DistillDataModule(str(tiny_model), [str(text_file)], max_length=32, batch_size=2, val_fraction=0.2)
    module = SwiftKVDistillation(
        str(tiny_model), num_key_value_layers=2, frozen_dtype="bfloat16", early_exit=True
    )
    trainer = quiet_trainer(tmp_path, max_steps=2, precision="bf16-mixed", num_sanity_val_steps=0)
    with pytest.warns(UserWarning, match="bf16 is emulated here"):
        trainer.fit(module, dm)
    dtypes = {p.dtype for p in module.trainable_parameters()}
    frozen = {p.dtype for p in module.swiftkv_model.parameters() if not p.requires_grad}
    assert dtypes == {torch.float32} and frozen == {torch.bfloat16}
    assert module.step.early_exit_head.lm_head.weight.dtype == torch.float32
    # the least-squares init ran on the bf16 weights
    assert module.init_metrics["kl"] < module.before_metrics["kl"]
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    loaded = SwiftKVDistillation.load_from_checkpoint(
        tmp_path / "last.ckpt"
    )  # no Trainer: no precision to check
    exported = load_file(export(loaded, tmp_path / "hf") / "model.safetensors")
    for name, value in module.swiftkv_model.named_parameters():
        if value.requires_grad:
            torch.testing.assert_close(exported[name], value.detach(), rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="frozen_dtype=bfloat16 needs a mixed precision .*bf16-mixed"):
        quiet_trainer(tmp_path, max_steps=1).fit(
            SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, frozen_dtype="bfloat16"), dm
        )


def test_a_bf16_checkpoint_is_read_in_bf16_and_only_the_trained_weights_widened(
    tiny_model, tmp_path, monkeypatch
):
    """A checkpoint stored in the frozen dtype is read in it (half the host memory of an fp32 read: 141 GB at 70B, on
    the one process that reads under FSDP2), and only the trained weights, the early-exit head's included, are
    widened to fp32: the same weights, buffers and dtypes as reading it all in fp32 and casting the frozen ones."""
    bf16 = tmp_path / "bf16"
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    loaded.save_pretrained(bf16, max_shard_size="4MB")  # in shards, with an index
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(bf16)
    assert len(list(bf16.glob("model-*.safetensors"))) > 1
    save_file(
        {"lm_head.weight": torch.zeros(2, 2)}, bf16 / "early_exit_head.safetensors"
    )  # not a weight file
    assert stored_dtype(bf16) == torch.bfloat16 and stored_dtype(tiny_model) == torch.float32
    mixed = tmp_path / "mixed"  # an export's bf16 teacher and fp32 trained weights: read in fp32
    loaded.model.layers[0].self_attn.q_proj.float()
    loaded.save_pretrained(mixed)
    assert stored_dtype(mixed) is None and stored_dtype(tmp_path / "nothing here") is None

    reads = []
    load = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, path, **kwargs):
        reads.append(kwargs["dtype"])
        return load(cls, path, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    module = SwiftKVDistillation(str(bf16), num_key_value_layers=2, frozen_dtype="bfloat16", early_exit=True)
    mixed = SimpleNamespace(precision="bf16-mixed")
    step = distillation_step(module.hparams, torch.device("cpu"), mixed, module.loss_settings)
    monkeypatch.setattr("swiftkv_distill.build.stored_dtype", lambda model: None)  # as before: read in fp32
    reference = distillation_step(module.hparams, torch.device("cpu"), mixed, module.loss_settings)
    assert reads == [torch.bfloat16, torch.float32]

    trained = {name for name, p in step.named_parameters() if p.requires_grad}
    assert trained and any("early_exit_head" in name for name in trained)
    for name, p in step.named_parameters():
        assert p.dtype == (torch.float32 if name in trained else torch.bfloat16), name
    expected = dict(reference.named_buffers()) | reference.state_dict()
    got = dict(step.named_buffers()) | step.state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype, name
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
