"""SwiftKV configs: the base family's config plus the three published keys.

See ``shared/notes/checkpoint-format.md``: ``swiftkv`` (rewired forward on/off), ``num_key_value_layers``
(``l``: layers ``>= l`` take their K/V from the hidden state entering layer ``l``) and
``key_value_group_size`` (AcrossKV: one K/V per group of consecutive layers ``>= l``).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig, Qwen2Config


class SwiftKVConfigMixin:
    """Validation and layer bookkeeping shared by every SwiftKV config.

    ``serving_only`` is ours, not the published format's: a checkpoint written by ``export_for_serving`` leaves
    out the teacher q/k/v of layers ``>= l``, so a model built from it cannot run the original forward.
    """

    def _post_init_swiftkv(self) -> None:
        if self.num_key_value_layers is None:
            self.num_key_value_layers = self.num_hidden_layers

    def validate_swiftkv(self) -> None:
        L, l, g = self.num_hidden_layers, self.num_key_value_layers, self.key_value_group_size
        if not isinstance(l, int) or not 1 <= l <= L:
            raise ValueError(
                f"num_key_value_layers={l!r} is out of range: it must be an integer in [1, {L}] "
                f"(num_hidden_layers={L}); {L} means no layer is skipped, {L // 2} halves prefill compute."
            )
        if not isinstance(g, int) or g < 1:
            raise ValueError(f"key_value_group_size={g!r} must be a positive integer (1 disables AcrossKV).")
        if (L - l) % g != 0:
            valid = [d for d in range(1, max(L - l, 1) + 1) if (L - l) % d == 0]
            raise ValueError(
                f"key_value_group_size={g} must divide num_hidden_layers - num_key_value_layers = {L - l}; "
                f"valid group sizes for l={l}: {valid}."
            )
        if self.serving_only and not self.swiftkv:
            raise ValueError(
                "swiftkv=False needs the teacher q/k/v projections, but this config is serving_only (written by "
                "export_for_serving without them). Load the full checkpoint to run the original model."
            )

    # --- layer bookkeeping, used by the model, the cache accounting and the FLOPs model ---
    def is_swiftkv_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` takes its K/V from the single input (``layer_idx >= l``)."""
        return layer_idx >= self.num_key_value_layers

    def kv_group_leader(self, layer_idx: int) -> int:
        """The layer that owns the K/V projections (and cache) used by ``layer_idx``."""
        l, g = self.num_key_value_layers, self.key_value_group_size
        if layer_idx < l:
            return layer_idx
        return l + (layer_idx - l) // g * g

    def kv_cache_index(self, layer_idx: int, swiftkv: bool | None = None) -> int:
        """Cache slot of ``layer_idx``: layers of one AcrossKV group share one slot when SwiftKV is on."""
        swiftkv = self.swiftkv if swiftkv is None else swiftkv
        l, g = self.num_key_value_layers, self.key_value_group_size
        if not swiftkv or layer_idx < l:
            return layer_idx
        return l + (layer_idx - l) // g

    @property
    def num_kv_cache_layers(self) -> int:
        """K/V tensors stored per token when SwiftKV is on: ``l + (L - l) / g``."""
        return self.num_key_value_layers + (self.num_hidden_layers - self.num_key_value_layers) // (
            self.key_value_group_size
        )


@strict
class LlamaSwiftKVConfig(SwiftKVConfigMixin, LlamaConfig):
    """``LlamaConfig`` + SwiftKV keys. Also used for Mistral checkpoints (same layer structure)."""

    model_type = "llama_swiftkv"

    swiftkv: bool = False
    num_key_value_layers: int | None = None
    key_value_group_size: int = 1
    serving_only: bool = False

    def __post_init__(self, **kwargs):
        self._post_init_swiftkv()
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        super().validate_architecture()
        self.validate_swiftkv()


@strict
class Qwen2SwiftKVConfig(SwiftKVConfigMixin, Qwen2Config):
    """``Qwen2Config`` + SwiftKV keys. Sliding-window attention is not supported (Qwen2.5 does not use it)."""

    model_type = "qwen2_swiftkv"

    swiftkv: bool = False
    num_key_value_layers: int | None = None
    key_value_group_size: int = 1
    serving_only: bool = False

    def __post_init__(self, **kwargs):
        self._post_init_swiftkv()
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        if hasattr(super(), "validate_architecture"):
            super().validate_architecture()
        if self.sliding_window is not None or "sliding_attention" in (self.layer_types or []):
            raise ValueError(
                "Qwen2SwiftKVConfig does not support sliding-window attention (use_sliding_window=True); "
                "set use_sliding_window=False (the Qwen2.5 default)."
            )
        self.validate_swiftkv()
