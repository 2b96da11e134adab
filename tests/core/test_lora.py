"""Low-rank adapters on o_proj and the MLP of layers >= l: the student's only, merged into the serving export."""

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

from swiftkv_core.convert import convert, export_for_serving, lora_merged_state_dict, save_checkpoint
from swiftkv_core.weights import swiftkv_parameter_names
from tests.conftest import tiny_base

ADAPTED = ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _with_trained_adapters(family: str, l: int = 2, rank: int = 4):
    model = convert(tiny_base(family), l).add_lora(rank)
    with torch.no_grad():  # as if trained: B != 0
        for name, param in model.named_parameters():
            if name.endswith("lora_b"):
                param.normal_(0, 0.2)
    return model


@torch.no_grad()
def test_adapters_are_student_only_trainable_and_start_at_zero(family):
    model = convert(tiny_base(family), 2)
    ids = torch.randint(1, 128, (2, 12))
    before = model(ids).logits
    model.add_lora(4)
    names = set(swiftkv_parameter_names(model))
    expected = {
        f"model.layers.{j}.{p}_lora_swiftkv.lora_{ab}" for j in (2, 3) for p in ADAPTED for ab in "ab"
    }
    assert expected <= names and not any(f"layers.{j}." in n and "lora" in n for n in names for j in (0, 1))
    assert_close(model(ids).logits, before)  # B = 0: nothing changes until it trains
    model = _with_trained_adapters(family)
    student = model(ids).logits
    with model.swiftkv_mode(False):  # the teacher runs the original weights, without adapters
        assert_close(model(ids).logits, tiny_base(family)(ids).logits)
    assert not torch.allclose(student, before, atol=1e-3)
    with pytest.raises(ValueError, match="already has adapters of rank 4"):
        model.add_lora(8)


@torch.no_grad()
def test_full_checkpoint_keeps_adapters_and_serving_export_merges_them(family, tmp_path):
    model = _with_trained_adapters(family)
    ids = torch.randint(1, 128, (2, 12))
    student = model(ids).logits
    save_checkpoint(model, tmp_path / "full")
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "full").swiftkv(True)
    assert full.config.lora_rank == 4
    assert_close(full(ids).logits, student)
    with full.swiftkv_mode(False):
        assert_close(full(ids).logits, tiny_base(family)(ids).logits)

    merged = lora_merged_state_dict(model)
    assert not [k for k in merged if "lora" in k]
    delta = model.model.layers[3].mlp.down_proj_lora_swiftkv.delta()
    assert_close(
        merged["model.layers.3.mlp.down_proj.weight"], model.model.layers[3].mlp.down_proj.weight + delta
    )
    assert_close(merged["model.layers.1.mlp.down_proj.weight"], model.model.layers[1].mlp.down_proj.weight)

    export_for_serving(model, tmp_path / "serving")
    serving = AutoModelForCausalLM.from_pretrained(tmp_path / "serving")
    assert serving.config.lora_rank == 0 and serving.config.serving_only
    assert not [n for n, _ in serving.named_parameters() if "lora" in n]
    assert_close(serving(ids).logits, student, rtol=1e-4, atol=1e-4)
    generated = serving.generate(ids[:1], max_new_tokens=6, do_sample=False)  # decoding (cache) too
    assert torch.equal(generated, model.generate(ids[:1], max_new_tokens=6, do_sample=False))
    assert (
        model.config.lora_rank == 4 and not model.config.serving_only
    )  # the export left the model as it was


def test_lora_rank_is_checked():
    model = convert(tiny_base("llama"), 2)
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="lora rank must be an integer >= 1"):
            model.add_lora(bad)
    config = model.config.to_dict() | {"lora_rank": -2}
    with pytest.raises(Exception, match=r"lora_rank=-2 must be an integer >= 0"):
        type(model.config)(**config)


@torch.no_grad()
def test_prefix_adapters_change_layer_l_input_in_the_student_only_and_merge(tmp_path):
    model = convert(tiny_base("llama"), 2).add_lora(4, prefix=True)
    assert model.config.lora_prefix and hasattr(model.model.layers[0].mlp, "up_proj_lora_swiftkv")
    for name, param in model.named_parameters():
        if name.endswith("lora_b"):
            param.normal_(0, 0.2)
    ids = torch.randint(1, 128, (2, 12))
    with model.swiftkv_mode(False):
        assert_close(model(ids).logits, tiny_base("llama")(ids).logits)  # the teacher: no adapter anywhere
    student = model(ids).logits
    below_l = (".layers.0.", ".layers.1.")
    prefix = [p for n, p in model.named_parameters() if n.endswith("lora_b") and n.startswith(below_l, 5)]
    kept = [p.clone() for p in prefix]
    for p in prefix:  # the layers < l adapters off: the student's layer-l input (and so its logits) changes
        p.zero_()
    assert not torch.allclose(model(ids).logits, student, atol=1e-3)
    for p, value in zip(prefix, kept, strict=True):
        p.copy_(value)
    export_for_serving(model, tmp_path / "serving")
    serving = AutoModelForCausalLM.from_pretrained(tmp_path / "serving")
    assert not serving.config.lora_prefix and serving.config.lora_rank == 0
    assert_close(serving(ids).logits, student, rtol=1e-4, atol=1e-4)
    up = model.model.layers[0].mlp  # merged into layer 0's own weights
    assert_close(
        serving.model.layers[0].mlp.up_proj.weight, up.up_proj.weight + up.up_proj_lora_swiftkv.delta()
    )
    assert not torch.allclose(serving.model.layers[0].mlp.up_proj.weight, up.up_proj.weight, atol=1e-3)
    config = model.config.to_dict() | {"lora_rank": 0, "lora_prefix": True}
    with pytest.raises(Exception, match="lora_prefix=True needs lora_rank > 0"):
        type(model.config)(**config)
