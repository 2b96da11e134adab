"""What ``swiftkv_serve.vllm_internals`` relies on in vLLM is still there (cheap: no engine is started).

A failure here names the vLLM internal that changed; ``vllm_internals.py`` is the one module to update. The
engine tests (``test_offline``) check that the pieces also work together.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

# What only vllm_internals.py may name: private helpers, custom ops, runner metadata, config-map writes.
INTERNAL_NAMES = (
    "MODELS_CONFIG_MAP",
    "VerifyAndUpdateConfig",
    "_encode_layer_name",
    "torch.ops.vllm",
    "unified_kv_cache_update",
    "unified_attention_with_output",
    "create_fast_prefill_custom_backend",
    "KVSharingFastPrefillMetadata",
    "get_forward_context",
    "set_model_tag",
    "get_attn_backend",
    "shard_id =",
    "InputProcessor",
    "_validate_params",
)


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_internals_are_named_in_one_module_only():
    import swiftkv_serve

    package = Path(swiftkv_serve.__file__).parent
    offenders = [
        f"{path.name}: {name}"
        for path in sorted(package.glob("*.py"))
        if path.name != "vllm_internals.py"
        for name in INTERNAL_NAMES
        if name in path.read_text()
    ]
    assert not offenders, offenders


def test_models_config_map_hook():
    from vllm.config import VllmConfig
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    from swiftkv_serve import vllm_internals
    from swiftkv_serve.engine_config import update_engine_config

    assert isinstance(MODELS_CONFIG_MAP, dict)
    assert _parameters(VerifyAndUpdateConfig.verify_and_update_config) == ["vllm_config"]
    # vLLM still looks the architecture up in the map and calls the hook with the VllmConfig.
    source = inspect.getsource(VllmConfig.try_verify_and_update_config)
    assert "MODELS_CONFIG_MAP.get(architecture" in source
    assert "cls.verify_and_update_config(self)" in source

    vllm_internals.register_config_hook(["SwiftKVInternalsTestArch"], update_engine_config)
    try:
        hook = MODELS_CONFIG_MAP["SwiftKVInternalsTestArch"]
        assert issubclass(hook, VerifyAndUpdateConfig)
        assert hook.__name__ == vllm_internals.CONFIG_HOOK_NAME
        assert hook.verify_and_update_config is update_engine_config
        vllm_internals.register_config_hook(["SwiftKVInternalsTestArch"], update_engine_config)
        assert MODELS_CONFIG_MAP["SwiftKVInternalsTestArch"] is hook  # idempotent
    finally:
        del MODELS_CONFIG_MAP["SwiftKVInternalsTestArch"]


def test_engine_config_fields_the_hook_sets():
    from vllm.config import CacheConfig

    assert CacheConfig.__dataclass_fields__["kv_sharing_fast_prefill"].default is False


def test_request_check_runs_at_admission_in_both_engines():
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.llm_engine import LLMEngine

    import swiftkv_serve
    from swiftkv_core.configuration import LlamaSwiftKVConfig
    from swiftkv_serve import vllm_internals
    from swiftkv_serve.engine_config import PROMPT_LOGPROBS_MESSAGE, check_request

    # The offline engine and the server's both admit a request through process_inputs -> _validate_params.
    assert "self._validate_params(params" in inspect.getsource(InputProcessor.process_inputs)
    assert "self.input_processor.process_inputs(" in inspect.getsource(LLMEngine.add_request)
    assert "self.input_processor.process_inputs" in inspect.getsource(AsyncLLM.add_request)
    assert "self.vllm_config = vllm_config" in inspect.getsource(InputProcessor.__init__)

    swiftkv_serve.register()
    swiftkv_serve.register()  # re-entrant: one wrapper, around vLLM's own method
    installed = InputProcessor._validate_params
    assert getattr(installed, vllm_internals.REQUEST_CHECK_ATTRIBUTE) is check_request
    assert not hasattr(installed.__wrapped__, vllm_internals.REQUEST_CHECK_ATTRIBUTE)
    assert _parameters(installed.__wrapped__) == ["self", "params", "supported_tasks"]

    config = LlamaSwiftKVConfig(num_hidden_layers=4, num_key_value_layers=2)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=config),
        cache_config=SimpleNamespace(kv_sharing_fast_prefill=True),
    )
    processor = SimpleNamespace(vllm_config=vllm_config)
    with pytest.raises(VLLMValidationError, match=re.escape(PROMPT_LOGPROBS_MESSAGE)):
        installed(processor, SamplingParams(prompt_logprobs=0), ("generate",))


def test_kv_cache_and_attention_ops():
    from vllm.model_executor.layers.attention.attention import (
        unified_attention_with_output,
        unified_kv_cache_update,
    )
    from vllm.utils.torch_utils import _encode_layer_name

    assert _parameters(unified_kv_cache_update) == ["key", "value", "layer_name"]
    assert _parameters(unified_attention_with_output)[:5] == ["query", "key", "value", "output", "layer_name"]
    assert "kv_cache_dummy_dep" in _parameters(unified_attention_with_output)
    update_schema = torch.ops.vllm.unified_kv_cache_update.default._schema
    attention_schema = torch.ops.vllm.unified_attention_with_output.default._schema
    assert [a.name for a in update_schema.arguments] == ["key", "value", "layer_name"]
    assert len(update_schema.returns) == 1  # the ordering token passed on as kv_cache_dummy_dep
    assert "kv_cache_dummy_dep" in [a.name for a in attention_schema.arguments]
    assert _parameters(_encode_layer_name) == ["layer_name"]


def test_attention_layer_attributes_and_arguments():
    from vllm.model_executor.layers.attention import Attention

    parameters = _parameters(Attention.__init__)
    assert "kv_sharing_target_layer_name" in parameters and "attn_backend" in parameters
    source = inspect.getsource(Attention.__init__)
    for attribute in ("use_direct_call", "layer_name", "num_heads", "head_size", "query_quant"):
        assert re.search(rf"self\.{attribute}\b.*=", source), attribute
    # attend quantises the query as Attention.forward does, for backends that take an fp8 one
    forward = inspect.getsource(Attention.forward)
    assert "self.impl.supports_quant_query_input" in forward
    assert "self.query_quant(query, self._q_scale)" in forward


def test_fast_prefill_backend_and_metadata():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.utils import (
        KVSharingFastPrefillMetadata,
        create_fast_prefill_custom_backend,
    )
    from vllm.v1.attention.selector import get_attn_backend

    assert _parameters(create_fast_prefill_custom_backend) == ["prefix", "underlying_attn_backend"]
    assert _parameters(get_attn_backend)[:3] == ["head_size", "dtype", "kv_cache_dtype"]
    assert CPUAttentionBackend.forward_includes_kv_cache_update is False
    wrapped = create_fast_prefill_custom_backend("SwiftKV", CPUAttentionBackend)
    assert issubclass(wrapped, CPUAttentionBackend)
    assert set(KVSharingFastPrefillMetadata.__annotations__) >= {
        "logits_indices_padded",
        "num_logits_indices",
    }
    # runtime-checkable: the isinstance test in fast_prefill_logits_indices works on any object with the fields
    metadata = SimpleNamespace(logits_indices_padded=torch.tensor([3]), num_logits_indices=1)
    assert isinstance(metadata, KVSharingFastPrefillMetadata)
    assert not isinstance(SimpleNamespace(), KVSharingFastPrefillMetadata)


def test_forward_context_and_compile_tag():
    from vllm.compilation.backends import set_model_tag
    from vllm.forward_context import ForwardContext

    assert "attn_metadata" in ForwardContext.__dataclass_fields__
    assert _parameters(set_model_tag)[0] == "tag"


def test_shard_id_attribute_is_what_the_merged_linears_read():
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    from vllm.model_executor.models.utils import WeightsMapper

    from swiftkv_serve.vllm_internals import with_shard_id

    mapper = WeightsMapper(orig_to_new_stacked={".up_proj.": (".gate_up_proj.", 1)})
    [(name, tensor)] = mapper.apply([("mlp.up_proj.weight", torch.zeros(2))])
    assert name == "mlp.gate_up_proj.weight"
    mine = with_shard_id(torch.zeros(2), 1)
    assert mine.shard_id == tensor.shard_id == 1
    assert 'getattr(loaded_weight, "shard_id"' in inspect.getsource(MergedColumnParallelLinear.load_weights)


def test_fast_prefill_warning_is_vllm_configs_and_dropped_for_swiftkv_models_only():
    """vLLM's config still logs the warning, on the logger the plugin's filter is on; the filter drops it while a
    SwiftKV model's config is finalised, not another model's, and lets other lines through. (The server's log
    without it: tests/integration/test_quickstart.py.)"""
    import logging

    from transformers import LlamaConfig
    from vllm.config import VllmConfig

    from swiftkv_core import LlamaSwiftKVConfig
    from swiftkv_serve.vllm_internals import FAST_PREFILL_WARNING, drop_fast_prefill_warning

    assert FAST_PREFILL_WARNING in inspect.getsource(VllmConfig.__post_init__)
    assert VllmConfig.__module__ == "vllm.config.vllm"
    drop_fast_prefill_warning()
    drop_fast_prefill_warning()  # idempotent
    logger = logging.getLogger("vllm.config.vllm")
    assert len([f for f in logger.filters if type(f).__name__ == "_WithoutFastPrefillWarning"]) == 1

    def passes(message: str, hf_config) -> bool:
        self = object.__new__(VllmConfig)  # what VllmConfig.__post_init__ holds as `self` when it logs
        object.__setattr__(self, "model_config", SimpleNamespace(hf_config=hf_config))
        return bool(
            logger.filter(logger.makeRecord(logger.name, logging.WARNING, __file__, 0, message, (), None))
        )

    warning = FAST_PREFILL_WARNING + " for correctness and to realize prefill savings."
    assert not passes(warning, LlamaSwiftKVConfig(num_hidden_layers=4, num_key_value_layers=2))
    assert passes(warning, LlamaConfig(num_hidden_layers=4))
    assert passes(
        "Some other warning about --kv-sharing-fast-prefill.", LlamaSwiftKVConfig(num_hidden_layers=4)
    )


def test_attend_quantises_the_query_where_the_backend_takes_an_fp8_one(monkeypatch):
    """``attend`` (layers >= l) does what ``Attention.forward`` does before the op: with an fp8 KV cache on a backend
    that takes an fp8 query, the op gets the quantised query and the output keeps the model's dtype; elsewhere, the
    query as it is. Those backends (FlashAttention 3, FlashInfer) need a GPU that runs vLLM, so the layer here is a
    stand-in with the attributes ``test_attention_layer_attributes_and_arguments`` checks vLLM's layer has."""
    from swiftkv_serve import vllm_internals

    reached = {}
    monkeypatch.setattr(
        vllm_internals,
        "unified_attention_with_output",
        lambda query, *args, **kwargs: reached.update(query=query),
    )
    query = torch.randn(3, 8, dtype=torch.bfloat16)
    quantised = torch.zeros(3, 8, dtype=torch.float8_e4m3fn)
    for takes_fp8 in (True, False):
        attn = SimpleNamespace(
            num_heads=2, head_size=4, use_direct_call=True, layer_name="layers.5.attn", _q_scale=torch.tensor(1.0),
            query_quant=lambda q, scale: (quantised, scale), impl=SimpleNamespace(supports_quant_query_input=takes_fp8),
        )  # fmt: skip
        output = vllm_internals.attend(attn, query, None, None, None)
        assert output.dtype == torch.bfloat16 and output.shape == (3, 8)
        assert reached["query"].dtype == (torch.float8_e4m3fn if takes_fp8 else torch.bfloat16), takes_fp8
