"""The analytic FLOPs / KV-memory model: the paper's Table 1, and agreement with a measured FLOP count."""

import pytest
import torch

from swiftkv_core.convert import convert
from swiftkv_core.flops import (
    LLAMA_3_1_70B,
    PAPER_TABLE1_GFLOPS,
    PAPER_TABLE1_RELATIVE,
    ModelShape,
    count_flops,
    kv_cache_bytes_per_token,
    prefill_flops,
    prefill_flops_total,
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
@pytest.mark.parametrize(("l", "g", "seq_len"), [(None, 1, 32), (2, 1, 32), (1, 3, 17), (2, 2, 64)])
def test_measured_prefill_flops_match_the_model(l, g, seq_len):
    base = tiny_base("llama")
    model = base if l is None else convert(tiny_base("llama"), l, g)
    ids = torch.randint(0, 128, (2, seq_len))
    measured, _ = count_flops(model, ids, use_cache=True, logits_to_keep=1)
    expected = prefill_flops_total(
        ModelShape.from_config(model.config), seq_len, l, g, logits_to_keep=1, attention="dense", batch_size=2
    )
    assert measured == pytest.approx(expected, rel=1e-9)


def test_swiftkv_halves_prefill_flops_at_half_the_layers():
    shape = ModelShape.from_config(tiny_base("llama").config)
    ratio = prefill_flops(shape, 2048, 2).total / prefill_flops(shape, 2048).total
    assert 0.5 < ratio < 0.6
