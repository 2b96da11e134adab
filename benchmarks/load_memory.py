"""Peak memory and time of loading SmolLM2-135M-Instruct as a SwiftKV checkpoint vs as the stock Llama.

Each load runs in a fresh process (peak RSS is per process): ``from_pretrained`` of the stock checkpoint, of a
full SwiftKV checkpoint (teacher q/k/v kept) and of a serving export, and building each model from its config on
the CPU (what ``from_pretrained`` avoids with the meta device, and what a model built twice would pay twice).

    .venv/bin/python benchmarks/load_memory.py        # writes benchmarks/results/load-memory.{json,md}

``--compare_src DIR`` also loads with another checkout's ``swiftkv_core`` (its ``packages/swiftkv-core/src``), in
the same run, e.g. the code before a change: ``git worktree add /tmp/before <commit>``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from jsonargparse import auto_cli

RESULTS = Path(__file__).parent / "results"

_PROBE = """
import json, resource, sys, time
import torch
from transformers import AutoConfig, AutoModelForCausalLM
import swiftkv_core
path, how = sys.argv[1], sys.argv[2]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
if how == "from_pretrained":
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
else:
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weights = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
print(json.dumps({"seconds": seconds, "peak_mib": peak / 1024, "added_mib": (peak - before) / 1024,
                  "weights_mib": weights}))
"""


def probe(path: Path, how: str, core_src: Path | None = None) -> dict:
    """One load in a fresh process (with ``core_src``'s swiftkv_core first on the path, when given)."""
    env = {**os.environ, "PYTHONPATH": str(core_src)} if core_src else None
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(path), how], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _describe(core_src: Path) -> str:
    """The commit of the checkout ``core_src`` belongs to (its folder name if it is not a git checkout)."""
    out = subprocess.run(
        ["git", "-C", str(core_src), "log", "-1", "--format=%h"], capture_output=True, text=True
    )
    return f"commit {out.stdout.strip()}" if out.returncode == 0 else core_src.name


def main(
    num_key_value_layers: int = 15, repeats: int = 3, compare_src: Path | None = None, out_dir: Path = RESULTS
) -> dict:
    """Measure in fresh processes; print and write JSON and Markdown to ``out_dir``.

    Args:
        num_key_value_layers: l of the SwiftKV checkpoints.
        repeats: Processes per case; the median of each figure is reported.
        compare_src: Another checkout's swiftkv_core source folder to measure beside this one.
        out_dir: Where to write load-memory.json and load-memory.md.
    """
    from swiftkv_core.convert import convert, export_for_serving, save_checkpoint
    from swiftkv_core.default_model import resolve_model_path

    stock = resolve_model_path("default")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        full, serving = Path(tmp) / "full", Path(tmp) / "serving"
        model = convert(stock, num_key_value_layers)
        save_checkpoint(model, full)
        export_for_serving(model, serving)
        del model
        codes = [("this checkout", None)] + ([(_describe(compare_src), compare_src)] if compare_src else [])
        cases = [("stock Llama", stock), ("SwiftKV full", full), ("SwiftKV serving", serving)]
        for (code, src), (name, path), how in itertools.product(
            codes, cases, ("from_pretrained", "from_config")
        ):
            if name == "stock Llama" and src is not None:
                continue  # the stock model does not depend on swiftkv_core
            runs = [probe(path, how, src) for _ in range(repeats)]
            median = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}
            rows.append({"code": code, "checkpoint": name, "how": how, **median})
            print(
                f"{code[-24:]:<24} {name:<16} {how:<16} peak {median['peak_mib']:7.0f} MiB (+{median['added_mib']:5.0f} over "
                f"the import), weights {median['weights_mib']:5.0f} MiB, {median['seconds']:.2f} s",
                flush=True,
            )
    command = (
        f"python benchmarks/load_memory.py --num_key_value_layers {num_key_value_layers} --repeats {repeats}"
    )
    if compare_src:
        command += " --compare_src CHECKOUT/packages/swiftkv-core/src"
    result = {"command": command, "num_key_value_layers": num_key_value_layers, "rows": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "load-memory.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Loading SmolLM2-135M-Instruct: stock vs SwiftKV checkpoints (peak RSS per fresh process)",
        "",
        f"Command: `{command}` (median of {repeats} processes each).",
        "",
        "`from_pretrained` builds the model on the meta device and maps the safetensors file, so its peak is that of "
        "the imports either way; `from_config` builds every module on the CPU, as `Model(config)` does: a model "
        "that builds its stock layers and then replaces them pays for both.",
        "",
        "| swiftkv_core | checkpoint | how | peak RSS (MiB) | added over the imports (MiB) | weights (MiB) | seconds |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['code']} | {r['checkpoint']} | {r['how']} | {r['peak_mib']:.0f} | {r['added_mib']:.0f} | "
            f"{r['weights_mib']:.0f} | {r['seconds']:.2f} |"
            for r in rows
        ),
    ]
    (out_dir / "load-memory.md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    auto_cli(main, as_positional=False)
