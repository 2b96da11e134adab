"""Host memory of each process of a distillation run sharded with FSDP2, once its model is built: against one
unsharded process of the same run (the baseline, measured in the same invocation).

Each run is the real job (``apps/distill.py``, Lightning's ModelParallelStrategy over gloo, ``fabric run`` with
``--devices N`` processes) on the default model, stopped before its first step. A callback records, in every
process, its peak RSS since it started and what it holds then: anonymous memory (its own copies) and file-mapped
pages (the libraries, checkpoint files mapped by safetensors: shared between the processes of a machine).

    .venv/bin/python benchmarks/fsdp2_load.py                     # 2 processes, fp32 and bf16 weights
    .venv/bin/python benchmarks/fsdp2_load.py --label "commit abc1234" --out benchmarks/results/fsdp2-load-before.json

Writes benchmarks/results/fsdp2-load.{json,md} (or ``--out``).
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as L
from jsonargparse import auto_cli

ROOT = Path(__file__).parents[1]
RESULTS = Path(__file__).parent / "results"


class HostMemory(L.Callback):
    """Writes this process's host memory to ``{dirpath}/rank{rank}.json`` when training starts (the model built,
    sharded and on its device; no step taken), then stops the run."""

    def __init__(self, dirpath: str):
        self.dirpath = Path(dirpath)

    def on_train_start(self, trainer, pl_module) -> None:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        mib = {key: int(status[key].split()[0]) / 1024 for key in ("VmRSS", "RssAnon", "RssFile")}
        record = {
            "rank": trainer.global_rank,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_mib": mib["VmRSS"],
            "anon_mib": mib["RssAnon"],
            "file_mib": mib["RssFile"],
        }
        self.dirpath.mkdir(parents=True, exist_ok=True)
        (self.dirpath / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
        trainer.should_stop = True


def _config(work: Path, name: str, devices: int, model_dtype: str) -> Path:
    out = work / name
    strategy = "auto"
    if devices > 1:
        strategy = {
            "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
            "init_args": {"data_parallel_size": devices, "tensor_parallel_size": 1},
        }
    config = {
        "trainer": {
            "accelerator": "cpu",
            "strategy": strategy,
            "max_steps": 1,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "enable_checkpointing": False,
            "logger": False,
            "use_distributed_sampler": False,
            "default_root_dir": str(out),
            "callbacks": [
                {"class_path": "fsdp2_load.HostMemory", "init_args": {"dirpath": str(out / "memory")}}
            ],
        },
        "model": {
            "model": "default",
            "num_key_value_layers": 20,
            "model_dtype": model_dtype,
            "kv_init": "published",
            "evaluate_before_training": False,
        },
        "data": {
            "train_files": ["dataset:brown_train"],
            "max_length": 256,
            "batch_size": 2,
            "max_train_rows": 8,
        },
    }
    path = work / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def run(devices: int, model_dtype: str, work: Path) -> list[dict]:
    """The per-process records of one run: ``devices`` processes (1: unsharded) with weights in ``model_dtype``."""
    name = f"{model_dtype}-{devices}"
    config = _config(work, name, devices, model_dtype)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(ROOT)])}
    app = [str(ROOT / "apps" / "distill.py"), "--config", str(config)]
    if devices == 1:
        command = [sys.executable, *app]
    else:
        fabric = shutil.which("fabric", path=str(Path(sys.executable).parent))
        command = [fabric, "run", "--accelerator", "cpu", "--devices", str(devices), *app]
    print(f"{name}: {' '.join(command)}", flush=True)
    subprocess.run(command, check=True, env=env, cwd=work, timeout=1200, stdout=subprocess.DEVNULL)
    records = [json.loads(p.read_text()) for p in sorted((work / name / "memory").glob("rank*.json"))]
    if len(records) != devices:
        raise RuntimeError(f"{name}: {len(records)} of {devices} processes reported their memory")
    return records


def main(
    devices: int = 2,
    model_dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    label: str = "this checkout",
    out: Path = RESULTS / "fsdp2-load.json",
) -> None:
    """Measure, for each dtype, one unsharded process and ``devices`` FSDP2 processes; write ``out`` (.json, .md)."""
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for dtype in model_dtypes:
            (single,) = run(1, dtype, Path(work))
            for processes, record in [(1, single), *((devices, r) for r in run(devices, dtype, Path(work)))]:
                ratio = record["peak_rss_mib"] / single["peak_rss_mib"]
                rows.append(
                    {"model_dtype": dtype, "processes": processes, **record, "peak_vs_unsharded": ratio}
                )
    command = shlex.join(["python", "benchmarks/fsdp2_load.py", *sys.argv[1:]])
    out.write_text(json.dumps({"label": label, "command": command, "rows": rows}, indent=1) + "\n")
    lines = [
        f"# Host memory per process at the first step, FSDP2 over {devices} processes vs unsharded ({label})",
        "",
        f"Command: `{command}`. SmolLM2-135M-Instruct (513 MiB of fp32 weights), l = 20, on the CPU; each process",
        "measured when training starts (its model built, sharded and set up). Anonymous: the process's own copies",
        "(weights cast from the fp32 file to bf16, FSDP2 shards). File-backed: pages of mapped files, shared by the",
        "processes of a machine: mostly the libraries; fp32 weights loaded as fp32 stay mapped from the checkpoint and are",
        "read when first used. On a CPU the shards and the broadcast's passing whole tensors are host memory: on a GPU",
        "they are the device's (not measured here), and only the whole model rank 0 builds stays on the host.",
        "",
        "| model_dtype | processes | rank | peak RSS (MiB) | vs unsharded | anonymous now (MiB) | file-backed now (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model_dtype']} | {r['processes']} | {r['rank']} | {r['peak_rss_mib']:.0f} | "
            f"{r['peak_vs_unsharded']:.2f} | {r['anon_mib']:.0f} | {r['file_mib']:.0f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    auto_cli(main)
