"""What a SwiftKV weight is, by name: the one definition convert, kv_init, distill and serve all use.

Names are those of the HF state dict (the published SwiftKV checkpoint format): ``model.norm_swiftkv.weight`` and, on a
layer ``j >= l``, ``model.layers.{j}.self_attn.{q,k,v}_proj_swiftkv.{weight,bias}`` (k/v on AcrossKV group leaders
only). The teacher's own ``q/k/v_proj`` of layers ``>= l`` are kept in full checkpoints and never needed to serve.
Names may carry a prefix (``step.model.``, FSDP wrappers): the patterns match the end of the name.
"""

from __future__ import annotations

import re

from torch import nn

SWIFTKV_SUFFIX = "_swiftkv"
# the teacher projections: layers.{j}.self_attn.{q,k,v}_proj.{weight,bias}
TEACHER_QKV_PATTERN = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$")
# the shared K/V projections of an AcrossKV group leader: layers.{j}.self_attn.{k,v}_proj_swiftkv.{weight,bias}
SWIFTKV_KV_PATTERN = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.([kv])_proj_swiftkv\.(weight|bias)$")
_LAYER_PATTERN = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def is_swiftkv_parameter(name: str) -> bool:
    """Whether a parameter is one SwiftKV adds (``norm_swiftkv``, ``*_proj_swiftkv``): the ones distillation trains."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2].endswith(SWIFTKV_SUFFIX)


def swiftkv_parameter_names(model: nn.Module) -> list[str]:
    """Names of the SwiftKV parameters of ``model``."""
    return [name for name, _ in model.named_parameters() if is_swiftkv_parameter(name)]


def train_only_swiftkv(model: nn.Module) -> nn.Module:
    """Freeze every parameter but the SwiftKV ones (the base model is the teacher; only these are distilled)."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_swiftkv_parameter(name))
    return model


def layer_index(name: str) -> int | None:
    """The decoder layer a weight belongs to (``None`` for embeddings, norms, LM head)."""
    match = _LAYER_PATTERN.search(name)
    return int(match.group(1)) if match else None


def is_teacher_projection(name: str, num_key_value_layers: int) -> bool:
    """Whether ``name`` is an original q/k/v of a layer ``>= l``: the teacher's, never needed to serve SwiftKV."""
    match = TEACHER_QKV_PATTERN.search(name)
    return bool(match) and int(match.group(1)) >= num_key_value_layers


def match_swiftkv_kv(name: str) -> tuple[int, str, str] | None:
    """``(layer, "k" | "v", "weight" | "bias")`` for a group leader's K/V projection, else ``None``."""
    match = SWIFTKV_KV_PATTERN.search(name)
    return (int(match.group(1)), match.group(2), match.group(3)) if match else None


def cast_frozen(model: nn.Module, dtype, trained_dtype=None) -> nn.Module:
    """Keep the frozen parameters (the teacher: all but the trained ones) in ``dtype``, and the trained ones in
    ``trained_dtype`` (their fp32 master weights; default: as they are). Under bf16 autocast every matmul casts its
    weight to bf16 anyway: frozen weights stored in bf16 halve their memory and skip that cast at every step."""
    for param in model.parameters():
        cast = dtype if not param.requires_grad else trained_dtype or param.dtype
        if param.dtype != cast:
            param.data = param.data.to(cast)
    return model
