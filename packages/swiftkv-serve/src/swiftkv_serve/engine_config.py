"""Per-architecture engine settings for SwiftKV models, applied when vLLM builds its ``VllmConfig``.

vLLM calls ``update_engine_config`` for the SwiftKV architectures while it finalises the engine configuration
(the hook its in-tree models use; registered through ``vllm_internals.register_config_hook``). For a SwiftKV
model with ``num_key_value_layers < num_hidden_layers`` it turns on ``cache_config.kv_sharing_fast_prefill``:
the runner then hands the attention layers of layers ``>= l`` metadata for the tokens whose logits are needed
only, which is what lets those layers run for one token per prompt chunk instead of all of them.

``check_request`` (installed by ``register_engine_config_hooks`` into vLLM's per-request admission check, through
``vllm_internals.install_request_check``) then refuses prompt-logprobs requests to such a model with a clear
message, offline and in the server: the prompt tokens' logits are never computed under fast prefill. It is not a
logits processor, so speculative decoding (which vLLM refuses to start alongside custom logits processors),
prefix caching and vLLM's other features stay available.

Fast prefill can be switched off per engine: ``--additional-config '{"swiftkv_fast_prefill": false}'`` (or
``LLM(..., additional_config={"swiftkv_fast_prefill": False})``). Layers ``>= l`` then run for every prompt token:
the same outputs, no prefill saving, and prompt logprobs are served (scoring prompts with the SwiftKV model itself).
"""

from __future__ import annotations

from collections.abc import Iterable

from swiftkv_core.configuration import SwiftKVConfigMixin

from . import plugin_logger

logger = plugin_logger(__name__)

FAST_PREFILL_OPTION = "swiftkv_fast_prefill"
PROMPT_LOGPROBS_MESSAGE = (
    "prompt_logprobs are not supported by SwiftKV models with fast prefill: layers >= num_key_value_layers run "
    "only for the tokens whose next-token logits are sampled, so the prompt tokens' logprobs are never computed. "
    "To score prompts with this model, serve it with fast prefill off: --additional-config "
    f"'{{\"{FAST_PREFILL_OPTION}\": false}}' (same outputs, no prefill saving)."
)


def fp8_kv_cache_problem(cache_dtype: str, is_cpu: bool, has_avx512: bool, has_amx: bool) -> str | None:
    """Why vLLM's CPU backend cannot hold a quantised (fp8) KV cache on this machine, or ``None``.

    Its CPU attention has fp8 KV kernels for AVX-512 and AMX only (``cpu_attn._get_attn_isa``) and refuses other
    CPUs only when it builds the attention metadata: after the model has loaded, in the engine-core process
    (where a multiprocess engine reports a failed start), and without a way out. Here, while vLLM finalises its
    config, the refusal comes first and says what to do instead.
    """
    from vllm.utils.torch_utils import is_quantized_kv_cache

    if not is_cpu or not is_quantized_kv_cache(cache_dtype) or has_avx512 or has_amx:
        return None
    return (
        f"--kv-cache-dtype {cache_dtype} is not available on this CPU: vLLM's CPU backend stores a quantised KV "
        "cache only with its AVX-512 or AMX kernels, and this CPU has neither. Use the default kv-cache dtype "
        "('auto', the model's dtype; AcrossKV still shrinks the cache) or serve on a GPU."
    )


def cpu_instruction_sets() -> tuple[bool, bool]:
    """Whether this CPU has AVX-512 and AMX, by torch's probes (vLLM picks its CPU kernels by the same ones)."""
    import torch

    return torch.cpu._is_avx512_supported(), torch.cpu._is_amx_tile_supported()


def check_kv_cache_dtype(vllm_config) -> None:
    """Raise ``fp8_kv_cache_problem`` for this machine, if any, before the model loads."""
    from vllm.platforms import current_platform

    problem = fp8_kv_cache_problem(
        vllm_config.cache_config.cache_dtype, current_platform.is_cpu(), *cpu_instruction_sets()
    )
    if problem:
        raise ValueError(problem)


def fast_prefill_requested(additional_config) -> bool:
    """``additional_config[FAST_PREFILL_OPTION]`` (default true); raises ``ValueError`` for a value that is not a
    boolean or a ``swiftkv`` key this plugin does not know (a typo would otherwise be ignored silently)."""
    options = additional_config if isinstance(additional_config, dict) else {}
    unknown = sorted(
        key for key in options if key.lower().startswith("swiftkv") and key != FAST_PREFILL_OPTION
    )
    if unknown:
        raise ValueError(
            f"--additional-config {unknown}: unknown SwiftKV option; the only one is {FAST_PREFILL_OPTION!r}."
        )
    value = options.get(FAST_PREFILL_OPTION, True)
    if not isinstance(value, bool):
        raise ValueError(
            f"--additional-config {FAST_PREFILL_OPTION}={value!r}: use true (the default: layers >= l skip the "
            "prompt tokens) or false (every layer runs for every prompt token; prompt logprobs are served)."
        )
    return value


def update_engine_config(vllm_config) -> None:
    """Fast prefill for a SwiftKV model that skips layers (``l < L``) and generates (not a pooling runner: embeddings
    and rewards read every position), unless ``FAST_PREFILL_OPTION`` is false."""
    check_kv_cache_dtype(vllm_config)
    fast_prefill = fast_prefill_requested(vllm_config.additional_config)
    hf_config = vllm_config.model_config.hf_config  # a swiftkv_core SwiftKV config
    if not hf_config.swiftkv:
        logger.warning(
            "This checkpoint's config has swiftkv=false; vLLM serves SwiftKV checkpoints with the SwiftKV "
            "forward (num_key_value_layers=%d) regardless.",
            hf_config.num_key_value_layers,
        )
    if not hf_config.num_kv_groups:
        return  # nothing skipped: the model is a plain Llama / Qwen2, prompt logprobs are right
    if vllm_config.model_config.runner_type != "generate":
        logger.info(
            "SwiftKV: fast prefill off for the %s runner: it reads every position's hidden state, which layers >= %d "
            "compute only where fast prefill keeps them.",
            vllm_config.model_config.runner_type,
            hf_config.num_key_value_layers,
        )
        vllm_config.cache_config.kv_sharing_fast_prefill = False  # also where --kv-sharing-fast-prefill asked
        return
    if not fast_prefill:
        logger.info(
            "SwiftKV: fast prefill off (%s=false): layers >= %d run for every prompt token, so the outputs are the "
            "same, prompt logprobs are served and the prefill saving is lost.",
            FAST_PREFILL_OPTION,
            hf_config.num_key_value_layers,
        )
        vllm_config.cache_config.kv_sharing_fast_prefill = False  # also where --kv-sharing-fast-prefill asked
        return
    vllm_config.cache_config.kv_sharing_fast_prefill = True


def check_request(vllm_config, sampling_params) -> None:
    """Refuse prompt logprobs for a SwiftKV model served with fast prefill (any other request passes)."""
    if sampling_params.prompt_logprobs is None or not vllm_config.cache_config.kv_sharing_fast_prefill:
        return
    hf_config = vllm_config.model_config.hf_config
    if isinstance(hf_config, SwiftKVConfigMixin) and hf_config.num_kv_groups:
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError(PROMPT_LOGPROBS_MESSAGE, parameter="prompt_logprobs")


def register_engine_config_hooks(architectures: Iterable[str]) -> None:
    """Have vLLM apply ``update_engine_config`` to each architecture, and ``check_request``; and drop vLLM's
    warning that fast prefill "requires changes on model side" for SwiftKV models, which are that side
    (idempotent)."""
    from .vllm_internals import drop_fast_prefill_warning, install_request_check, register_config_hook

    register_config_hook(architectures, update_engine_config)
    install_request_check(check_request)
    drop_fast_prefill_warning()
