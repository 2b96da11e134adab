"""Random-weight SwiftKV models at the public shapes (what benchmarks/gpu.py measures on)."""

from __future__ import annotations

import pytest
import torch

from swiftkv_core.shapes import SHAPES, random_swiftkv_model


def test_a_random_model_has_the_shape_and_its_layers():
    model, l = random_swiftkv_model("tiny", num_hidden_layers=2, group_size=1)
    config, spec = model.config, SHAPES["tiny"]
    assert (config.hidden_size, config.vocab_size, config.num_key_value_heads) == (
        spec["hidden_size"], spec["vocab_size"], spec["num_key_value_heads"],
    )  # fmt: skip
    assert config.num_hidden_layers == 2 and l == 1 == config.num_key_value_layers and config.swiftkv
    again, _ = random_swiftkv_model("tiny", num_hidden_layers=2)
    assert all((a == b).all() for a, b in zip(model.parameters(), again.parameters(), strict=True))  # seeded


def test_an_unknown_shape_names_the_known_ones():
    with pytest.raises(ValueError, match="llama-3.1-8b"):
        random_swiftkv_model("llama-4")


def test_a_random_bf16_model_keeps_rope_frequencies_in_fp32():
    model, _ = random_swiftkv_model("tiny", num_hidden_layers=2, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert {buffer.dtype for buffer in model.model.rotary_emb.buffers()} == {torch.float32}


@pytest.mark.parametrize(
    "shape, parameters",
    [("smollm2-135m", 134_515_008), ("llama-3.1-8b", 8_030_261_248), ("qwen2.5-7b", 7_615_616_512),
     ("llama-3.1-70b", 70_553_706_496)],
)  # fmt: skip
def test_a_shape_has_its_public_models_parameter_count(shape, parameters):
    """The published checkpoints' parameter counts (their safetensors' totals): a figure of weight memory or size
    taken from a shape is the real model's (SmolLM2 ties its LM head to its embeddings; the others do not)."""
    from transformers import AutoModelForCausalLM

    from swiftkv_core.shapes import shape_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(shape))
    assert sum(p.numel() for p in model.parameters()) == parameters
