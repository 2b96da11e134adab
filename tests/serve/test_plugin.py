"""The plugin's registration: version pin, re-entrancy, what it registers."""

from __future__ import annotations

import json

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


def test_swiftkv_serve_checks_the_checkpoint_from_its_config_alone(tiny_swiftkv, tiny_llama, tmp_path):
    import subprocess
    import sys

    from swiftkv_serve.cli import describe

    # tiny_swiftkv: 8 layers, l=4, g=2 -> 4 + 2 KV layers: 8 / 6 = 1.33x the tokens
    assert describe(tiny_swiftkv).endswith(
        "layers >= 4 of 8 skipped in prefill, AcrossKV group size 2, KV cache capacity x1.33"
    )
    with pytest.raises(ValueError, match=r"architectures=\['LlamaForCausalLM'\], not a SwiftKV checkpoint"):
        describe(tiny_llama)
    with pytest.raises(ValueError, match="no config.json"):
        describe(tmp_path)
    config = json.loads((tiny_swiftkv / "config.json").read_text())
    for change, refusal in (
        ({"lora_rank": 16}, "keeps low-rank adapters apart"),
        ({"num_hidden_layers": None}, "num_hidden_layers, .* must be\\s+whole numbers"),
        ({"num_hidden_layers": "8"}, "num_hidden_layers, .* must be\\s+whole numbers"),
        ({"num_attention_heads": None}, "num_attention_heads, hidden_size .* must be whole numbers"),
        ({"num_key_value_heads": "2"}, "num_key_value_heads, head_dim, max_position_embeddings where given"),
    ):
        changed = {k: v for k, v in {**config, **change}.items() if v is not None}
        (tmp_path / "config.json").write_text(json.dumps(changed))
        with pytest.raises(ValueError, match=refusal):
            describe(tmp_path)
    for written in ("[1, 2]", "{not json", '{"architectures": {"a": 1}}'):  # one line, not a traceback
        (tmp_path / "config.json").write_text(written)
        with pytest.raises(ValueError, match="config.json: not a HF config, a JSON object"):
            describe(tmp_path)
    # the check runs before vLLM (or torch) is imported: a server start pays only for reading a JSON file
    code = f"import sys; from swiftkv_serve.cli import describe; describe({str(tiny_swiftkv)!r}); print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_fast_prefill_is_on_for_generation_and_off_for_a_pooling_runner_or_when_turned_off(tiny_swiftkv):
    """vLLM's real engine configuration of a SwiftKV checkpoint: generating, prompt tokens skip layers >= l (fast
    prefill); converted to an embedding model, every position's hidden state is pooled, so those layers run for every
    token; with swiftkv_fast_prefill false, every layer runs for every prompt token. vLLM's own
    --kv-sharing-fast-prefill changes none of it."""
    from vllm.engine.arg_utils import EngineArgs

    from swiftkv_serve.engine_config import FAST_PREFILL_OPTION

    cases = (
        ("generate", "auto", None, True),
        ("pooling", "embed", None, False),
        ("generate", "auto", False, False),
    )
    for runner, convert, option, fast_prefill in cases:
        additional = {} if option is None else {FAST_PREFILL_OPTION: option}
        for asked in (False, True):  # vLLM's own --kv-sharing-fast-prefill
            engine_args = EngineArgs(model=str(tiny_swiftkv), runner=runner, convert=convert, enforce_eager=True,
                                     kv_sharing_fast_prefill=asked, additional_config=additional)  # fmt: skip
            config = engine_args.create_engine_config()
            assert config.cache_config.kv_sharing_fast_prefill is fast_prefill, (runner, option, asked)
