"""The bytes a distillation checkpoint holds: measured on disk for the default model's real FSDP2 run, and counted
for the GPU recipes' models from their shapes, the count checked against the measured checkpoint.

The measured run is the real job (``apps/distill.py``, Lightning's ModelParallelStrategy over gloo, ``fabric run``
with 2 processes) on the default model with the GPU recipes' dtypes (trained weights fp32, frozen ones bf16): one
step, then its checkpoint (a folder of shards) written by the recipes' ``ModelCheckpoint``. Counted: each trained
weight with AdamW's two moments in its dtype (three copies), each frozen one in its dtype; a checkpoint of the trained
weights holds the first, one of every weight both.

    .venv/bin/python benchmarks/checkpoint_size.py
    .venv/bin/python benchmarks/checkpoint_size.py --label "before: abc1234" --out benchmarks/results/x-before.json

Writes benchmarks/results/checkpoint-size.{json,md} (or ``--out``).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from jsonargparse import auto_cli

from swiftkv_core.default_model import default_model_path
from swiftkv_core.runtime import DTYPES
from swiftkv_core.shapes import shape_config
from swiftkv_distill.build import build_swiftkv_model
from swiftkv_distill.step import is_trained_name

ROOT = Path(__file__).parents[1]
RESULTS = Path(__file__).parent / "results"
RECIPES = ROOT / "configs" / "distill"
GPU_RECIPES = {  # recipe: the shape of its model
    "llama-3.1-8b-instruct": "llama-3.1-8b",
    "qwen2.5-7b-instruct": "qwen2.5-7b",
    "llama-3.1-70b-instruct": "llama-3.1-70b",
}
GIB = 1024**3


def counted(model: Path, l: int, model_dtype: str, frozen_dtype: str) -> dict:
    """The weights of ``model`` (a folder with its config.json) distilled at ``l``, counted on the meta device, and
    the bytes of a checkpoint of the trained weights and of one of every weight."""
    with torch.device("meta"):
        built = build_swiftkv_model(str(model), l, weights=False)
    # the state dict's entries, as a checkpoint holds them: a tied LM head (SmolLM2's) is an entry of its own
    state = built.state_dict()
    trained = sum(value.numel() for name, value in state.items() if is_trained_name(name))
    frozen = sum(value.numel() for name, value in state.items() if not is_trained_name(name))
    trained_bytes = 3 * trained * DTYPES[model_dtype].itemsize
    return {"trained_params": trained, "frozen_params": frozen, "trained_only_bytes": trained_bytes,
            "every_weight_bytes": trained_bytes + frozen * DTYPES[frozen_dtype].itemsize}  # fmt: skip


def shape_folder(shape: str, work: Path) -> Path:
    """A folder holding only the config.json of a model of ``shape`` (``swiftkv_core.shapes.SHAPES``)."""
    shape_config(shape).save_pretrained(work / shape)
    return work / shape


def measured(work: Path, processes: int, l: int) -> int:
    """The bytes on disk of the checkpoint a real ``processes``-process FSDP2 run of the default model writes after
    its first step, with the GPU recipes' dtypes."""
    out = work / "run"
    strategy = {"data_parallel_size": processes, "tensor_parallel_size": 1}
    checkpoint = {"dirpath": str(out / "checkpoints"), "every_n_train_steps": 1, "save_top_k": -1}
    config = {
        "trainer": {
            "accelerator": "cpu", "precision": "bf16-mixed", "max_steps": 1, "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False, "logger": False, "use_distributed_sampler": False,
            "default_root_dir": str(out),
            "strategy": {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy", "init_args": strategy},
            "callbacks": [{"class_path": "swiftkv_distill.checkpointing.ModelCheckpoint", "init_args": checkpoint}],
        },
        "model": {"model": "default", "num_key_value_layers": l, "model_dtype": "float32",
                  "frozen_dtype": "bfloat16", "kv_init": "published", "evaluate_before_training": False},
        "data": {"train_files": ["dataset:brown_train"], "max_length": 128, "batch_size": 2, "max_train_rows": 8},
    }  # fmt: skip
    path = work / "run.json"
    path.write_text(json.dumps(config))
    fabric = shutil.which("fabric", path=str(Path(sys.executable).parent))
    command = [fabric, "run", "--accelerator", "cpu", "--devices", str(processes),
               str(ROOT / "apps" / "distill.py"), "--config", str(path)]  # fmt: skip
    print(" ".join(command), flush=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    subprocess.run(command, check=True, env=env, cwd=work, timeout=1200, stdout=subprocess.DEVNULL)
    (saved,) = (out / "checkpoints").glob("*step=1.ckpt")
    return sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())


def main(
    label: str = "this checkout", processes: int = 2, out: Path = RESULTS / "checkpoint-size.json"
) -> None:
    """Measure the default model's FSDP2 checkpoint, count it and the GPU recipes'; write ``out`` (.json, .md)."""
    rows = []
    with tempfile.TemporaryDirectory() as work:
        disk = measured(Path(work), processes, l=20)
        dtypes = {"model_dtype": "float32", "frozen_dtype": "bfloat16"}
        smollm2 = counted(default_model_path(), 20, *dtypes.values())
        rows.append({"model": "SmolLM2-135M (default)", "l": 20, **dtypes, **smollm2, "on_disk_bytes": disk})
        for recipe, shape in GPU_RECIPES.items():
            model = yaml.safe_load((RECIPES / f"{recipe}.yaml").read_text())["model"]
            l, dtypes = model["num_key_value_layers"], {k: model[k] for k in ("model_dtype", "frozen_dtype")}
            count = counted(shape_folder(shape, Path(work)), l, *dtypes.values())
            rows.append({"model": f"{shape} ({recipe}.yaml)", "l": l, **dtypes, **count})
    command = shlex.join(["python", "benchmarks/checkpoint_size.py", *sys.argv[1:]])
    out.write_text(json.dumps({"label": label, "command": command, "rows": rows}, indent=1) + "\n")
    lines = [
        f"# Distillation checkpoint bytes ({label})",
        "",
        f"Command: `{command}`. On disk: the checkpoint (a folder of shards and Lightning's meta.pt) of a real run of",
        f"the default model over {processes} processes with FSDP2, after its first step. Counted from each model's",
        "shape: a checkpoint of the trained weights (each with AdamW's two moments, in model_dtype) and one of every",
        "weight (the frozen ones too, in frozen_dtype). Params: the state dict's entries (SmolLM2's tied LM head is",
        "one of its own, as in a checkpoint of every weight). GiB = 2^30 bytes.",
        "",
        "| model | l | dtypes (trained / frozen) | trained params | frozen params | counted, trained weights (GiB) "
        "| counted, every weight (GiB) | every / trained | on disk (GiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        disk = f"{r['on_disk_bytes'] / GIB:.3f}" if "on_disk_bytes" in r else "-"
        lines.append(
            f"| {r['model']} | {r['l']} | {r['model_dtype']} / {r['frozen_dtype']} | {r['trained_params'] / 1e9:.3f}B "
            f"| {r['frozen_params'] / 1e9:.3f}B | {r['trained_only_bytes'] / GIB:.3f} | "
            f"{r['every_weight_bytes'] / GIB:.3f} | {r['every_weight_bytes'] / r['trained_only_bytes']:.2f} | {disk} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    auto_cli(main)
