"""The model a distillation run trains: checked from its config.json first, then built once."""

from __future__ import annotations

import torch

from swiftkv_core.configuration import validate_layers
from swiftkv_core.convert import FAMILIES, SWIFTKV_FAMILIES, convert
from swiftkv_core.weights import train_only_swiftkv


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX): there ``bf16-mixed`` training runs
    its matmuls about 4x faster than fp32 (measured on a 2-core AVX512-BF16 CPU); elsewhere bf16 is emulated and
    slower than fp32."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without these probes: assume the common case, no native bf16
        return False


def cpu_precision(precision: str) -> str:
    """The training precision to use on this CPU for a recipe's ``precision``: a bf16 one where the CPU has no
    native bf16 becomes ``32-true`` (the same numbers to within rounding, at the faster speed there)."""
    return "32-true" if str(precision).startswith("bf16") and not cpu_has_fast_bf16() else str(precision)


def check_model_config(model: str, num_key_value_layers: int, key_value_group_size: int = 1):
    """The model's path and HF config, after checking family and ``(l, g)`` (cheap: reads config.json only)."""
    from transformers import AutoConfig

    import swiftkv_core  # noqa: F401  (registers the SwiftKV configs)
    from swiftkv_core.default_model import resolve_model_path

    path = resolve_model_path(model)
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in FAMILIES and config.model_type not in SWIFTKV_FAMILIES:
        raise ValueError(
            f"Unknown model family model_type={config.model_type!r} in {path}: swiftkv-distill "
            f"supports {sorted(FAMILIES)} (and their SwiftKV checkpoints)."
        )
    # l == L would skip nothing, so there would be nothing to train
    validate_layers(config.num_hidden_layers, num_key_value_layers, key_value_group_size, allow_no_skip=False)
    if config.model_type in SWIFTKV_FAMILIES and (
        config.num_key_value_layers != num_key_value_layers
        or config.key_value_group_size != key_value_group_size
    ):
        raise ValueError(
            f"{path} is a SwiftKV checkpoint with num_key_value_layers={config.num_key_value_layers}, "
            f"key_value_group_size={config.key_value_group_size}; the run asks for "
            f"{num_key_value_layers}, {key_value_group_size}."
        )
    return path, config


def build_swiftkv_model(
    model: str, num_key_value_layers: int, key_value_group_size: int = 1, dtype: torch.dtype = torch.float32
):
    """A SwiftKV model ready to distil: converted from a base checkpoint, or a SwiftKV checkpoint loaded as is."""
    from transformers import AutoModelForCausalLM

    path, config = check_model_config(model, num_key_value_layers, key_value_group_size)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if config.model_type in SWIFTKV_FAMILIES:
        return train_only_swiftkv(loaded).swiftkv(True)
    return convert(loaded, num_key_value_layers, key_value_group_size)
