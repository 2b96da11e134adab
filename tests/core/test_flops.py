"""The analytic FLOPs / KV-memory model: the paper's Table 1, and agreement with a measured FLOP count."""

import math

import pytest
import torch

from swiftkv_core.configuration import num_kv_cache_layers
from swiftkv_core.convert import convert
from swiftkv_core.flops import (
    LLAMA_3_1_70B,
    PAPER_TABLE1_GFLOPS,
    PAPER_TABLE1_RELATIVE,
    ModelShape,
    count_flops,
    kv_cache_bytes_per_token,
    memory_aware_bound,
    prefill_flops,
    prefill_flops_phases,
    prefill_flops_total,
    prefill_roofline_seconds,
    table1,
)
from tests.conftest import tiny_base


def test_reproduces_paper_table1():
    result = table1()
    for row in ("q", "o", "k", "v", "mlp"):  # projections and MLP within 2%
        assert result["gflops"][row] == pytest.approx(PAPER_TABLE1_GFLOPS[row], rel=0.02), row
    for setting, paper in PAPER_TABLE1_RELATIVE.items():  # relative compute within 1 percentage point
        assert abs(result["relative"][setting] - paper) <= 0.01, setting
    assert result["attention_convention"] == "causal"


def test_kv_cache_bytes():
    shape = LLAMA_3_1_70B
    base = kv_cache_bytes_per_token(shape)
    assert base == 2 * 80 * 8 * 128 * 2  # 320 KiB per token in bf16
    assert kv_cache_bytes_per_token(shape, 40, 4) / base == pytest.approx((40 + 10) / 80)


@torch.no_grad()
@pytest.mark.parametrize(
    ("l", "g", "seq_len", "keep"),  # keep 0: every position's logits, as the model reads it
    [(None, 1, 32, 1), (2, 1, 32, 1), (1, 3, 17, 1), (2, 2, 64, 1), (2, 1, 16, 0), (2, 1, 16, 5)],
)
def test_measured_prefill_flops_match_the_model(l, g, seq_len, keep):
    base = tiny_base("llama")
    model = base if l is None else convert(tiny_base("llama"), l, g)
    ids = torch.randint(0, 128, (2, seq_len))
    measured, _ = count_flops(model, ids, use_cache=True, logits_to_keep=keep)
    expected = prefill_flops_total(
        ModelShape.from_config(model.config),
        seq_len,
        l,
        g,
        logits_to_keep=keep,
        attention="dense",
        batch_size=2,
    )
    assert measured == pytest.approx(expected, rel=1e-9)


@torch.no_grad()
@pytest.mark.parametrize(("l", "seq_len"), [(None, 32), (2, 17)])
def test_a_causal_count_of_eager_attention_is_the_bounds_causal_count(l, seq_len):
    """``causal_len`` counts eager attention's keys as the bounds do, ``(seq_len + 1) / 2`` a query; every other
    matmul as before. A fused attention (here the CPU's SDPA) cannot be told apart: refused, with the fix."""
    model = tiny_base("llama") if l is None else convert(tiny_base("llama"), l)
    ids = torch.randint(0, 128, (2, seq_len))
    shape = ModelShape.from_config(model.config)
    model.config._attn_implementation = "eager"
    for attention, causal_len in (("dense", None), ("causal", seq_len)):
        measured, _ = count_flops(model, ids, logits_to_keep=0, causal_len=causal_len)
        expected = prefill_flops_total(shape, seq_len, l, logits_to_keep=0, attention=attention, batch_size=2)
        assert measured == pytest.approx(expected, rel=1e-9), attention
    model.config._attn_implementation = "sdpa"
    with pytest.raises(
        ValueError, match=r"ran aten\._scaled_dot_product.*set the model's attn_implementation to 'eager'"
    ):
        count_flops(model, ids, causal_len=seq_len)


@pytest.mark.parametrize("kept", [1, 5, 16])
def test_the_kept_rows_see_the_keys_a_causal_query_does(kept):
    """Under SwiftKV the last ``kept`` positions run layers >= l: causal, the i-th of a prompt sees i keys."""
    shape, seq_len, l = ModelShape.from_config(tiny_base("llama").config), 16, 2
    dense, causal = (
        prefill_flops_phases(shape, seq_len, l, logits_to_keep=kept, attention=attention)["kept"]
        for attention in ("dense", "causal")
    )
    keys = sum(range(seq_len - kept + 1, seq_len + 1))
    per_key = 2 * 2 * shape.num_attention_heads * shape.head_dim * (shape.num_hidden_layers - l)
    assert dense - causal == pytest.approx(per_key * (kept * seq_len - keys))


def test_swiftkv_halves_prefill_flops_at_half_the_layers():
    shape = ModelShape.from_config(tiny_base("llama").config)
    ratio = prefill_flops(shape, 2048, 2).total / prefill_flops(shape, 2048).total
    assert 0.5 < ratio < 0.6


LLAMA_3_1_8B = ModelShape(32, 4096, 32, 8, 128, 14336, 128256)


@pytest.mark.parametrize(("l", "g"), [(None, 1), (2, 1), (2, 2), (1, 3)])
def test_the_roofline_reads_the_weights_a_prefill_multiplies_by(l, g):
    """At an unbounded FLOP rate and one byte a second, a prefill's roofline seconds are the bytes it reads: every
    weight its forward multiplies by, counted from the model itself (SwiftKV's layers >= l use their own query and
    their group's K/V, never the original q/k/v), and the K/V that the kept row attends to."""
    model = tiny_base("llama") if l is None else convert(tiny_base("llama"), l, g)
    shape, seq_len = ModelShape.from_config(model.config), 16

    def multiplied_by(name: str) -> bool:
        if l is None or int(name.split(".")[0]) < l:
            return "swiftkv" not in name
        return not any(f"{p}_proj." in name for p in "qkv")

    weights = sum(
        p.numel() for n, p in model.model.layers.named_parameters() if p.ndim == 2 and multiplied_by(n)
    )
    weights += model.lm_head.weight.numel()
    later_kv = 0 if l is None else num_kv_cache_layers(shape.num_hidden_layers, l, g) - l
    kv = later_kv * seq_len * 2 * shape.num_key_value_heads * shape.head_dim
    seconds = prefill_roofline_seconds(
        shape, seq_len, l, g, peak_flops=math.inf, bandwidth=1.0, element_bytes=4
    )
    assert seconds == 4 * (weights + kv)
    phases = prefill_flops_phases(shape, seq_len, l, g)
    assert sum(phases.values()) == prefill_flops_total(shape, seq_len, l, g)
    assert (phases["kept"] > 0) == (l is not None)


def test_the_roofline_bound_is_the_flops_bound_less_the_kept_rows_weight_reads():
    """Off over on: the FLOPs bound at an unbounded bandwidth; at an H100's, a 2k prompt falls well short of it (its
    kept row reads the 16 later layers' query, output and MLP weights, 6.7 GB), a 32k prompt or a batch nearly not."""

    def bound(bandwidth: float, seq_len: int = 2048, batch_size: int = 1) -> float:
        off, on = (prefill_roofline_seconds(LLAMA_3_1_8B, seq_len, l, peak_flops=989e12, bandwidth=bandwidth,
                                            batch_size=batch_size) for l in (None, 16))  # fmt: skip
        return off / on

    def flops_bound(seq_len: int) -> float:
        off, on = (prefill_flops_total(LLAMA_3_1_8B, seq_len, l, attention="causal") for l in (None, 16))
        return off / on

    assert bound(math.inf) == pytest.approx(flops_bound(2048))
    assert bound(3.35e12) < 0.9 * flops_bound(2048)
    assert bound(3.35e12, 32768) > 0.99 * flops_bound(32768)
    assert bound(3.35e12, 2048, 8) > 0.97 * flops_bound(2048)


@pytest.mark.parametrize("seq_len, batch_size", [(2048, 1), (8192, 1), (2048, 8)])
def test_the_memory_aware_bound_recovers_the_rate_an_original_prefill_ran_at(seq_len, batch_size):
    """Given the seconds the roofline gives the original model at some FLOP rate (its LM head read from memory on
    top), the bound finds that rate again: SwiftKV's roofline at it, not at the rate the LM head's read dilutes."""
    rate, bandwidth = 600e12, 3.35e12
    kwargs = dict(bandwidth=bandwidth, batch_size=batch_size)
    off, on = (
        prefill_roofline_seconds(LLAMA_3_1_8B, seq_len, l, peak_flops=rate, **kwargs) for l in (None, 16)
    )
    bound = memory_aware_bound(LLAMA_3_1_8B, seq_len, 16, off_seconds=off, **kwargs)
    assert bound == pytest.approx(off / on, rel=1e-9)
    diluted = prefill_flops_total(LLAMA_3_1_8B, seq_len, attention="causal", batch_size=batch_size) / off
    on_diluted = prefill_roofline_seconds(LLAMA_3_1_8B, seq_len, 16, peak_flops=diluted, **kwargs)
    assert bound > off / on_diluted  # the old estimate, which read the LM head's weights into the rate
    flops = [
        prefill_flops_total(LLAMA_3_1_8B, seq_len, l, attention="causal", batch_size=batch_size)
        for l in (None, 16)
    ]
    assert bound < flops[0] / flops[1]
    # measured faster than its weights can be read: no rate explains it, the bound is the reads' ratio
    floor = memory_aware_bound(LLAMA_3_1_8B, seq_len, 16, off_seconds=1e-6, **kwargs)
    assert floor == pytest.approx(
        1e-6 / prefill_roofline_seconds(LLAMA_3_1_8B, seq_len, 16, peak_flops=math.inf, **kwargs)
    )
