"""The tensor memory one decode step takes beside the KV cache, bf16 cache vs FP8 cache, at the Llama-3.1-8B widths
(8 layers, l = 4, random bf16 weights) after a 2048-token prompt, on the CPU: ``PeakMemory`` counts every storage
the step creates (the cache's new tensors, which replace the old, and the transients), as CUDA's allocator would
without its rounding. The FP8 cache dequantises each layer's whole cache at every step.

    .venv/bin/python benchmarks/results/fp8-cache-decode-peak.py
"""

import torch

from swiftkv_core.kv_cache import kv_cache_nbytes, make_kv_cache
from swiftkv_core.runtime import PeakMemory
from swiftkv_core.shapes import random_swiftkv_model

model, l = random_swiftkv_model("llama-3.1-8b", 4, "cpu", torch.bfloat16, 1, 8)
ids = torch.randint(100, 1000, (1, 2048), generator=torch.Generator().manual_seed(0))
print(
    "| SwiftKV | cache | cache held (MiB) | decode step: created beside the new cache (MiB) |\n|---|---|---|---|"
)
with torch.inference_mode():
    for on in (False, True):
        model.swiftkv(on)
        for kv_cache_dtype in ("auto", "fp8"):
            cache = make_kv_cache(model.config, kv_cache_dtype)
            token = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
            with PeakMemory("cpu") as meter:
                model(token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            held = kv_cache_nbytes(cache)
            name = "bf16" if kv_cache_dtype == "auto" else "fp8"
            print(
                f"| {'on' if on else 'off'} | {name} | {held / 2**20:.1f} | {(meter.peak_bytes - held) / 2**20:.1f} |"
            )
