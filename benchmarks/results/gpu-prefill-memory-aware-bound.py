"""The memory-aware bound of prefill rows that ``benchmarks/gpu.py`` recorded before it computed that bound itself
(2026-11-26): the on side's FLOPs at the rate the off side ran its prompt at (its time less its LM head's weight
read), its few-row phases no faster than reading their weights at the device's bandwidth
(``swiftkv_core.flops.memory_aware_bound``), as ``gpu.py`` now does.

    .venv/bin/python benchmarks/results/gpu-prefill-memory-aware-bound.py 3.35 \
        benchmarks/results/gpu-h100-llama-3.1-8b-prefill.json benchmarks/results/gpu-h100-llama-3.1-8b-prefill-2k.json
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from swiftkv_core.flops import ModelShape, memory_aware_bound
from swiftkv_core.shapes import SHAPES

tbps, *paths = sys.argv[1:]
for path in paths:
    r = json.loads(Path(path).read_text())
    # the run's shape (its depth may differ: --num_hidden_layers); bf16 weights, as every GPU run so far
    shape = ModelShape.from_config(
        SimpleNamespace(**{**SHAPES[r["shape"]], "num_hidden_layers": r["num_hidden_layers"]})
    )
    print(f"{path} ({r['device']}, {tbps} TB/s)\n")
    print(
        "| prompt | forward | speed-up | FLOPs bound | of it | memory-aware bound | of it |\n|---|---|---|---|---|---|---|"
    )
    for p in r["prefill"]:
        batch, length = map(int, p["prompt"].split(" x ")) if " x " in p["prompt"] else (1, int(p["prompt"]))
        bound = memory_aware_bound(shape, length, r["num_key_value_layers"], off_seconds=p["off_s"],
                                   bandwidth=float(tbps) * 1e12, batch_size=batch)  # fmt: skip
        print(
            f"| {p['prompt']} | {p.get('forward', 'eager')} | {p['speedup_x']:.2f}x | {p['flops_bound_x']:.2f}x | "
            f"{p['speedup_x'] / p['flops_bound_x']:.0%} | {bound:.2f}x | {p['speedup_x'] / bound:.0%} |"
        )
    print()
