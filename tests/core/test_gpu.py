"""CUDA: the SwiftKV forward in bf16 on the GPU agrees with fp32 on the CPU (skipped without a GPU)."""

import pytest
import torch

from swiftkv_core.convert import convert
from tests.conftest import tiny_base


@pytest.mark.gpu
@torch.no_grad()
def test_swiftkv_on_cuda_bf16_matches_cpu():
    model = convert(tiny_base("llama"), 2, 2)
    ids = torch.randint(0, 128, (2, 64))
    expected = model(ids, use_cache=True, logits_to_keep=1).logits
    gpu = model.to("cuda", torch.bfloat16)
    got = gpu(ids.cuda(), use_cache=True, logits_to_keep=1).logits.float().cpu()
    torch.testing.assert_close(got, expected, atol=0.1, rtol=0.05)
    out = gpu.generate(ids.cuda(), max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 68)
