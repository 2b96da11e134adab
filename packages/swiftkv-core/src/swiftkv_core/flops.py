"""Analytic prefill FLOPs and KV-cache memory of a (SwiftKV) decoder, per prefill token, and a roofline lower bound
on a prefill's time (its FLOPs at a peak rate, its few-row phases no faster than reading their weights).

Conventions (every figure counts matrix multiplications only, 2 FLOPs per multiply-add, as the paper and
torch's FlopCounterMode do; norms, RoPE, activations and softmax are left out):

* projection rows (``q``, ``o``, ``k``, ``v``, ``mlp``, ``vocab``) are ``2 * in * out`` per token and layer;
  ``vocab`` is the LM head (``2 * hidden * vocab_size``). The paper's 4.3 GFLOPs equals ``4 * hidden * 128Ki``:
  it also counts the embedding lookup as a one-hot matmul, which computes nothing and which FlopCounterMode
  does not see; we leave it out.
* ``attention`` is QK^T plus AV: ``2 * 2 * num_heads * head_dim * keys`` per query and layer, where ``keys`` is
  the number of keys each query multiplies. ``attention="causal"`` (the default, and every bound's) counts only
  the keys a causal query sees, averaged over a prefill of ``seq_len`` tokens (``(seq_len + 1) / 2``): what the
  flash and SDPA kernels compute, on a GPU and a CPU, skipping the blocks the mask hides. ``attention="dense"``
  counts all ``seq_len`` keys: what FlopCounterMode reports, which the tests check the counts against.
  (The paper's Table 1 lists 160 GFLOPs of attention for Llama-3.1-70B at 128K context; the causal convention
  gives 172, the paper's figure is not reproducible from its stated sizes, and the relative column agrees
  either way.)
* SwiftKV: layers ``>= l`` compute only K and V for prompt tokens, once per AcrossKV group.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

from .configuration import num_kv_cache_layers

ROWS = ("vocab", "q", "o", "k", "v", "mlp", "attention")


@dataclass(frozen=True)
class ModelShape:
    """The sizes the FLOPs model needs; ``from_config`` reads them from any Llama/Qwen2-style HF config."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_config(cls, config) -> ModelShape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            config.num_hidden_layers,
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads or config.num_attention_heads,
            head_dim,
            config.intermediate_size,
            config.vocab_size,
        )


@dataclass
class PrefillFlops:
    """FLOPs per prefill token, by row; ``total`` sums the rows."""

    vocab: float
    q: float
    o: float
    k: float
    v: float
    mlp: float
    attention: float
    total: float = field(init=False)

    def __post_init__(self):
        self.total = sum(getattr(self, row) for row in ROWS)

    def as_dict(self, scale: float = 1.0) -> dict[str, float]:
        return {k: v / scale for k, v in asdict(self).items()}


def _keys_per_query(seq_len: int, attention: str) -> float:
    if attention == "causal":
        return (seq_len + 1) / 2
    if attention == "dense":
        return float(seq_len)
    raise ValueError(
        f"attention={attention!r}: use 'causal' (keys a causal query sees) or 'dense' (all keys)."
    )


def prefill_flops(
    shape: ModelShape,
    seq_len: int,
    num_key_value_layers: int | None = None,
    key_value_group_size: int = 1,
    attention: str = "causal",
) -> PrefillFlops:
    """FLOPs per prompt token of a prefill of ``seq_len`` tokens (the paper's Table 1 rows).

    ``num_key_value_layers=None`` is the original model. Every token is counted as needing logits (as Table 1
    does); see ``prefill_flops_total`` for an exact count of one prefill that keeps only the last logits.
    """
    L = shape.num_hidden_layers
    l = L if num_key_value_layers is None else num_key_value_layers
    full_layers = l  # layers that run query, attention, output and MLP for every prompt token
    kv_layers = num_kv_cache_layers(L, l, key_value_group_size)
    h, q_dim, kv_dim = (
        shape.hidden_size,
        shape.num_attention_heads * shape.head_dim,
        shape.num_key_value_heads * shape.head_dim,
    )
    return PrefillFlops(
        vocab=2 * h * shape.vocab_size,
        q=2 * h * q_dim * full_layers,
        o=2 * q_dim * h * full_layers,
        k=2 * h * kv_dim * kv_layers,
        v=2 * h * kv_dim * kv_layers,
        mlp=3 * 2 * h * shape.intermediate_size * full_layers,
        attention=2 * 2 * q_dim * _keys_per_query(seq_len, attention) * full_layers,
    )


def prefill_flops_total(
    shape: ModelShape,
    seq_len: int,
    num_key_value_layers: int | None = None,
    key_value_group_size: int = 1,
    logits_to_keep: int = 1,
    attention: str = "causal",
    batch_size: int = 1,
) -> float:
    """Exact FLOPs of one prefill forward that returns the last ``logits_to_keep`` logits (as ``generate``).

    Under SwiftKV the kept positions also run layers ``>= l`` (the last queries: each over all ``seq_len`` keys,
    dense; over the keys it sees, causal). With ``attention="dense"`` this is what FlopCounterMode measures on an
    SDPA forward; the default, ``"causal"``, is what the kernels compute.
    """
    return sum(
        prefill_flops_phases(
            shape, seq_len, num_key_value_layers, key_value_group_size, logits_to_keep, attention, batch_size
        ).values()
    )


def prefill_flops_phases(
    shape: ModelShape,
    seq_len: int,
    num_key_value_layers: int | None = None,
    key_value_group_size: int = 1,
    logits_to_keep: int = 1,
    attention: str = "causal",
    batch_size: int = 1,
) -> dict[str, float]:
    """``prefill_flops_total`` by phase: ``prompt`` (every prompt token through the layers it runs: all of them, or
    under SwiftKV the layers ``< l`` and the K/V of the later ones), ``kept`` (the kept positions through layers
    ``>= l``; none for the original model) and ``head`` (the LM head of the kept positions)."""
    L = shape.num_hidden_layers
    l = L if num_key_value_layers is None else num_key_value_layers
    per_token_all = prefill_flops(shape, seq_len, l, key_value_group_size, attention)  # prompt tokens
    kept = seq_len if logits_to_keep <= 0 else min(logits_to_keep, seq_len)  # 0: every position, as the model
    phases = {
        "prompt": (per_token_all.total - per_token_all.vocab) * seq_len,
        "kept": 0.0,
        "head": per_token_all.vocab * kept,
    }
    if l < L:  # the kept positions through layers >= l
        rest = prefill_flops(shape, seq_len, None, 1, attention)
        per_layer = (rest.q + rest.o + rest.mlp + rest.attention) / L
        # causal: the kept queries are the last ones, seeing seq_len - (kept - 1) / 2 keys on average
        if attention == "causal":
            keys = seq_len - (kept - 1) / 2
            per_layer += 2 * 2 * shape.num_attention_heads * shape.head_dim * (keys - (seq_len + 1) / 2)
        phases["kept"] = per_layer * (L - l) * kept
    return {phase: flops * batch_size for phase, flops in phases.items()}


def prefill_roofline_seconds(
    shape: ModelShape,
    seq_len: int,
    num_key_value_layers: int | None = None,
    key_value_group_size: int = 1,
    *,
    peak_flops: float,
    bandwidth: float,
    element_bytes: int = 2,
    attention: str = "causal",
    batch_size: int = 1,
    logits_to_keep: int = 1,
) -> float:
    """A lower bound on one prefill's seconds on a device of ``peak_flops`` (FLOP/s) and memory ``bandwidth``
    (bytes/s): each phase of ``prefill_flops_phases`` takes at least its FLOPs at the peak, and at least the time
    to read the weights it multiplies by (``element_bytes`` each) and the K/V the kept rows attend to.

    The prompt phase is bound by its FLOPs at any real prompt length. The other two run a few rows: the LM head
    (on both sides) and, under SwiftKV, layers ``>= l`` are bound by reading their weights. So a short prompt
    cannot reach the FLOPs bound: its kept rows read the query, output and MLP weights of every layer ``>= l``."""
    L = shape.num_hidden_layers
    l = L if num_key_value_layers is None else num_key_value_layers
    flops = prefill_flops_phases(
        shape, seq_len, l, key_value_group_size, logits_to_keep, attention, batch_size
    )
    # a projection row's FLOPs per token are twice its weights (this module's convention)
    swiftkv, whole = prefill_flops(shape, seq_len, l, key_value_group_size), prefill_flops(shape, seq_len)
    weights = {
        "prompt": (swiftkv.q + swiftkv.o + swiftkv.k + swiftkv.v + swiftkv.mlp) / 2,
        "kept": (whole.q + whole.o + whole.mlp) / 2 * (L - l) / L,
        "head": swiftkv.vocab / 2,
    }
    read = {phase: n * element_bytes for phase, n in weights.items()}
    if l < L:  # each row's kept positions read that row's K/V of the layers >= l
        later_kv = num_kv_cache_layers(L, l, key_value_group_size) - l
        kv_dim = shape.num_key_value_heads * shape.head_dim
        read["kept"] += batch_size * later_kv * seq_len * 2 * kv_dim * element_bytes
    return sum(max(flops[phase] / peak_flops, read[phase] / bandwidth) for phase in flops)


def memory_aware_bound(
    shape: ModelShape,
    seq_len: int,
    num_key_value_layers: int,
    key_value_group_size: int = 1,
    *,
    off_seconds: float,
    bandwidth: float,
    element_bytes: int = 2,
    batch_size: int = 1,
) -> float:
    """The most a SwiftKV prefill can gain over an original one measured at ``off_seconds``: the FLOP rate at which
    ``prefill_roofline_seconds`` gives the original model ``off_seconds`` (its LM head read at ``bandwidth``, the
    rest of its time at that rate), then the original's seconds over SwiftKV's roofline at that same rate."""

    def seconds(l: int | None, rate: float) -> float:
        return prefill_roofline_seconds(
            shape, seq_len, l, key_value_group_size, peak_flops=rate, bandwidth=bandwidth,
            element_bytes=element_bytes, batch_size=batch_size,
        )  # fmt: skip

    low, high = 1.0, 1e20  # FLOP/s; the original's roofline seconds fall as the rate grows
    # measured no slower than reading its weights: no FLOP rate explains it
    if seconds(None, high) >= off_seconds:
        return off_seconds / seconds(num_key_value_layers, math.inf)
    if seconds(None, low) <= off_seconds:  # slower than 1 FLOP/s: every phase bound by its FLOPs
        return seconds(None, low) / seconds(num_key_value_layers, low)
    for _ in range(200):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if seconds(None, middle) > off_seconds else (low, middle)
    return off_seconds / seconds(num_key_value_layers, high)


def kv_cache_bytes_per_token(
    shape: ModelShape,
    num_key_value_layers: int | None = None,
    key_value_group_size: int = 1,
    kv_cache_dtype: str = "bf16",
) -> float:
    """K and V bytes one token occupies in the cache, scales included:
    ``2 * (l + (L - l) / g) * kv_heads * (head_dim * element_bytes + scale_bytes)``.

    ``kv_cache_dtype``: ``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"fp8"`` (e4m3 plus one float32 scale per token and
    KV head, as ``kv_cache.FP8KVCache`` stores it); the byte sizes come from the cache's own storage format.
    """
    from .kv_cache import storage_bytes

    element_bytes, scale_bytes = storage_bytes(kv_cache_dtype)
    L = shape.num_hidden_layers
    l = L if num_key_value_layers is None else num_key_value_layers
    kv_layers = num_kv_cache_layers(L, l, key_value_group_size)
    return 2 * kv_layers * shape.num_key_value_heads * (shape.head_dim * element_bytes + scale_bytes)


# The paper's Table 1 (arXiv 2410.03960): Llama-3.1-70B, 128K context, GFLOPs per prefill token.
LLAMA_3_1_70B = ModelShape(
    num_hidden_layers=80,
    hidden_size=8192,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=28672,
    vocab_size=128256,
)
PAPER_TABLE1_GFLOPS = {
    "vocab": 4.3,
    "q": 10.7,
    "o": 10.7,
    "k": 1.34,
    "v": 1.34,
    "mlp": 113,
    "attention": 160,
    "total": 302,
}
PAPER_TABLE1_RELATIVE = {
    "baseline": 1.0,
    "25% SingleInputKV": 0.755,
    "50% SingleInputKV": 0.510,
    "50% SingleInputKV + 4-way AcrossKV": 0.507,
}
PAPER_TABLE1_SETTINGS = {
    "baseline": (80, 1),
    "25% SingleInputKV": (60, 1),
    "50% SingleInputKV": (40, 1),
    "50% SingleInputKV + 4-way AcrossKV": (40, 4),
}


def table1(seq_len: int = 128 * 1024, attention: str = "causal") -> dict:
    """Our model's version of the paper's Table 1: GFLOPs rows of the baseline and the relative column."""
    base = prefill_flops(LLAMA_3_1_70B, seq_len, attention=attention)
    relative = {}
    for name, (l, g) in PAPER_TABLE1_SETTINGS.items():
        relative[name] = prefill_flops(LLAMA_3_1_70B, seq_len, l, g, attention=attention).total / base.total
    return {"gflops": base.as_dict(1e9), "relative": relative, "attention_convention": attention}


def format_table1(result: dict | None = None) -> str:
    result = result or table1()
    lines = [f"{'row':<12}{'ours':>10}{'paper':>10}{'diff':>9}"]
    for row, ours in result["gflops"].items():
        paper = PAPER_TABLE1_GFLOPS[row]
        lines.append(f"{row:<12}{ours:>10.2f}{paper:>10.2f}{(ours / paper - 1) * 100:>8.1f}%")
    lines.append(f"\n{'setting':<38}{'ours':>8}{'paper':>8}")
    for name, ours in result["relative"].items():
        lines.append(f"{name:<38}{ours * 100:>7.1f}%{PAPER_TABLE1_RELATIVE[name] * 100:>7.1f}%")
    lines.append(f"(attention convention: {result['attention_convention']}; see swiftkv_core.flops)")
    return "\n".join(lines)


def _cpu_sdpa_flops(query_shape, key_shape, *args, out_shape=None, **kwargs) -> int:
    """QK^T and AV of ``aten._scaled_dot_product_flash_attention_for_cpu`` (FlopCounterMode has no rule for it)."""
    batch, heads, queries, head_dim = query_shape
    keys = key_shape[-2]
    return 2 * 2 * batch * heads * queries * keys * head_dim


def _causal_bmm_flops(seq_len: int, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """A batched matmul's FLOPs, those of attention over ``seq_len`` tokens (two of its three sizes are
    ``seq_len``: the scores, their use, or their gradients) counted causally: ``(seq_len + 1) / 2`` keys a query."""
    batch, m, k = a_shape
    n = b_shape[-1]
    flops = 2 * batch * m * k * n
    return flops * (seq_len + 1) // (2 * seq_len) if [m, k, n].count(seq_len) >= 2 else flops


def count_flops(fn, *args, causal_len: int | None = None, **kwargs) -> tuple[int, object]:
    """``(matmul FLOPs, result)`` of ``fn(*args, **kwargs)`` under torch's FlopCounterMode, CPU attention included.

    FlopCounterMode counts every key of every query (``attention="dense"``). With ``causal_len``, for a call whose
    every attention is eager (``attn_implementation="eager"``: batched matmuls) and causal over whole sequences of
    that many tokens (a forward or a training step of such rows), attention is counted as the bounds count it
    (``attention="causal"``). Not for a call where fewer queries run than keys (SwiftKV's kept rows of a prefill,
    ``positions`` in training): their attention is still counted dense."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}
    if causal_len is not None:
        mapping[torch.ops.aten.bmm] = functools.partial(_causal_bmm_flops, causal_len)
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        result = fn(*args, **kwargs)
    if causal_len is not None:
        fused = [str(op) for op in counter.get_flop_counts().get("Global", {}) if "attention" in str(op)]
        if fused:
            raise ValueError(
                f"count_flops(causal_len={causal_len}) counts eager attention's batched matmuls, but this call ran "
                f"{', '.join(fused)}, counted over every key: set the model's attn_implementation to 'eager' first."
            )
    return counter.get_total_flops(), result
