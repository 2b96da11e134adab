"""The shapes of the public models users distil, and SwiftKV models of those shapes with random weights: what a
benchmark of speed or memory needs (values change neither FLOPs nor bytes), without downloading any weights.

    from swiftkv_core.shapes import random_swiftkv_model
    model, l = random_swiftkv_model("llama-3.1-8b", device="cuda", dtype=torch.bfloat16)   # l = L/2
"""

from __future__ import annotations

import torch

SHAPES = {  # the public configs' shapes (config.json of each model); "tiny" is for tests
    "llama-3.1-8b": dict(family="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "llama-3.1-70b": dict(family="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "qwen2.5-7b": dict(family="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0),
    "smollm2-135m": dict(family="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0,
                         tie_word_embeddings=True),
    "tiny": dict(family="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152, rope_theta=10000.0),
}  # fmt: skip


def shape_config(shape: str, num_hidden_layers: int | None = None):
    """The HF config of a model of ``shape`` (``num_hidden_layers``: a shallower one of its widths and vocabulary)."""
    from transformers import LlamaConfig, Qwen2Config

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: choose one of {sorted(SHAPES)}.")
    spec = dict(SHAPES[shape], **({"num_hidden_layers": num_hidden_layers} if num_hidden_layers else {}))
    config_class = LlamaConfig if spec.pop("family") == "llama" else Qwen2Config
    return config_class(**{"tie_word_embeddings": False, **spec}, max_position_embeddings=131072)


def random_swiftkv_model(
    shape: str,
    num_key_value_layers: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    group_size: int = 1,
    num_hidden_layers: int | None = None,
):
    """``(model, l)``: the base model of ``shape`` with random weights (seed 0) built on ``device`` in ``dtype``,
    converted to SwiftKV at ``l`` (default L/2) with AcrossKV groups of ``group_size``. ``num_hidden_layers``: a
    shallower model of the shape's widths and vocabulary (default the shape's depth)."""
    from transformers import AutoModelForCausalLM

    from .convert import convert

    config = shape_config(shape, num_hidden_layers)
    torch.manual_seed(0)
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(config).to(dtype)
    l = config.num_hidden_layers // 2 if num_key_value_layers is None else num_key_value_layers
    return convert(base, l, group_size).eval(), l
