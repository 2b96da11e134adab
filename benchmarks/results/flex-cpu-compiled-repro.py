"""torch's compiled flex_attention against its eager one and sdpa, on this CPU, without SwiftKV.

Found 2026-11-27 on an AMD EPYC with AVX2 only (no AVX512), torch 2.13.0+cpu: batch 2, one query row (the last
position), 40 keys, row 0 left-padded by 6. Eager flex matches sdpa (~1e-7); compiled flex is off by 0.018 and 0.61
per row. This is why SwiftKV's flex kept-rows tests (tests/core/test_attention.py) fail on such a CPU.
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
