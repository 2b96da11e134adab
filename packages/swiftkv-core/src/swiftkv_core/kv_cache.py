"""KV caches for the HF path: the default (compute dtype) cache, or an FP8 cache (arXiv 2410.03960, Sec. 5.3).

The FP8 cache stores every K and V vector as ``float8_e4m3fn`` with one float32 scale per token and KV head
(``amax / 448`` of that head's vector), and dequantises to the compute dtype on read: torch has fp8 casts on
every device but no fp8 matmuls on CPU, and the attention runs as usual on the dequantised values.
Per-token scales make the stored value of a token independent of every other token, so chunked prefill,
left padding and batching store exactly what one unbatched prefill would; post-training, nothing to calibrate.

It is an ordinary ``transformers`` ``Cache``: pass it as ``past_key_values`` to ``forward`` or ``generate`` of
any model (SwiftKV on or off: build it in the mode it is used in, as its slots follow the config). AcrossKV composes
by construction: the model writes one K/V per group into it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from .configuration import cache_slots

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SCALE_DTYPE = torch.float32  # one scale per token and KV head; fp32 so the scale adds no rounding of its own

# What a cache can store: "auto" keeps the model's compute dtype (transformers' DynamicCache).
KV_CACHE_DTYPES = ("auto", "fp8")
# Storage names of the byte accounting (``flops.kv_cache_bytes_per_token``); "auto" is one of the first three.
STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8_DTYPE}


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Raise a ``ValueError`` naming the valid choices for anything but ``"auto"`` or ``"fp8"``."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported: use 'auto' (the model's dtype) or 'fp8' "
            "(float8_e4m3fn with a float32 scale per token and KV head)."
        )


def storage_bytes(storage_dtype: str) -> tuple[int, int]:
    """``(bytes per K or V element, scale bytes per token and KV head)`` of a storage dtype name."""
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(
            f"KV cache dtype {storage_dtype!r} is unknown: use one of {sorted(STORAGE_DTYPES)} "
            "(fp8 is float8_e4m3fn plus a float32 scale per token and KV head)."
        )
    scale = SCALE_DTYPE.itemsize if storage_dtype == "fp8" else 0
    return STORAGE_DTYPES[storage_dtype].itemsize, scale


def storage_name(compute_dtype: torch.dtype, kv_cache_dtype: str = "auto") -> str:
    """The storage name (a key of ``STORAGE_DTYPES``) of a cache of a model computing in ``compute_dtype``."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "fp8":
        return "fp8"
    for name, dtype in STORAGE_DTYPES.items():
        if dtype == compute_dtype:
            return name
    raise ValueError(
        f"No KV cache accounting for a model computing in {compute_dtype}: use fp32, bf16 or fp16."
    )


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x / scale in e4m3, scale)`` with ``scale = amax / 448`` over the last dim (one head's vector)."""
    amax = x.detach().abs().amax(-1, keepdim=True).to(SCALE_DTYPE)
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(SCALE_DTYPE).tiny)  # an all-zero vector stays zero
    # a float32 copy of x, divided and clamped in place: one float32 temporary of x's size on every device
    return x.to(SCALE_DTYPE, copy=True).div_(scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in ``dtype``, each element multiplied in float32 and rounded once (e4m3 is exact in every
    compute dtype). Every decode step dequantises each layer's whole cache, so the temporaries count: on CUDA, cast
    and scaled in place, the kernel converting each element on the fly (the result alone, 2 bytes an element in
    bf16); elsewhere a float32 copy scaled in place, then cast (6), as a CPU kernel would copy a mixed-dtype
    operation's operands to float32 first."""
    if q.device.type == "cuda":
        return q.to(dtype).mul_(scale)
    return q.to(SCALE_DTYPE).mul_(scale).to(dtype)


class FP8KVLayer(DynamicLayer):
    """One layer's K/V as e4m3 ``keys`` / ``values`` ``[batch, kv_heads, tokens, head_dim]`` plus float32
    ``key_scales`` / ``value_scales`` ``[batch, kv_heads, tokens, 1]``; ``update`` returns all of it
    dequantised.

    The new tokens are returned dequantised too (not as computed), so a prompt attends to exactly what later
    tokens will read: a chunked prefill equals a one-shot prefill.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device  # the compute dtype reads return
        self.keys = key_states.new_empty((*key_states.shape[:-2], 0, key_states.shape[-1]), dtype=FP8_DTYPE)
        self.values = value_states.new_empty(
            (*value_states.shape[:-2], 0, value_states.shape[-1]), dtype=FP8_DTYPE
        )
        self.key_scales = key_states.new_empty((*key_states.shape[:-2], 0, 1), dtype=SCALE_DTYPE)
        self.value_scales = value_states.new_empty((*value_states.shape[:-2], 0, 1), dtype=SCALE_DTYPE)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        (keys, key_scales), (values, value_scales) = quantize_fp8(key_states), quantize_fp8(value_states)
        self.keys = torch.cat([self.keys, keys], dim=-2)
        self.values = torch.cat([self.values, values], dim=-2)
        self.key_scales = torch.cat([self.key_scales, key_scales], dim=-2)
        self.value_scales = torch.cat([self.value_scales, value_scales], dim=-2)
        return self.dequantized()

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K and V in the compute dtype."""
        return (
            dequantize_fp8(self.keys, self.key_scales, self.dtype),
            dequantize_fp8(self.values, self.value_scales, self.dtype),
        )

    @property
    def nbytes(self) -> int:
        """Bytes held: e4m3 K and V plus their scales."""
        if not self.is_initialized:
            return 0
        return sum(t.nbytes for t in (self.keys, self.values, self.key_scales, self.value_scales))

    # The batch and length edits of DynamicLayer (beam search, assisted decoding), applied to the scales too.
    def _apply(self, fn) -> None:
        if self.get_seq_length() > 0:
            self.keys, self.values, self.key_scales, self.value_scales = (
                fn(t) for t in (self.keys, self.values, self.key_scales, self.value_scales)
            )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        """A negative value removes that many tokens, a positive one is the length to keep (DynamicLayer's)."""
        length = self.get_seq_length()
        keep = min(tokens_to_remove, length) if tokens_to_remove > 0 else length + tokens_to_remove
        self._apply(lambda t: t[..., :keep, :])

    def reset(self) -> None:
        super().reset()
        self.key_scales = self.value_scales = None


class FP8KVCache(Cache):
    """A cache of ``FP8KVLayer``, one per cache slot of ``config``: one per layer, or with SwiftKV on, one per
    layer ``< l`` and per AcrossKV group (``num_kv_shared_layers``, as transformers' own caches count them)."""

    def __init__(self, config):
        config = config.get_text_config(decoder=True)
        super().__init__(layers=[FP8KVLayer() for _ in range(cache_slots(config))])


def make_kv_cache(config, kv_cache_dtype: str = "auto") -> Cache:
    """An empty cache for a model with ``config``: ``"auto"`` stores the compute dtype, ``"fp8"`` e4m3."""
    check_kv_cache_dtype(kv_cache_dtype)
    return FP8KVCache(config) if kv_cache_dtype == "fp8" else DynamicCache(config=config)


def kv_cache_nbytes(cache: Cache) -> int:
    """Bytes of every tensor the cache holds (K, V and, for FP8, the scales)."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, FP8KVLayer):
            total += layer.nbytes
        elif getattr(layer, "keys", None) is not None:
            total += layer.keys.nbytes + layer.values.nbytes
    return total
