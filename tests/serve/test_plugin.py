"""The plugin's registration: version pin, re-entrancy, what it registers."""

from __future__ import annotations

import pytest

import swiftkv_serve

pytestmark = pytest.mark.vllm


def test_refuses_other_vllm_versions():
    swiftkv_serve.check_vllm_version("0.32.0")
    swiftkv_serve.check_vllm_version("0.32.0+cpu")
    with pytest.raises(swiftkv_serve.UnsupportedVLLMVersion, match="supports vLLM 0.32.0 only"):
        swiftkv_serve.check_vllm_version("0.31.1")


def test_register_is_reentrant_and_registers_models_configs_and_hooks():
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    swiftkv_serve.register()
    swiftkv_serve.register()
    supported = ModelRegistry.get_supported_archs()
    for architecture in swiftkv_serve.ARCHITECTURES:
        assert architecture in supported
        assert MODELS_CONFIG_MAP[architecture].__name__ == "SwiftKVEngineConfig"
    assert AutoConfig.for_model("llama_swiftkv").model_type == "llama_swiftkv"
    assert AutoConfig.for_model("qwen2_swiftkv").model_type == "qwen2_swiftkv"


def test_entry_point_declared():
    from importlib.metadata import entry_points

    targets = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "swiftkv_serve:register" in targets
