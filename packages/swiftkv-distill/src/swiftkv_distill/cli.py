"""``swiftkv distill fit --config RECIPE``: the LightningCLI of SwiftKV distillation.

``RECIPE`` is a YAML path or the name of a shipped recipe (``smollm2-135m-cpu``; ``recipe.py``), so the command
works from any folder. ``swiftkv-distill`` is the same command.
"""

from __future__ import annotations

from .launch import LaunchError, bad_input, meet_at_start, start_answering
from .recipe import make_cli


def main(args=None) -> None:
    """``swiftkv-distill`` (``swiftkv distill``): bad input gets one line, no traceback (SWIFTKV_DEBUG=1 shows it).
    A process of a launch that stops before the run starts tells the others why (``launch.meet_at_start``); until
    then it answers, so the others can tell it from one killed hard (``launch.start_answering``)."""
    import os
    import sys

    try:
        start_answering()
        make_cli(args)
    except Exception as error:
        line = _one_line(error)
        try:
            meet_at_start((bad_input(error), f"{type(error).__name__}: {line or error}"))
        except Exception as unheard:  # this process's own reason still comes last
            print(
                f"swiftkv distill: the other processes may not hear why this one stops: {unheard}",
                file=sys.stderr,
            )
        if line is None or os.environ.get("SWIFTKV_DEBUG"):
            raise
        raise SystemExit(f"swiftkv distill: {line}") from None
    _end_process_group()


def _one_line(error: Exception) -> str | None:
    """What the command prints for bad input (``launch.bad_input``) or a stop for another process or the launch
    (``LaunchError``, whose traceback is this process's, not the cause's); None: a traceback is worth more."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    if isinstance(error, LaunchError):
        return " ".join(str(error).split())
    if not bad_input(error):
        return None
    if isinstance(error, MisconfigurationException):  # Lightning's: an accelerator this machine does not have
        return f"{_with_fix(str(error))} (SWIFTKV_DEBUG=1 shows where)"
    return " ".join(str(error).split())


def _with_fix(message: str) -> str:
    """Lightning's message, and the fix where it gives none."""
    message = " ".join(message.split())
    if "gpu backend" in message:
        from swiftkv_core.runtime import why_no_gpu

        message += (
            f" trainer.accelerator is gpu, and no CUDA GPU is visible here: {why_no_gpu()}. Use a CPU recipe "
            "(--config smollm2-135m-cpu) or --trainer.accelerator cpu, or run on a GPU machine (the "
            "swiftkv-train:cuda image)."
        )
    return message


RANK0_DONE = "swiftkv-rank0-done"


def _end_process_group() -> None:
    """Under a launcher, wait for rank 0 (it may still be writing the export) and tear the process group down before
    the interpreter exits: a rank that exits with it alive can abort in gloo's threads ("terminate called without an
    active exception"), and the launcher then kills the others mid-write. The wait is on the launcher's store, not
    a collective: a collective's wait ends at the process group's timeout (Lightning's 30 min; a 70B export to slow
    storage takes longer), which failed the job and had the launcher kill rank 0 mid-write. A rank 0 that fails
    ends the job through the launcher instead."""
    from datetime import timedelta

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        store.set(RANK0_DONE, "1")
    else:
        store.wait([RANK0_DONE], timedelta(days=7))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
