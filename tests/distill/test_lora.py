"""Distillation with ``lora_rank``: adapters train beside the SwiftKV projections, the teacher stays the original
weights, the full export keeps the adapters apart and the serving export merges them."""

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

from swiftkv_core.weights import swiftkv_parameter_names
from swiftkv_distill import DistillDataModule, SwiftKVDistillation
from swiftkv_distill.export import export
from tests.distill.conftest import quiet_trainer


def test_lora_distillation_trains_adapters_and_exports_merged(tiny_model, text_file, tmp_path):
    module = SwiftKVDistillation(
        str(tiny_model),
        num_key_value_layers=2,
        learning_rate=1e-2,
        evaluate_before_training=False,
        lora_rank=4,
    )
    module.configure_model()
    model = module.swiftkv_model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(swiftkv_parameter_names(model))
    assert {n for n in trainable if "lora" in n} == {
        f"model.layers.{j}.{p}_lora_swiftkv.lora_{ab}"
        for j in (2, 3)
        for p in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
        for ab in "ab"
    }
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    trainer = quiet_trainer(tmp_path, max_steps=4, limit_val_batches=0)
    trainer.fit(module, DistillDataModule(str(tiny_model), [str(text_file)], max_length=32, batch_size=2))
    after = model.state_dict()
    for name, value in before.items():
        assert torch.equal(value, after[name]) != (name in trainable), (
            name
        )  # trained ones moved, frozen did not
    full, serving = export(module, tmp_path / "full"), export(module, tmp_path / "serving", serving=True)

    ids = torch.randint(3, 1000, (2, 16))
    full_model = AutoModelForCausalLM.from_pretrained(full).swiftkv(True)
    serving_model = AutoModelForCausalLM.from_pretrained(serving)
    assert full_model.config.lora_rank == 4 and serving_model.config.lora_rank == 0
    with torch.no_grad():
        student = full_model(ids).logits
        assert_close(serving_model(ids).logits, student, rtol=1e-4, atol=1e-4)
        with full_model.swiftkv_mode(False):  # the full checkpoint's teacher is the base model, adapters off
            assert_close(full_model(ids).logits, AutoModelForCausalLM.from_pretrained(tiny_model)(ids).logits)


def test_lora_rank_is_checked_before_loading_and_against_the_checkpoint(tiny_model, text_file, tmp_path):
    with pytest.raises(ValueError, match="lora_rank must be an integer >= 0"):
        SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, lora_rank=-1)
    module = SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, lora_rank=4)
    module.configure_model()
    export(module, tmp_path / "with-adapters")
    again = SwiftKVDistillation(str(tmp_path / "with-adapters"), num_key_value_layers=2, lora_rank=8)
    with pytest.raises(ValueError, match=r"has adapters of rank 4, but lora_rank=8 .* model.lora_rank: 4"):
        again.configure_model()
    same = SwiftKVDistillation(str(tmp_path / "with-adapters"), num_key_value_layers=2, lora_rank=4)
    same.configure_model()  # continues training them
    assert same.swiftkv_model.config.lora_rank == 4
