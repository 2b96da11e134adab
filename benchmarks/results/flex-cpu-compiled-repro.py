"""torch's compiled flex_attention against its eager one and sdpa, on this CPU, without SwiftKV.

Found 2026-11-27 on an AMD EPYC with AVX2 only (no AVX512), torch 2.13.0+cpu: batch 2, one query row (the last
position), 40 keys, row 0 left-padded by 6. Eager flex matches sdpa (~1e-7); compiled flex is off by 0.018 and 0.61
per row. This is why SwiftKV's flex kept-rows tests (tests/core/test_attention.py) failed on such a CPU with their
tiny model's head_dim 16.

Where it is wrong (same CPU, 2026-11-27; batch 2, 4 heads, one query row unless said, no padding, each shape compiled
afresh after torch._dynamo.reset(); max |compiled - sdpa| per batch row; eager flex within 6e-7 of sdpa in all):
- head_dim 16: wrong at 24, 40, 56 and 72 keys (0.04 to 1.2), and at 40 queries x 40 keys (1.8); right at 16, 33,
  41, 48, 64, 80, 136 and 200 keys;
- head_dim 8: wrong at 40 keys (0.5);
- head_dim 32 and 64: right at 24, 40, 56, 72 and 136 keys; head_dim 128: right at 12 to 264 keys (batch 1, 2 heads);
- batch 1 with 1 head, head_dim 16, 40 keys: right.
The same head_dim-16 tests passed on earlier sessions' CPUs with AVX-512. SwiftKV refuses flex_attention on a CPU
below head_dim 32 where torch reports AVX2 (swiftkv_core.runtime.check_flex_attention), and its tests' flex models
use head_dim 32 (tests/conftest.py FLEX_HEADS).
Run: .venv/bin/python benchmarks/results/flex-cpu-compiled-repro.py
"""

import platform

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

torch.manual_seed(0)
B, H, D, Q, K = 2, 4, 16, 1, 40
q, k, v = (torch.randn(B, H, n, D) for n in (Q, K, K))
padding = torch.ones(B, K, dtype=torch.bool)
padding[0, :6] = False
rows = torch.tensor([K - 1])  # the one query row is the last position
mask = create_block_mask(lambda b, h, qi, ki: (ki <= rows[qi]) & padding[b, ki], B, None, Q, K, device="cpu")
reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=padding[:, None, None, :])
print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
      f"CPU capability: {torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
for name, attend in (("eager flex", flex_attention), ("compiled flex", torch.compile(flex_attention))):
    out = attend(q, k, v, block_mask=mask)
    print(
        f"{name}: max |diff| to sdpa per batch row {(out - reference).abs().flatten(1).max(1).values.tolist()}"
    )
