"""A main-job run: its output folder, its settings and each finished stage's results in ``state.json`` (written
atomically after every stage), and the runner that skips the stages an earlier, interrupted run finished."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from .settings import QuickstartError, Settings


@dataclass(frozen=True)
class Stage:
    """One stage of the main job: its name (the key of its results) and the function that runs it."""

    name: str
    run: Callable[[Run], dict]


class Run:
    """The output folder: settings, each finished stage's results (state.json, atomic), the artefacts."""

    def __init__(self, root: Path, settings: Settings, force: bool):
        self.root, self.settings = root, settings
        state_file = root / "state.json"
        if force and root.exists():
            if not state_file.is_file() and any(root.iterdir()):  # never delete what is not a quickstart run
                raise QuickstartError(
                    f"--out {root} is not a quickstart run (no state.json): --force deletes only those. Choose "
                    "another --out."
                )
            shutil.rmtree(root)
        if state_file.is_file():
            earlier = json.loads(state_file.read_text())
            again = self._check_same_run(earlier)
            self.results = {name: r for name, r in earlier["results"].items() if name not in again}
        elif root.exists() and any(root.iterdir()):
            raise QuickstartError(
                f"--out {root} exists and is not a quickstart run (no state.json): choose another --out, or --force "
                "to delete it."
            )
        else:
            self.results = {}
        root.mkdir(parents=True, exist_ok=True)
        self._save()

    @classmethod
    def open(cls, root: Path, needs: tuple[str, ...] = ()) -> Run:
        """An earlier run, read only (for tools that build on its results): ``needs`` names the stages it must have
        finished. Nothing is written."""
        state_file = Path(root) / "state.json"
        if not state_file.is_file():
            raise QuickstartError(
                f"{root}: no state.json there; give a quickstart run folder (swiftkv quickstart --out)."
            )
        state = json.loads(state_file.read_text())
        if missing := [name for name in needs if name not in state["results"]]:
            raise QuickstartError(
                f"{root}: the run has not finished its stages {missing}: run the quickstart to the end first."
            )
        run = cls.__new__(cls)
        run.root, run.settings, run.results = Path(root), Settings(**state["settings"]), state["results"]
        return run

    def _check_same_run(self, earlier: dict) -> set[str]:
        """Refuse to continue a run with other settings, but those one stage alone reads (``STAGE_SETTINGS``):
        returns the finished stages to run again for them (and the report)."""
        before, now = _written_now(earlier["settings"], asdict(self.settings)), asdict(self.settings)
        if before.get("model_identity") != now["model_identity"]:
            path = before.get("model_identity", {}).get("path")
            which = (
                f"of {path} as it was before its files changed (config or weights)"
                if path == now["model_identity"]["path"]
                else f"of another model ({path})"
            )
            raise QuickstartError(
                f"--out {self.root} holds the run {which}: choose another --out, or --force to replace it."
            )
        changed = sorted(k for k in now if before.get(k) != now[k])
        changes = ", ".join(f"{k}: {before.get(k)!r} -> {now[k]!r}" for k in changed)
        if any(k not in STAGE_SETTINGS for k in changed):
            raise QuickstartError(
                f"--out {self.root} holds a run with other settings ({changes}): run with the same settings to "
                "continue it, choose another --out, or --force to start over."
            )
        again = {STAGE_SETTINGS[k] for k in changed} & earlier["results"].keys()
        if again:
            stages = ", ".join(sorted(s.replace("_", " ") for s in again))
            print(f"note: {changes}: the {stages} stage and the report run again, every other one is kept")
        return again | ({"report"} if again else set())

    def path(self, name: str) -> Path:
        return self.root / name

    @property
    def num_key_value_layers(self) -> int:
        """The run's num_key_value_layers: the one given, or the frontier stage's pick for ``auto``."""
        given = self.settings.num_key_value_layers
        return given if isinstance(given, int) else self.results["frontier"]["chosen"]

    @property
    def device(self):
        """Where the stages run: the GPU (``cuda``) or the CPU."""
        import torch

        return torch.device("cuda" if self.settings.accelerator == "gpu" else "cpu")

    @property
    def dtype(self):
        """The weights' dtype of the HF stages (analysis, evaluation, prefill): bf16 on a GPU, fp32 on a CPU."""
        from swiftkv_core.runtime import choose_dtype

        return choose_dtype("auto", self.device)

    def device_description(self) -> str:
        from swiftkv_core.runtime import device_description

        return f"{device_description(self.device)}, {str(self.dtype).removeprefix('torch.')}"

    def _save(self) -> None:
        from swiftkv_core.atomic import atomic_file
        from swiftkv_core.faults import pause_point

        with atomic_file(self.root / "state.json") as f:
            json.dump({"settings": asdict(self.settings), "results": self.results}, f, indent=2)
            pause_point("state-write")  # the new state written beside the old one, not yet in its place

    def _out_of_memory(self, stage: str, error: Exception) -> str:
        """What ran out of memory (the GPU's where the error is CUDA's, else the CPU's), where, and how to go on:
        the stages before it are kept."""
        import torch

        from swiftkv_core.runtime import device_description

        gpu = "CUDA" in str(error) and torch.cuda.is_available()
        where = device_description("cuda" if gpu else "cpu")
        if gpu:
            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            peak = torch.cuda.max_memory_allocated()
            where += f" ({total / 2**30:.0f} GiB; {peak / 2**30:.1f} GiB of tensors at the stage's peak)"
        free = "free the GPU (another process on it?)" if gpu else "free memory (other processes?)"
        smaller = "or one on the CPU (--accelerator cpu) " if gpu else ""
        first_line = str(error).partition("\n")[0]
        return (
            f"the {stage.replace('_', ' ')} stage ran out of memory on {where}: {first_line} "
            f"The stages before it are kept ({self.root / 'state.json'}): {free} and rerun the same command to go "
            f"on from this stage, or start a smaller run (--prompt_lengths, --max_eval_rows) {smaller}with another "
            "--out."
        )

    def run_stages(self, stages: list[Stage]) -> None:
        """Each stage in order, announced; one finished earlier (its results in state.json) is reused. On a GPU, each
        starts with the memory the ones before it held given back (``release_device_memory``)."""
        import torch

        from swiftkv_core.runtime import release_device_memory

        for index, stage in enumerate(stages, 1):
            header = f"== {index}/{len(stages)} {stage.name.replace('_', ' ')}"
            if stage.name in self.results:
                print(f"{header}: done earlier, reused", flush=True)
                continue
            print(header, flush=True)
            release_device_memory(self.device)
            started = time.perf_counter()
            try:
                result = stage.run(self)
            except torch.OutOfMemoryError as error:  # (the distillation's own says what to change already)
                raise MemoryError(self._out_of_memory(stage.name, error)) from error
            result["seconds"] = time.perf_counter() - started
            if "skipped" in result:
                print(f"   skipped: {result['skipped']}", flush=True)
            self.results[stage.name] = result
            self._save()


@contextmanager
def quiet() -> Iterator[None]:
    """Only what a user can act on, while the block runs: Lightning's tips and info lines, known-harmless warnings
    and per-file progress bars are silenced. Every level, filter and switch is put back afterwards, so a process
    that goes on (a test worker, a notebook) logs as before."""
    import datasets
    import lightning.pytorch  # noqa: F401  (sets its loggers' levels when imported: import first, then quieten)
    from transformers.utils import logging as transformers_logging

    loggers = [logging.getLogger(name) for name in _QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    datasets_bars = not datasets.are_progress_bars_disabled()
    transformers_bars = transformers_logging.is_progress_bar_enabled()
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        with warnings.catch_warnings():
            for message in _HARMLESS_WARNINGS:
                warnings.filterwarnings("ignore", message=message)
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", category=FutureWarning)
            for logger in loggers:
                logger.setLevel(logging.ERROR)
            datasets.disable_progress_bars()  # "Generating train split" for every small file
            transformers_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" for every load
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        if datasets_bars:
            datasets.enable_progress_bars()
        if transformers_bars:
            transformers_logging.enable_progress_bar()
        if parallelism is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)


_QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning", "transformers", "vllm")
_HARMLESS_WARNINGS = (
    ".*litlogger.*",
    ".*does not have many workers.*",
    ".*Experiment logs directory .* exists and is not empty.*",
    ".*Checkpoint directory .* exists and is not empty.*",
    ".*max_steps.*",
)


# settings one stage alone reads (and the report): changed on a rerun, that stage and the report run again, and
# every other finished stage is kept (a serving workload too long for the machine costs the serving stage only)
STAGE_SETTINGS = {
    "threshold": "analyze", "prompt_lengths": "prefill", "serve": "serve", "serve_workloads": "serve",
    "serve_requests": "serve", "serve_compile": "serve", "eval_tasks": "task_accuracy",
}  # fmt: skip


def _written_now(before: dict, now: dict) -> dict:
    """The settings of a run an earlier version wrote, in today's terms where they say the same: its model identity
    without the weights' digests (sizes, config and path equal), no input files' digests (not recorded then), and
    the defaults of settings added since (``min_agreement``, ``eval_tasks``). So a run interrupted before an upgrade
    continues."""
    before = dict(before)
    old, current = before.get("model_identity") or {}, now["model_identity"]
    sizes = {name: file["bytes"] for name, file in current["weight_files"].items()}
    same_rest = {k: v for k, v in old.items() if k != "weight_sizes"} == {
        k: v for k, v in current.items() if k != "weight_files"
    }
    if "weight_sizes" in old and old["weight_sizes"] == sizes and same_rest:
        before["model_identity"] = current
    if "input_files" not in before:
        before["input_files"] = now["input_files"]
    for setting in fields(Settings):
        if setting.name not in before and setting.default is not MISSING:
            before[setting.name] = setting.default
        elif setting.name not in before and setting.default_factory is not MISSING:
            before[setting.name] = setting.default_factory()
    return before
