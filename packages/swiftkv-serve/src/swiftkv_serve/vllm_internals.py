"""Every use of vLLM 0.32.0 internals by this plugin, in one place (and nowhere else in the package).

vLLM's model-author API (its layers, ``Attention``, ``support_torch_compile``, ``ModelRegistry``,
``AutoWeightsLoader`` / ``WeightsMapper``) is used where it belongs, in ``model.py``. What SwiftKV needs beyond
that is below, each with the reason; ``tests/serve/test_vllm_internals.py`` fails when vLLM changes one of them,
which is what to read first on a vLLM upgrade.

- ``register_config_hook``: an entry in ``MODELS_CONFIG_MAP`` (the per-architecture config hooks of vLLM's
  in-tree models; there is no public registration), so that a SwiftKV model gets ``kv_sharing_fast_prefill``
  without the user asking for it.
- ``install_request_check``: a check run first in ``InputProcessor._validate_params``, the admission check of
  every request in the offline ``LLM`` and in the server alike. It refuses prompt logprobs; a custom logits
  processor's ``validate_params`` would too, but vLLM refuses to start speculative decoding with any custom
  logits processor configured, and the server path (``AsyncLLM``) alone checks prompt logprobs under fast prefill.
- ``fast_prefill_attention_backend``: the attention backend of layers ``>= l``, wrapped by
  ``create_fast_prefill_custom_backend`` so that their metadata covers only the tokens whose logits are sampled.
- ``write_kv`` / ``attend``: the two custom ops ``Attention.forward`` runs back to back
  (``unified_kv_cache_update``, ``unified_attention_with_output``), called separately: the K/V of layers
  ``>= l`` are written for every token, attention runs for a subset.
- ``fast_prefill_logits_indices``: the runner's fast-prefill metadata (``KVSharingFastPrefillMetadata``),
  read from the forward context: which tokens layers ``>= l`` run for.
- ``compile_unit_tag``: ``set_model_tag``, which names the two torch.compile units (as vLLM's Gemma3n does).
- ``with_shard_id``: the ``shard_id`` attribute that ``WeightsMapper`` puts on a stacked weight and the merged
  linears' ``load_weights`` read: how a group leader's K/V reaches its shard of the fused projection.
- ``drop_fast_prefill_warning``: a filter on the logger of ``VllmConfig`` (``vllm.config.vllm``) for its warning
  that fast prefill "requires changes on model side", which a SwiftKV model is.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable
from functools import cache, wraps

import torch
from vllm.compilation.backends import set_model_tag
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import (
    unified_attention_with_output,
    unified_kv_cache_update,
)
from vllm.utils.torch_utils import _encode_layer_name
from vllm.v1.attention.backends.utils import KVSharingFastPrefillMetadata, create_fast_prefill_custom_backend
from vllm.v1.attention.selector import get_attn_backend

CONFIG_HOOK_NAME = "SwiftKVEngineConfig"


# --- engine configuration ---
@cache
def _config_hook_class(update_config: Callable) -> type:
    from vllm.model_executor.models.config import VerifyAndUpdateConfig

    return type(
        CONFIG_HOOK_NAME,
        (VerifyAndUpdateConfig,),
        {"verify_and_update_config": staticmethod(update_config), "__doc__": update_config.__doc__},
    )


def register_config_hook(architectures: Iterable[str], update_config: Callable) -> None:
    """Have vLLM call ``update_config(vllm_config)`` while it finalises the engine config of these architectures.

    Idempotent: the same hook class for the same function, however often the plugin is registered.
    """
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    hook = _config_hook_class(update_config)
    for architecture in architectures:
        MODELS_CONFIG_MAP[architecture] = hook


REQUEST_CHECK_ATTRIBUTE = "swiftkv_request_check"


def install_request_check(check: Callable) -> None:
    """Have vLLM call ``check(vllm_config, sampling_params)`` for every generation request at admission.

    ``check`` raises ``VLLMValidationError`` to refuse a request (``LLM.generate`` raises it, the server answers
    HTTP 400) and must be cheap: it runs for every request of every engine in the process, SwiftKV or not.
    Idempotent: installing again replaces the check, never stacks a second wrapper.
    """
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    validate_params = InputProcessor._validate_params
    original = (
        validate_params.__wrapped__ if hasattr(validate_params, REQUEST_CHECK_ATTRIBUTE) else validate_params
    )

    @wraps(original)
    def _validate_params(self, params, *args, **kwargs):
        if isinstance(params, SamplingParams):
            check(self.vllm_config, params)
        return original(self, params, *args, **kwargs)

    setattr(_validate_params, REQUEST_CHECK_ATTRIBUTE, check)
    InputProcessor._validate_params = _validate_params


# --- attention: cache writes apart from attention, fast-prefill metadata ---
def fast_prefill_attention_backend(head_size: int, kv_cache_dtype: str) -> type:
    """The attention backend vLLM would choose, wrapped for fast prefill (``kv_sharing_fast_prefill``).

    Refuses backends that write the cache inside the attention kernel: SwiftKV writes K/V for every token and
    attends for a subset, so the two must be separate.
    """
    backend = get_attn_backend(head_size, torch.get_default_dtype(), kv_cache_dtype)
    if backend.forward_includes_kv_cache_update:
        raise NotImplementedError(
            f"SwiftKV needs an attention backend that writes the KV cache separately from attention; "
            f"{backend.get_name()} does both in one kernel. Choose another backend (e.g. FLASH_ATTN)."
        )
    return create_fast_prefill_custom_backend("SwiftKV", backend)


def write_kv(attn: Attention, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Write ``key``/``value`` (all scheduled tokens) into ``attn``'s cache; returns the ordering token."""
    if attn.use_direct_call:
        return unified_kv_cache_update(key, value, attn.layer_name)
    return torch.ops.vllm.unified_kv_cache_update(key, value, _encode_layer_name(attn.layer_name))


def attend(
    attn: Attention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache_dummy_dep: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of ``query`` over the cache only (this layer's K/V were written before, for all tokens).

    ``kv_cache_dummy_dep`` is the result of the cache write: passing it keeps torch.compile from reordering
    or dropping the write (as vLLM's ``Attention.forward`` does). With an fp8 KV cache, backends that take an fp8
    query (FlashAttention 3, FlashInfer on Blackwell) get it quantised, as ``Attention.forward`` does too.
    """
    output = torch.empty(
        (query.shape[0], attn.num_heads * attn.head_size), dtype=query.dtype, device=query.device
    )
    if attn.query_quant is not None and attn.impl.supports_quant_query_input:
        query, _ = attn.query_quant(query, attn._q_scale)
    args = (
        query.view(-1, attn.num_heads, attn.head_size),
        key,
        value,
        output.view(-1, attn.num_heads, attn.head_size),
    )
    if attn.use_direct_call:
        unified_attention_with_output(*args, attn.layer_name, kv_cache_dummy_dep=kv_cache_dummy_dep)
    else:
        torch.ops.vllm.unified_attention_with_output(
            *args, _encode_layer_name(attn.layer_name), kv_cache_dummy_dep=kv_cache_dummy_dep
        )
    return output


def fast_prefill_logits_indices(layer_name: str, num_tokens: int) -> tuple[torch.Tensor | None, int | None]:
    """``(logits_indices_padded, num_logits_indices)`` of this step for a fast-prefill layer, or ``(None,
    None)`` when the layer runs for all ``num_tokens`` (profiling and dummy runs, fast prefill off, pure decode).
    """
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):  # profiling / dummy runs
        return None, None
    metadata = attn_metadata.get(layer_name)
    if not isinstance(metadata, KVSharingFastPrefillMetadata) or metadata.logits_indices_padded is None:
        return None, None
    if metadata.num_logits_indices == num_tokens:
        # Every scheduled token needs its logits (pure decode): the metadata is the full one, no gather.
        return None, None
    return metadata.logits_indices_padded, metadata.num_logits_indices


# --- torch.compile ---
def compile_unit_tag(tag: str):
    """Context manager: the ``@support_torch_compile`` module built inside it is compiled (and logged) as ``tag``."""
    return set_model_tag(tag)


# --- weight loading ---
def with_shard_id(tensor: torch.Tensor, shard_id: int | str) -> torch.Tensor:
    """``tensor`` marked for shard ``shard_id`` of a merged linear, as ``WeightsMapper`` marks stacked weights."""
    tensor.shard_id = shard_id
    return tensor


# --- vLLM's log ---
FAST_PREFILL_WARNING = "--kv-sharing-fast-prefill requires changes on model side"


class _WithoutFastPrefillWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith(FAST_PREFILL_WARNING) and _finalising_a_swiftkv_config())


def _finalising_a_swiftkv_config() -> bool:
    """Whether the ``VllmConfig`` being finalised up the call stack (its ``__post_init__`` logs the warning) is a
    SwiftKV model's."""
    from vllm.config import VllmConfig

    from swiftkv_core.configuration import SwiftKVConfigMixin

    frame = sys._getframe(1)
    while frame is not None:
        config = frame.f_locals.get("self")
        if isinstance(config, VllmConfig):
            return isinstance(getattr(config.model_config, "hf_config", None), SwiftKVConfigMixin)
        frame = frame.f_back
    return False


def drop_fast_prefill_warning() -> None:
    """Drop the warning ``VllmConfig`` logs for an engine with ``kv_sharing_fast_prefill`` on, that it "requires
    changes on model side for correctness and to realize prefill savings", where the model is a SwiftKV model: it
    is that model side, and the warning reads like a fault to its users. Other models keep the warning. Installed by
    the plugin in every vLLM process (the server's, the engine core's: each finalises the config). Idempotent."""
    logger = logging.getLogger("vllm.config.vllm")
    if not any(isinstance(f, _WithoutFastPrefillWarning) for f in logger.filters):
        logger.addFilter(_WithoutFastPrefillWarning())
