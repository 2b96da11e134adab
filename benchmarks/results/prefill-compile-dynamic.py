"""Compiling the prefill once for every prompt length (dynamic shapes) against once per length (as the main job's
``compile_prefill`` does, dynamic=False): the default model's shape, random weights, l = 20. On the CPU (fp32,
inductor's default mode: no CUDA graphs there) at 256, 512 and 1024 tokens; on a GPU (bf16, ``reduce-overhead``:
a CUDA graph per shape and side, as the main job) at 512 and 2048. Results: quickstart-gpu-h100/README.md,
"One compile for every length?".

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) .venv/bin/python benchmarks/results/prefill-compile-dynamic.py static
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) .venv/bin/python benchmarks/results/prefill-compile-dynamic.py dynamic
    bash scripts/gpu-lease.sh run prefill-dynamic      # both kinds on a lent GPU ("cuda" as the second argument)
"""

import sys
import time

import torch
from torch._dynamo.utils import counters

from swiftkv_core.generation import check_compiled_prefill, time_prefill_off_on
from swiftkv_core.shapes import random_swiftkv_model


def median_ms(times: list[float]) -> float:
    return 1e3 * sorted(times)[len(times) // 2]


kind, device = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu"
gpu = device == "cuda"
model, _ = random_swiftkv_model(
    "smollm2-135m", 20, device=device, dtype=torch.bfloat16 if gpu else torch.float32
)
torch._dynamo.config.recompile_limit = 64
mode, warmup = ("reduce-overhead", 3) if gpu else ("default", 1)
forward = torch.compile(model, mode=mode, dynamic=kind == "dynamic", fullgraph=True)
for length in (512, 2048) if gpu else (256, 512, 1024):
    ids = torch.randint(0, 1000, (1, length), device=device)
    start, graphs = time.perf_counter(), counters["stats"]["unique_graphs"]
    error = check_compiled_prefill(model, forward, ids)  # compiles (both sides) where this shape needs it
    compile_s, graphs = time.perf_counter() - start, counters["stats"]["unique_graphs"] - graphs
    compiled = time_prefill_off_on(model, ids, repeats=3, warmup=warmup, forward=forward)
    eager = time_prefill_off_on(model, ids, repeats=3, warmup=1)
    print(
        f"{kind} {length} tokens ({device}): check (and compile) {compile_s:.1f} s, {graphs} new graphs, error "
        f"{error:.1e}; compiled off/on {median_ms(compiled[False]):.1f}/{median_ms(compiled[True]):.1f} ms, "
        f"eager off/on {median_ms(eager[False]):.1f}/{median_ms(eager[True]):.1f} ms",
        flush=True,
    )
