"""SwiftKV distillation as a launchable job: the same LightningCLI as ``swiftkv-distill``, for multi-process and
multi-node launchers (``fabric run``, ``torchrun``, SLURM), which start this script once per process.

    # one process (as `swiftkv-distill fit --config ...`)
    python apps/distill.py --config configs/distill/smollm2-135m-cpu.yaml

    # 2 processes on this CPU, FSDP2-sharded (ModelParallelStrategy over gloo)
    fabric run --accelerator cpu --devices 2 apps/distill.py --config configs/distill/smollm2-135m-cpu.yaml \
        --trainer.strategy lightning.pytorch.strategies.ModelParallelStrategy \
        --trainer.strategy.data_parallel_size 2 --trainer.strategy.tensor_parallel_size 1

    # a GPU node / several nodes
    torchrun --nnodes 2 --nproc-per-node 8 ... apps/distill.py --config configs/distill/llama-3.1-70b-instruct.yaml \
        --model.model /models/Llama-3.1-70B-Instruct --data.train_files '[/data/chat.jsonl]'

The launcher's settings (``fabric run`` exports LT_ACCELERATOR, LT_DEVICES, LT_NUM_NODES, LT_PRECISION) become
trainer arguments unless the command line sets them. Without a subcommand the job runs ``fit``.
"""

from __future__ import annotations

import os
import sys

from swiftkv_distill.cli import main

SUBCOMMANDS = {"fit", "validate", "test", "predict"}
LAUNCHER_ENV = {
    "LT_ACCELERATOR": "accelerator",
    "LT_DEVICES": "devices",
    "LT_NUM_NODES": "num_nodes",
    "LT_PRECISION": "precision",
}


def job_arguments(argv: list[str], environ: dict[str, str]) -> list[str]:
    """``argv`` with ``fit`` in front if no subcommand is given, plus the launcher's trainer settings."""
    args = list(argv)
    if not args or args[0] not in SUBCOMMANDS:
        args = ["fit", *args]
    for variable, option in LAUNCHER_ENV.items():
        given = any(a == f"--trainer.{option}" or a.startswith(f"--trainer.{option}=") for a in args)
        if environ.get(variable) and not given:
            args += [f"--trainer.{option}", environ[variable]]
    return args


if __name__ == "__main__":
    main(job_arguments(sys.argv[1:], dict(os.environ)))
