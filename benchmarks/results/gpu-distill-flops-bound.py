"""The FLOPs bound of the distillation step's speed vs a whole teacher + whole student, for rows ``benchmarks/gpu.py``
recorded before it computed that bound itself (2026-12-06): the whole's model FLOPs over ours (both counted by
torch's FlopCounterMode in the run), as ``swiftkv_distill.bench.vs_whole`` now gives it. Rows whose like-for-like
whole (the same attention, checkpointing and compiling) was not measured get none.

    .venv/bin/python benchmarks/results/gpu-distill-flops-bound.py benchmarks/results/gpu-llama-3.1-8b-distill.json \
        benchmarks/results/gpu-h200-llama-3.1-8b-distill-compiled.json \
        benchmarks/results/gpu-h100-llama-3.1-8b-distill-compiled.json
"""

import json
import sys
from pathlib import Path

from swiftkv_distill.bench import vs_whole

print("| run | setup | speed vs whole | FLOPs bound | of the bound | ours, whole (TFLOP / step) |")
print("|---|---|---|---|---|---|")
for path in sys.argv[1:]:
    run = json.loads(Path(path).read_text())
    for r in vs_whole(run["distill"]):
        if r["setup"].startswith("ours") and r["flops_bound_x"]:
            print(
                f"| {Path(path).stem} ({run['device']}) | {r['setup']} | {r['speed_vs_whole_x']:.2f}x | "
                f"{r['flops_bound_x']:.3f}x | {r['speed_vs_whole_x'] / r['flops_bound_x']:.0%} | {r['step_tflop']:.1f}, "
                f"{r['step_tflop'] * r['flops_bound_x']:.1f} |"
            )
