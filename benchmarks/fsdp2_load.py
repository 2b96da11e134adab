"""Host memory of each process of a distillation run sharded with FSDP2, once its model is built: against one
unsharded process of the same run (the baseline, measured in the same invocation); and the same sharded run resumed
from its distributed checkpoint (the trained weights: rank 0 reads the frozen ones from the model again).

Each run is the real job (``apps/distill.py``, Lightning's ModelParallelStrategy over gloo, ``fabric run`` with
``--devices N`` processes) on the default model, measured before its first step: the sharded run then takes one step
and writes its checkpoint, which the resumed run (``--ckpt_path``) restores. A callback records, in every process,
its peak RSS since it started, what it holds then (anonymous memory: its own copies; file-mapped pages: the libraries,
checkpoint files mapped by safetensors, shared between the processes of a machine) and the seconds since it started.

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
    sharded, on its device and restored from a checkpoint if resumed; no step taken), then stops the run (``stop``)."""

    def __init__(self, dirpath: str, stop: bool = True):
        self.dirpath, self.stop = Path(dirpath), stop

    def on_train_start(self, trainer, pl_module) -> None:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        mib = {key: int(status[key].split()[0]) / 1024 for key in ("VmRSS", "RssAnon", "RssFile")}
        record = {
            "rank": trainer.global_rank,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_mib": mib["VmRSS"],
            "anon_mib": mib["RssAnon"],
            "file_mib": mib["RssFile"],
            "seconds": _seconds_since_start(),
        }
        self.dirpath.mkdir(parents=True, exist_ok=True)
        (self.dirpath / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
        trainer.should_stop = self.stop


def _seconds_since_start() -> float:
    """Seconds since this process started (the kernel's start time; Python's imports included)."""
    started_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - started_ticks / os.sysconf("SC_CLK_TCK")


def _config(work: Path, name: str, devices: int, model_dtype: str, checkpoints: Path | None = None) -> Path:
    """The run's config. With ``checkpoints`` (a sharded run's): measured, it takes one step and writes its
    checkpoint there, which the resumed run restores (measured before its second step)."""
    out = work / name
    strategy = "auto"
    if devices > 1:
        strategy = {
            "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
            "init_args": {"data_parallel_size": devices, "tensor_parallel_size": 1},
        }
    memory = {"dirpath": str(out / "memory"), "stop": checkpoints is None}
    callbacks = [{"class_path": "fsdp2_load.HostMemory", "init_args": memory}]
    if checkpoints is not None:
        callbacks.append({
            "class_path": "swiftkv_distill.checkpointing.ModelCheckpoint",
            "init_args": {"dirpath": str(checkpoints), "every_n_train_steps": 1, "save_top_k": -1},
        })  # fmt: skip
    config = {
        "trainer": {
            "accelerator": "cpu",
            "strategy": strategy,
            "max_steps": 1,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "enable_checkpointing": checkpoints is not None,
            "logger": False,
            "use_distributed_sampler": False,
            "default_root_dir": str(out),
            "callbacks": callbacks,
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


def run(devices: int, model_dtype: str, work: Path, resume: bool = False) -> list[dict]:
    """The per-process records of one run: ``devices`` processes (1: unsharded) with weights in ``model_dtype``;
    a sharded run writes a checkpoint after its step, which ``resume`` restores instead."""
    name = f"{model_dtype}-{devices}" + "-resumed" * resume
    checkpoints = work / f"{model_dtype}-{devices}-checkpoints" if devices > 1 else None
    config = _config(work, name, devices, model_dtype, None if resume else checkpoints)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(ROOT)])}
    app = [str(ROOT / "apps" / "distill.py"), "--config", str(config)]
    if resume:  # from step 1: one step more to train, so that training starts
        (step1,) = checkpoints.glob("*step=1.ckpt")
        app += ["--ckpt_path", str(step1), "--trainer.max_steps", "2"]
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
    """Measure, for each dtype, one unsharded process, ``devices`` FSDP2 processes and the same resumed from their
    checkpoint; write ``out`` (.json, .md)."""
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for dtype in model_dtypes:
            (single,) = run(1, dtype, Path(work))
            runs = [("fresh", [single]), ("fresh", run(devices, dtype, Path(work)))]
            runs.append(("resumed", run(devices, dtype, Path(work), resume=True)))
            for start, records in runs:
                for record in records:
                    ratio = record["peak_rss_mib"] / single["peak_rss_mib"]
                    rows.append({"model_dtype": dtype, "processes": len(records), "start": start, **record,
                                 "peak_vs_unsharded": ratio})  # fmt: skip
    command = shlex.join(["python", "benchmarks/fsdp2_load.py", *sys.argv[1:]])
    out.write_text(json.dumps({"label": label, "command": command, "rows": rows}, indent=1) + "\n")
    lines = [
        f"# Host memory per process at the first step, FSDP2 over {devices} processes vs unsharded ({label})",
        "",
        f"Command: `{command}`. SmolLM2-135M-Instruct (513 MiB of fp32 weights), l = 20, on the CPU; each process",
        "measured when training starts (its model built, sharded, set up and, resumed, restored from the sharded",
        "run's distributed checkpoint after its first step). Anonymous: the process's own copies (weights cast from the",
        "fp32 file to bf16, FSDP2 shards). File-backed: pages of mapped files, shared by the processes of a machine:",
        "mostly the libraries; fp32 weights loaded as fp32 stay mapped from the checkpoint and are read when first used.",
        "On a CPU the shards and the broadcast's passing whole tensors are host memory: on a GPU they are the device's",
        "(not measured here), and only the whole model rank 0 builds stays on the host. Seconds: from the process's start",
        "(imports included) to training's.",
        "",
        "| model_dtype | processes | start | rank | peak RSS (MiB) | vs unsharded | anonymous now (MiB) "
        "| file-backed now (MiB) | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model_dtype']} | {r['processes']} | {r['start']} | {r['rank']} | {r['peak_rss_mib']:.0f} | "
            f"{r['peak_vs_unsharded']:.2f} | {r['anon_mib']:.0f} | {r['file_mib']:.0f} | {r['seconds']:.1f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    auto_cli(main)
