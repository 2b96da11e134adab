"""Per-architecture engine settings for SwiftKV models, applied when vLLM builds its ``VllmConfig``.

vLLM looks up ``vllm.model_executor.models.config.MODELS_CONFIG_MAP[architecture].verify_and_update_config``
while it finalises the engine configuration (the same hook its in-tree models use). For a SwiftKV model with
``num_key_value_layers < num_hidden_layers`` ours:

- turns on ``cache_config.kv_sharing_fast_prefill``: the runner then hands the attention layers of layers
  ``>= l`` metadata for the tokens whose logits are needed only, which is what lets those layers run for one
  token per prompt chunk instead of all of them;
- adds ``SwiftKVPromptLogprobsGuard`` to the model's logits processors, which rejects prompt-logprobs requests
  with a clear message at admission (prompt logprobs are not computable under SwiftKV).

Without this hook (or with fast prefill switched off) the model is still exact, just without the prefill saving.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

PROMPT_LOGPROBS_GUARD = "swiftkv_serve.logits:SwiftKVPromptLogprobsGuard"


def _make_hook_class():
    from vllm.model_executor.models.config import VerifyAndUpdateConfig

    class SwiftKVEngineConfig(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            hf_config = vllm_config.model_config.hf_config
            num_layers = hf_config.num_hidden_layers
            num_kv_layers = getattr(hf_config, "num_key_value_layers", None) or num_layers
            if not getattr(hf_config, "swiftkv", True):
                logger.warning(
                    "This checkpoint's config has swiftkv=false; vLLM serves SwiftKV checkpoints with the SwiftKV "
                    "forward (num_key_value_layers=%d) regardless.",
                    num_kv_layers,
                )
            if num_kv_layers >= num_layers:
                return  # nothing skipped: the model is a plain Llama / Qwen2, prompt logprobs are right
            vllm_config.cache_config.kv_sharing_fast_prefill = True
            model_config = vllm_config.model_config
            processors = list(model_config.logits_processors or [])
            if PROMPT_LOGPROBS_GUARD not in processors:
                processors.append(PROMPT_LOGPROBS_GUARD)
            model_config.logits_processors = processors

    return SwiftKVEngineConfig


def register_engine_config_hooks(architectures) -> None:
    """Add the SwiftKV hook for each architecture name to vLLM's per-architecture config map (idempotent)."""
    from vllm.model_executor.models import config as model_configs

    hook = getattr(model_configs, "_swiftkv_engine_config", None)
    if hook is None:
        hook = _make_hook_class()
        model_configs._swiftkv_engine_config = hook
    for architecture in architectures:
        model_configs.MODELS_CONFIG_MAP[architecture] = hook
