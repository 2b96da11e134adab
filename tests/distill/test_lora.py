"""Distillation with ``lora_rank``: adapters train beside the SwiftKV projections, the teacher stays the original
weights, the full export keeps the adapters apart and the serving export merges them."""

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

from swiftkv_core.weights import swiftkv_parameter_names
from swiftkv_distill import DistillDataModule, SwiftKVDistillation
from swiftkv_distill.batches import collate, pack
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
    with pytest.raises(
        ValueError,
        match=r"has adapters of rank 4 \(lora_prefix=False\), but lora_rank=8 .* model.lora_rank: 4",
    ):
        again.configure_model()
    same = SwiftKVDistillation(str(tmp_path / "with-adapters"), num_key_value_layers=2, lora_rank=4)
    same.configure_model()  # continues training them
    assert same.swiftkv_model.config.lora_rank == 4


def test_prefix_adapters_step_equals_two_full_passes_and_trains_them(tiny_model):
    """lora_prefix: the student runs its own layers < l (with adapters), the teacher the original ones: the step's
    loss is that of a teacher forward (SwiftKV off) and a student forward (on), and the prefix adapters get
    gradients (the frozen weights do not)."""
    module = SwiftKVDistillation(
        str(tiny_model),
        num_key_value_layers=2,
        temperature=1.0,
        lora_rank=4,
        lora_prefix=True,
        logits_chunk_size=5,
    )
    module.configure_model()
    model = module.swiftkv_model
    with torch.no_grad():  # as if trained: the adapters' updates are not zero
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, 0.05)
    assert hasattr(model.model.layers[0].mlp, "gate_proj_lora_swiftkv")
    assert not hasattr(model.model.layers[0].self_attn, "o_proj_lora_swiftkv")  # below l: the MLP only
    batch = collate(pack([[5, 17, 300, 42, 9, 8], [77, 1000, 3, 4, 5], [12, 13, 14, 15]], max_length=8), 0, 8)
    out = module.step(batch, 1.0 / batch["loss_mask"].sum())
    out["loss"].backward()
    assert model.model.layers[0].mlp.gate_proj_lora_swiftkv.lora_b.grad.abs().sum() > 0
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)

    mask = batch["loss_mask"]
    kwargs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    with torch.no_grad():
        teacher = model.swiftkv(False)(**kwargs).logits[mask]
        student = model.swiftkv(True)(**kwargs).logits[mask]
        reference = AutoModelForCausalLM.from_pretrained(tiny_model)(**kwargs).logits[mask]
    assert_close(teacher, reference, rtol=1e-4, atol=1e-5)  # the teacher is the base model, adapters off
    log_ps, log_pt = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    expected = (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean()
    assert_close(out["loss"].detach(), expected, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="lora_prefix=True needs lora_rank > 0"):
        SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, lora_prefix=True)
