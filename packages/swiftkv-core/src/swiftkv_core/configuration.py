"""SwiftKV configs: the base family's config plus the three published keys.

The published SwiftKV checkpoint format: ``swiftkv`` (rewired forward on/off), ``num_key_value_layers``
(``l``: layers ``>= l`` take their K/V from the hidden state entering layer ``l``) and
``key_value_group_size`` (AcrossKV: one K/V per group of consecutive layers ``>= l``).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig, Qwen2Config


def validate_layers(
    num_hidden_layers: int,
    num_key_value_layers: int,
    key_value_group_size: int = 1,
    allow_no_skip: bool = True,
) -> None:
    """The one rule for ``(l, g)``; raises ``ValueError`` saying what is wrong and which values are valid.

    ``1 <= l <= L`` and ``g`` divides ``L - l``. ``l == L`` (nothing skipped: the base model) is a valid SwiftKV
    checkpoint, and the published default when the key is absent, so configs accept it; distillation and the
    quickstart pass ``allow_no_skip=False``: at ``l == L`` there is no SwiftKV projection to train or measure.
    """
    L, l, g = num_hidden_layers, num_key_value_layers, key_value_group_size
    top = L if allow_no_skip else L - 1
    if not isinstance(l, int) or isinstance(l, bool) or not 1 <= l <= top:
        why = (
            f"{L} means no layer is skipped"
            if allow_no_skip
            else f"l={L} would skip nothing, so nothing trains"
        )
        raise ValueError(
            f"num_key_value_layers={l!r} is out of range: it must be an integer in [1, {top}] "
            f"(num_hidden_layers={L}; {why}; {L // 2} halves prefill compute)."
        )
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise ValueError(f"key_value_group_size={g!r} must be a positive integer (1 disables AcrossKV).")
    if (L - l) % g != 0:
        valid = [d for d in range(1, max(L - l, 1) + 1) if (L - l) % d == 0]
        raise ValueError(
            f"key_value_group_size={g} must divide num_hidden_layers - num_key_value_layers = {L - l}; "
            f"valid group sizes for l={l}: {valid}."
        )


def num_kv_cache_layers(
    num_hidden_layers: int, num_key_value_layers: int, key_value_group_size: int = 1
) -> int:
    """K/V tensors stored per token under SwiftKV: ``l + (L - l) / g`` (one per layer ``< l``, one per group)."""
    validate_layers(num_hidden_layers, num_key_value_layers, key_value_group_size)
    return num_key_value_layers + (num_hidden_layers - num_key_value_layers) // key_value_group_size


# transformers' tensor-parallel plan (``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``)
# for the projections SwiftKV adds: split by heads as the family's q/k/v, so each process's o_proj (split by its
# input) gets its own heads; the other added weights (norm_swiftkv) are replicated
SWIFTKV_TP_PLAN = {
    "layers.*.self_attn.q_proj_swiftkv": "colwise",
    "layers.*.self_attn.k_proj_swiftkv": "colwise",
    "layers.*.self_attn.v_proj_swiftkv": "colwise",
}


class SwiftKVConfigMixin:
    """Validation and layer bookkeeping shared by every SwiftKV config (the AcrossKV group arithmetic lives here).

    ``serving_only`` is ours, not the published format's: a checkpoint written by ``export_for_serving`` leaves
    out the teacher q/k/v of layers ``>= l``, so a model built from it cannot run the original forward.
    ``lora_rank`` is ours too: with ``r > 0`` every layer ``>= l`` also has rank-``r`` adapters on ``o_proj`` and
    the MLP that only the SwiftKV forward adds (the teacher runs without them). ``export_for_serving`` merges them
    into the weights and writes ``lora_rank = 0``: the published format. ``lora_prefix`` (with ``lora_rank > 0``):
    the MLP of layers ``< l`` has adapters too, on whenever ``swiftkv`` is.
    """

    def _post_init_swiftkv(self) -> None:
        if self.num_key_value_layers is None:
            self.num_key_value_layers = self.num_hidden_layers

    def validate_swiftkv(self) -> None:
        validate_layers(self.num_hidden_layers, self.num_key_value_layers, self.key_value_group_size)
        if not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool) or self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank!r} must be an integer >= 0 (0: no adapters).")
        if self.lora_prefix and not self.lora_rank:
            raise ValueError(
                "lora_prefix=True needs lora_rank > 0 (the adapters' rank); set both or neither."
            )
        if self.serving_only and not self.swiftkv:
            raise ValueError(
                "swiftkv=False needs the teacher q/k/v projections, but this config is serving_only (written by "
                "export_for_serving without them). Load the full checkpoint to run the original model."
            )

    def to_dict(self) -> dict:
        """As transformers 5 writes a config (RoPE under ``rope_parameters``), with RoPE also as transformers 4 and
        the published checkpoints write it (``rope_theta``, ``rope_scaling``): a loader of that generation, the
        published vLLM plugin's stack among them, would otherwise take its default theta and no scaling, and compute
        every position wrong without a word. Transformers 5 reads either."""
        output = super().to_dict()
        rope = dict(output.get("rope_parameters") or {})
        if "rope_theta" in rope:
            output["rope_theta"] = rope.pop("rope_theta")
            output["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        return output

    # --- layer bookkeeping, used by the model, the cache accounting, the FLOPs model and the vLLM model ---
    def is_swiftkv_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` takes its K/V from the single input (``layer_idx >= l``)."""
        return layer_idx >= self.num_key_value_layers

    def kv_group_index(self, layer_idx: int) -> int:
        """The AcrossKV group (0, 1, ...) of a layer ``>= l``."""
        return (layer_idx - self.num_key_value_layers) // self.key_value_group_size

    def kv_group_leader(self, layer_idx: int) -> int:
        """The layer that owns the K/V projections (and cache) used by ``layer_idx``."""
        if layer_idx < self.num_key_value_layers:
            return layer_idx
        return self.num_key_value_layers + self.kv_group_index(layer_idx) * self.key_value_group_size

    @property
    def kv_group_leaders(self) -> list[int]:
        """The first layer of every AcrossKV group, in order."""
        return list(range(self.num_key_value_layers, self.num_hidden_layers, self.key_value_group_size))

    @property
    def num_kv_groups(self) -> int:
        """AcrossKV groups of layers ``>= l``: ``(L - l) / g``."""
        return (self.num_hidden_layers - self.num_key_value_layers) // self.key_value_group_size

    def kv_cache_index(self, layer_idx: int, swiftkv: bool | None = None) -> int:
        """Cache slot of ``layer_idx``: layers of one AcrossKV group share one slot when SwiftKV is on."""
        swiftkv = self.swiftkv if swiftkv is None else swiftkv
        if not swiftkv or layer_idx < self.num_key_value_layers:
            return layer_idx
        return self.num_key_value_layers + self.kv_group_index(layer_idx)

    @property
    def num_kv_cache_layers(self) -> int:
        """K/V tensors stored per token when SwiftKV is on: ``l + (L - l) / g``."""
        return num_kv_cache_layers(
            self.num_hidden_layers, self.num_key_value_layers, self.key_value_group_size
        )

    @property
    def num_kv_shared_layers(self) -> int:
        """The trailing cache slots a model never writes, in transformers' convention (Gemma3n's: layers that share
        an earlier layer's K/V): with SwiftKV on, the ``L - (l + (L - l) / g)`` slots AcrossKV leaves empty, so a
        cache built from this config (``DynamicCache(config=...)``, ``StaticCache``, the one ``generate`` makes)
        holds exactly the slots in use. An empty slot would break transformers' cache operations that do not check
        for one: ``crop`` (prompt lookup and assisted decoding) and offloading's prefetch of the next slot."""
        return self.num_hidden_layers - self.num_kv_cache_layers if self.swiftkv else 0


def cache_slots(config) -> int:
    """The K/V slots a cache built from ``config`` holds, as transformers' caches count them: one per layer, less
    ``num_kv_shared_layers`` (SwiftKV on: one per layer ``< l`` and per AcrossKV group); any family's config."""
    return config.num_hidden_layers - getattr(config, "num_kv_shared_layers", 0)


@strict
class LlamaSwiftKVConfig(SwiftKVConfigMixin, LlamaConfig):
    """``LlamaConfig`` + SwiftKV keys. Also used for Mistral checkpoints (same layer structure)."""

    model_type = "llama_swiftkv"
    base_model_tp_plan = {**LlamaConfig.base_model_tp_plan, **SWIFTKV_TP_PLAN}

    swiftkv: bool = False
    num_key_value_layers: int | None = None
    key_value_group_size: int = 1
    serving_only: bool = False
    lora_rank: int = 0
    lora_prefix: bool = False

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
    base_model_tp_plan = {**Qwen2Config.base_model_tp_plan, **SWIFTKV_TP_PLAN}

    swiftkv: bool = False
    num_key_value_layers: int | None = None
    key_value_group_size: int = 1
    serving_only: bool = False
    lora_rank: int = 0
    lora_prefix: bool = False

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
