"""swiftkv_core: the one SwiftKV model definition (HF transformers), conversion, accounting and analysis.

Importing this package registers the SwiftKV configs and models with transformers' Auto classes, so
``AutoModelForCausalLM.from_pretrained(dir)`` loads our checkpoints and checkpoints in the published format.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration import LlamaSwiftKVConfig, Qwen2SwiftKVConfig
from .convert import convert, export_for_serving, save_checkpoint
from .modeling import (
    LlamaSwiftKVForCausalLM,
    LlamaSwiftKVModel,
    Qwen2SwiftKVForCausalLM,
    Qwen2SwiftKVModel,
)


def _register() -> None:
    for config_cls, model_cls, lm_cls in (
        (LlamaSwiftKVConfig, LlamaSwiftKVModel, LlamaSwiftKVForCausalLM),
        (Qwen2SwiftKVConfig, Qwen2SwiftKVModel, Qwen2SwiftKVForCausalLM),
    ):
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModel.register(config_cls, model_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, lm_cls, exist_ok=True)


_register()

__all__ = [
    "convert",
    "export_for_serving",
    "save_checkpoint",
    "LlamaSwiftKVConfig",
    "LlamaSwiftKVForCausalLM",
    "LlamaSwiftKVModel",
    "Qwen2SwiftKVConfig",
    "Qwen2SwiftKVForCausalLM",
    "Qwen2SwiftKVModel",
]
